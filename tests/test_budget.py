"""train.budget (posbench/runs/budget.py): tokens, today's protocol bit for bit; flops, each
encoding's steps from its FLOPs per step, and each encoding's declared FLOPs against a count of
its own operations; wallclock, a run stopped and resumed by the clock; the refusals."""
import dataclasses
import math
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

import posbench
import posbench.runs.budget
import posbench.runs.distributed
import posbench.runs.train
from posbench.core.errors import ConfigError
from posbench.encodings import Dims, PositionalEncoding, registry
from posbench.runs.budget import device_name, plan
from posbench.runs.checkpoint import Checkpoint
from posbench.runs.estimate import step_flops
from posbench.runs.run import RunFailed, train
from helpers import killed_in_step

RUN = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "train.seq_len=32",
       "train.batch_size=2", "train.steps=6", "train.warmup_steps=2", "train.log_every=2",
       "train.ckpt_every=2", "train.val_every=0", "eval.lengths=[32]", "eval.tokens=128",
       "device=cpu"]


def run(tmp_path, name, *overrides):
    cfg = posbench.compose([*RUN, *overrides])
    posbench.config.check(cfg)
    return train(cfg, tmp_path / name, group="test", name=name)


def test_the_default_budget_is_an_explicit_tokens_run_bit_for_bit(tmp_path):
    default = run(tmp_path, "default", "encoding=rope")
    tokens = run(tmp_path, "tokens", "encoding=rope", "train.budget=tokens")
    assert default["eval"]["curve"] == tokens["eval"]["curve"]  # floats compared exactly
    assert default["train"]["final_loss"] == tokens["train"]["final_loss"]
    assert default["train"]["steps"] == 6 and default["train"]["budget"] == "tokens"


# the tiny model at L = 128, the defaults of `posbench train`
ENCODINGS = ["rope", "nope", "alibi", "fire", "cope", "fox", "path", "stick_breaking",
             "selective_rope", "t5"]


def oracle_step_flops(cfg) -> float:
    """FLOPs of a training step, recomputed here: 6 x the multiplying weights x tokens, the
    attention core 6 n_layer L d x tokens, 3 x the encoding's declared forward FLOPs over the
    causal pairs."""
    model = posbench.build_model(cfg)
    m, t = cfg.model, cfg.train
    weights = (sum(p.numel() for p in model.parameters())
               - sum(p.numel() for p in model.encoding.parameters()))
    tokens, L = t.batch_size * t.seq_len, t.seq_len
    declared = model.encoding.flops(t.batch_size, L, sum(range(1, L + 1)))
    return 6 * weights * tokens + 6 * m.n_layer * L * m.d_model * tokens + 3 * declared


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_flops_budget_gives_each_encoding_the_steps_its_flops_pay_for(encoding):
    cfg = posbench.compose([f"encoding={encoding}", "train.budget=flops"])
    posbench.config.check(cfg)
    budget = oracle_step_flops(posbench.compose(["encoding=rope"])) * cfg.train.steps
    expected = round(budget / oracle_step_flops(cfg))
    planned = plan(cfg)
    assert planned.steps == expected
    assert planned.flops == pytest.approx(budget, rel=1e-12)
    assert planned.schedule.warmup_steps == round(cfg.train.warmup_steps * expected
                                                  / cfg.train.steps)


def test_a_dearer_encoding_trains_fewer_steps_and_records_its_flops(tmp_path):
    result = run(tmp_path, "path", "encoding=path", "train.budget=flops")["train"]
    assert result["budget"] == "flops" and result["steps_run"] == result["steps"] < 6
    assert result["flops_spent"] == result["steps_run"] * result["flops_per_step"]
    assert abs(result["flops_spent"] - result["budget_flops"]) <= result["flops_per_step"] / 2


# Every operation the encoding's hooks run, counted as the contract counts (posbench/encodings/
# base.py): FlopCounterMode's matmuls and convolutions (2 per multiply-add), the triangular
# solve PaTH runs, and one per element for arithmetic, transcendental functions and reductions
aten = torch.ops.aten


