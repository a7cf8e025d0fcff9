"""Evaluation protocols: nonoverlapping, sliding (stride) and growing_context, and the per-position
loss saved beside every run."""
import csv
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import posbench
from posbench.core.errors import ConfigError
from posbench.evaluations.perplexity import bin_positions, eval_plan, evaluate
from helpers import posbench_cli, results


@pytest.fixture(scope="module")
def model():
    cfg = posbench.compose(["encoding=alibi", "model.n_layer=1", "model.d_model=32",
                            "model.n_head=2"])
    torch.manual_seed(0)
    return posbench.build_model(cfg).eval()


def eval_cfg(protocol, lengths=(64, 256), tokens=512, stride=None):
    return OmegaConf.create({"lengths": list(lengths), "tokens": tokens, "batch_tokens": 1024,
                             "protocol": protocol, "stride": stride})


def scored_targets(data, plan):
    """(token offset of every scored target, its context length), window by window; every
    window inside one validation document."""
    val = data.val_docs
    for start in plan.starts:
        doc = np.searchsorted(val, start, side="right") - 1
        assert val[0] <= start and start + plan.length + 1 <= val[doc + 1]
    return [(start + 1 + p, p + 1) for start in plan.starts
            for p in range(plan.first, plan.length)]


def test_sliding_scores_the_last_stride_tokens_each_with_a_full_window(stdlib_data, model):
    cfg = eval_cfg("sliding", lengths=(128,), tokens=96, stride=32)
    plan = eval_plan(stdlib_data, 128, cfg)
    assert plan.count == 3 and plan.first == 96
    targets = scored_targets(stdlib_data, plan)
    assert len({t for t, _ in targets}) == 96  # no token scored twice
    assert min(context for _, context in targets) == 97
    point = evaluate(model, stdlib_data, cfg, torch.device("cpu"))[0]
    assert point["tokens"] == 96
    rows = torch.from_numpy(plan.rows(0, 3)[0].astype(np.int64))
    with torch.no_grad():
        losses = model.token_losses(rows[:, :-1], rows[:, 1:])[:, 96:]
    assert math.isclose(point["loss"], losses.double().mean().item(), rel_tol=1e-6)
    assert point["per_position"]["start"][0] == 96
    # each window's own mean loss, in the plan's order: what paired comparisons resample
    assert point["windows"]["tokens"] == [32, 32, 32]
    np.testing.assert_allclose(point["windows"]["loss"], losses.double().mean(1).numpy(),
                               rtol=1e-6)


def test_sliding_with_stride_one(stdlib_data, model):
    point = evaluate(model, stdlib_data, eval_cfg("sliding", lengths=(32,), tokens=8, stride=1),
                     torch.device("cpu"))[0]
    assert point["tokens"] == 8 and point["per_position"]["start"] == [31]


def test_growing_context_scores_the_same_tokens_with_more_context(stdlib_data, model):
    cfg = eval_cfg("growing_context", lengths=(32, 128, 512), tokens=64)
    plans = [eval_plan(stdlib_data, n, cfg) for n in (32, 128, 512)]
    scored = [scored_targets(stdlib_data, p) for p in plans]
    assert [t for t, _ in scored[0]] == [t for t, _ in scored[1]] == [t for t, _ in scored[2]]
    assert [min(c for _, c in s) for s in scored] == [1, 97, 481]
    curve = evaluate(model, stdlib_data, cfg, torch.device("cpu"))
    assert [p["tokens"] for p in curve] == [64, 64, 64]
    blocked = evaluate(model, stdlib_data, eval_cfg("growing_context", (32, 128), 64, stride=8),
                       torch.device("cpu"))
    assert blocked[1]["per_position"]["start"][0] == 120


def test_per_position_bins_keep_early_positions_and_sum_to_the_loss(stdlib_data, model):
    point = evaluate(model, stdlib_data, eval_cfg("nonoverlapping", (1024,), 2048),
                     torch.device("cpu"))[0]
    bins = point["per_position"]
    assert bins["start"][:4] == [0, 1, 2, 3] and bins["end"][-1] == 1024
    assert len(bins["start"]) <= 64 and bins["start"][1:] == bins["end"][:-1]
    weighted = sum(l * n for l, n in zip(bins["loss"], bins["tokens"])) / sum(bins["tokens"])
    assert math.isclose(weighted, point["loss"], rel_tol=1e-9)
    short = bin_positions(np.arange(10.0), np.ones(10, dtype=np.int64))
    assert short["start"] == list(range(10)) and short["loss"] == list(np.arange(10.0))


@pytest.mark.parametrize("overrides,key", [
    (["eval.protocol=sliding"], "eval.stride"),
    (["eval.protocol=sliding", "eval.stride=0"], "eval.stride"),
    (["eval.protocol=growing_context", "eval.stride=4096"], "eval.stride"),
])
def test_protocol_settings_are_checked_at_compose(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        posbench.compose(overrides)


@pytest.mark.figures  # it reads the PNG
def test_run_records_protocol_stride_and_per_position(tmp_path, toy):
    posbench_cli("train", *toy, "eval.protocol=sliding", "eval.stride=16", "hydra.run.dir=run",
                 cwd=tmp_path, in_process=True)
    run = tmp_path / "run"
    record = results(run)
    assert record["eval"]["protocol"] == "sliding" and record["eval"]["stride"] == 16
    rows = list(csv.DictReader(open(run / "per_position.csv")))
    assert {int(r["length"]) for r in rows} == {32, 64}
    assert min(int(r["start"]) for r in rows if r["length"] == "64") == 48
    assert (run / "per_position.png").read_bytes()[:4] == b"\x89PNG"