def _shape(shape):  # an op with several outputs gives a tuple of shapes: its first
    return shape[0] if shape and not isinstance(shape[0], int) else shape


def per_output(*args, out_shape=None, **kwargs):
    return math.prod(_shape(out_shape))


def per_input(x_shape, *args, out_shape=None, **kwargs):
    return math.prod(x_shape)


def per_source(self_shape, dim, index_shape, src_shape, *args, out_shape=None, **kwargs):
    return math.prod(src_shape)


def triangular_solve(a_shape, b_shape, *args, out_shape=None, **kwargs):
    return math.prod(b_shape) * (a_shape[-1] - 1)  # unit diagonal: n - 1 multiply-adds a row


ELEMENTWISE = (aten.add, aten.sub, aten.rsub, aten.mul, aten.div, aten.neg, aten.reciprocal,
               aten.exp, aten.log, aten.log1p, aten.sigmoid, aten.log_sigmoid_forward,
               aten.relu, aten.silu, aten.softplus, aten.cos, aten.sin, aten.rsqrt, aten.sqrt,
               aten.pow, aten.square, aten.abs, aten.maximum, aten.minimum, aten.cumsum,
               aten.leaky_relu)
def convolution(x_shape, w_shape, bias_shape, stride, padding, dilation, transposed, *args,
                out_shape=None, **kwargs):
    """FlopCounterMode's multiply-adds, and one for the bias added to each output (DAPE)."""
    return (conv_flop_count(x_shape, w_shape, out_shape, transposed=transposed)
            + (math.prod(out_shape) if bias_shape is not None else 0))


COUNTS = {**{op: per_output for op in ELEMENTWISE}, aten.sum: per_input, aten.mean: per_input,
          aten.scatter_add: per_source, aten.scatter_add_: per_source,
          aten.linalg_solve_triangular: triangular_solve, aten.convolution: convolution,
          aten.addcmul: lambda *a, out_shape=None, **k: 2 * math.prod(out_shape)}
B, T, N_LAYER, H, D = 2, 128, 2, 2, 32  # T = 2 x PaTH's chunk: its sweep over earlier chunks runs


def measured_flops(name, **changes) -> int:
    """Counted FLOPs of one dense float64 forward of the encoding's hooks at every layer, in
    training mode: every (query, key) pair scored, T^2 per sequence. `changes`: config values
    other than the registered ones."""
    entry = registry()[name]
    torch.manual_seed(0)
    cfg = dataclasses.replace(entry.config, **changes)
    enc = entry.cls(cfg, Dims(N_LAYER, H, D, train_len=T, max_len=4 * T))
    enc = enc.double().train()
    pos = torch.arange(T).expand(B, T)
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    q_idx, kv_idx = torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T)

    def randn(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    with FlopCounterMode(display=False, custom_mapping=COUNTS) as counted:
        if enc.positions is not None:
            pos = enc.positions(pos)
        for layer in range(N_LAYER):
            own, index = enc.at_layer(layer)
            x, q, k = randn(B, T, D), randn(B, H, T, D // H), randn(B, H, T, D // H)
            inputs = {"x": x} if own.reads_input else {}
            scores = torch.randn(B, H, T, T, dtype=torch.float64)
            if own.embed is not None:
                own.embed(x, pos, index)
            if own.rotate is not None:
                q, k = own.rotate(q, k, pos, index)
            if own.score_mod is not None:
                scores = own.score_mod(q, k, pos, index, **inputs)(scores, b, h, q_idx, kv_idx)
            if own.row_mod is not None:
                scores = own.row_mod(scores, q, k, pos, index, q_idx, kv_idx, **inputs)
            if own.mix_heads is not None:
                mix, _ = own.mix_heads(q, k, pos, index)
                scores = mix(scores, b, h, q_idx, kv_idx, kv_idx > q_idx)
            if own.value_mod is not None:
                own.value_mod(torch.softmax(scores.detach(), -1), pos, index, q_idx, kv_idx)
    return counted.get_total_flops(), enc


# the attention core's dense forward at these sizes (q.k and the weighted sum, 4 d per pair and
# head): the scale of "negligible"
CORE = N_LAYER * B * T * T * 4 * D
DECLARED = sorted(name for name, entry in registry().items()
                  if entry.cls.flops is not PositionalEncoding.flops)
# left at the default 0: they must do no counted work at all
DEFAULT = sorted(set(registry()) - set(DECLARED))


@pytest.mark.parametrize("name", DECLARED)
def test_each_declared_count_matches_its_operations_counted(name):
    """Within 10%, or within 1% of the attention core where the difference is that small (RoPE's
    variants that add a little work to its rotation: FoPE, xPos). PaTH's count is the chunked
    algorithm's at a causal pair count: in a dense forward its sweep meets T(T - C) pairs of
    earlier chunks where the declaration counts T^2 - TC/2, about 5% more here."""
    measured, enc = measured_flops(name)
    declared = enc.flops(B, T, T * T)
    assert abs(declared - measured) <= max(0.1 * measured, 0.01 * CORE), (declared, measured)


# config values the registered presets leave untried, whose counts differ: each must still match
VARIANTS = [
    ("grape_a", {"gate": "query"}), ("grape_a", {"gate": "key"}), ("grape_a", {"gate": "none"}),
    ("damped_rope", {"decay": "learned", "alibi": True}),
    ("jordan_rope", {"block_size": 4, "learn_shear": True, "chains": 1}),
    ("alibi_as_group", {"decay": "retnet"}),
    ("integer", {"norm_by": "L"}), ("binary", {"signed": True}),
    ("learned", {"per_layer": True}), ("sinusoidal", {"every_layer": True, "scale_input": False}),
    ("comrope", {"base": 100.0}),
]


@pytest.mark.parametrize("name, changes", VARIANTS, ids=lambda v: str(v))
def test_declared_counts_follow_the_config(name, changes):
    measured, enc = measured_flops(name, **changes)
    assert enc.flops(B, T, T * T) == pytest.approx(measured, rel=1e-9)


@pytest.mark.parametrize("name", DEFAULT)
def test_encodings_left_at_the_default_do_no_counted_work(name):
    measured, enc = measured_flops(name)
    assert enc.flops(B, T, T * T) == 0 and measured == 0, measured


# a checkpoint after every step, so that a kill leaves one behind
WALL = ["encoding=rope", "train.budget=wallclock", "train.budget_seconds=2",
        "train.log_every=1", "train.ckpt_every=1"]


def test_a_wallclock_budget_stops_by_the_clock_and_a_resume_continues_it(tmp_path, monkeypatch):
    whole = run(tmp_path, "whole", *WALL)["train"]
    assert whole["budget"] == "wallclock" and whole["budget_seconds"] == 2
    assert 2 <= whole["seconds_spent"] < 4 and whole["steps_reached"] == whole["steps"] > 1
    assert whole["device"].startswith("cpu")

    real = killed_in_step(monkeypatch, 3)  # after two checkpoints
    with pytest.raises(RunFailed, match="after step 2"):
        run(tmp_path, "resumed", *WALL)
    monkeypatch.setattr(posbench.runs.train, "train_step", real)
    resumed = run(tmp_path, "resumed", *WALL)["train"]
    assert resumed["resumed_from_step"] == 2
    # the seconds of the first start count: the budget is not spent twice
    assert 2 <= resumed["seconds_spent"] < 4


def test_a_wallclock_checkpoint_records_its_device_and_resuming_on_another_is_refused(
        tmp_path, monkeypatch):
    real = killed_in_step(monkeypatch, 3)  # after two checkpoints
    with pytest.raises(RunFailed):
        run(tmp_path, "moved", *WALL)
    monkeypatch.setattr(posbench.runs.train, "train_step", real)
    saved = Checkpoint.load(tmp_path / "moved" / "checkpoint.pt")
    assert saved.device == device_name(torch.device("cpu")) and saved.step == 2
    # the same run dir resumed where device_name reads another machine
    monkeypatch.setattr(posbench.runs.budget, "device_name", lambda device: "NVIDIA H200")
    with pytest.raises(ConfigError) as refused:
        run(tmp_path, "moved", *WALL)
    assert str(refused.value).startswith(
        "device='NVIDIA H200' is not accepted to resume this train.budget=wallclock run; "
        f"expected the device it started on, {saved.device!r}")
    assert "\n" not in str(refused.value)
    assert Checkpoint.load(tmp_path / "moved" / "checkpoint.pt").step == 2  # nothing trained


def test_other_budgets_record_no_device_in_their_checkpoint(tmp_path):
    run(tmp_path, "tokens", "encoding=rope")
    assert Checkpoint.load(tmp_path / "tokens" / "checkpoint.pt").device is None


def test_a_wallclock_budget_over_several_processes_is_refused(monkeypatch):
    monkeypatch.setattr(posbench.runs.distributed, "world_size", lambda: 2)
    cfg = posbench.compose(["encoding=rope", "train.budget=wallclock", "train.budget_seconds=60"])
    with pytest.raises(ConfigError, match=re.escape(
            "train.budget=wallclock is not accepted under 2 processes; expected one device")):
        plan(cfg)


def test_a_flops_budget_below_one_step_is_refused_naming_the_step(tmp_path):
    """PaTH's step costs more than RoPE's: one RoPE step buys none of it."""
    overrides = ["encoding=path", "train.budget=flops", "train.steps=1", "train.warmup_steps=0"]
    cfg = posbench.compose([*RUN, *overrides])
    one_step = step_flops(cfg)
    with pytest.raises(ConfigError) as refused:
        plan(cfg)
    assert str(refused.value) == (
        f"train.steps=1 is not accepted with train.budget=flops; expected a budget of at least "
        f"one step of path, {one_step:.4g} FLOPs (rope spends "
        f"{step_flops(posbench.compose([*RUN, 'encoding=rope'])):.4g} in 1 steps)")
    with pytest.raises(ConfigError):  # before any work: the run dir holds nothing it wrote
        run(tmp_path, "short", *overrides)
    assert not (tmp_path / "short" / "checkpoint.pt").exists()
    assert not (tmp_path / "short" / "results.json").exists()
    # a budget of at least one step trains the steps it pays for
    rope_step = step_flops(posbench.compose([*RUN, "encoding=rope"]))
    steps = math.ceil(one_step / rope_step)
    assert plan(posbench.compose([*RUN, *overrides[:2], f"train.steps={steps}"])).steps == round(
        steps * rope_step / one_step) >= 1


def test_the_time_schedule_warms_up_and_decays_over_the_fraction_spent():
    t = posbench.compose(["train.steps=100", "train.warmup_steps=10"]).train
    lr_at_fraction = posbench.runs.train.lr_at_fraction
    assert lr_at_fraction(0.05, t) == pytest.approx(t.lr / 2)
    assert lr_at_fraction(0.1, t) == pytest.approx(t.lr)
    assert lr_at_fraction(1.0, t) == pytest.approx(t.lr * t.min_lr_ratio)


@pytest.mark.parametrize("overrides, message", [
    (["train.budget=flop"], "train.budget='flop' is not accepted; expected one of "
                            "('tokens', 'flops', 'wallclock') (did you mean 'flops'?)"),
    (["train.budget=wallclock"], "train.budget_seconds=None is not accepted"),
    (["train.budget_seconds=60"], "null with train.budget=tokens"),
    (["train.budget=flops", "train.budget_reference=ropee"], "(did you mean 'rope'?)"),
    (["train.budget=flops", "train.switch_encoding_at=0.5"], "null with train.budget=flops"),
])
def test_bad_budgets_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        posbench.config.check(posbench.compose(["encoding=rope", *overrides]))
