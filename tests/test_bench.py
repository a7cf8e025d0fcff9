"""scripts/bench.py: its baseline is the same function as posbench's model (so the speed ratios
compare equal work), and a small run writes the JSON it promises."""
import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import posbench

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"


def from_scripts(name):
    """scripts/<name>.py imported by name, so that the processes a script spawns find it too."""
    sys.path.insert(0, str(SCRIPT.parent))
    yield importlib.import_module(name)
    sys.path.remove(str(SCRIPT.parent))


@pytest.fixture(scope="module")
def bench():
    yield from from_scripts("bench")


def baseline_name(name: str) -> str:
    """posbench's parameter name -> the nanoGPT-style baseline's."""
    name = re.sub(r"^tok_emb\.", "wte.", re.sub(r"^head\.", "lm_head.", name))
    name = name.replace("attn.qkv.", "attn.c_attn.").replace("attn.proj.", "attn.c_proj.")
    name = name.replace("mlp.up.", "mlp.0.").replace("mlp.down.", "mlp.2.")
    return name.replace("encoding.bias", "t5_bias")


@pytest.mark.parametrize("encoding, shape", [
    ("nope", []), ("rope", []), ("alibi", []), ("t5", []),
    ("alibi", ["model.d_model=96", "model.n_head=6"]),  # ALiBi's slopes for H not a power of 2
])
def test_baseline_computes_what_posbench_computes(bench, encoding, shape):
    cfg = posbench.compose(["model=tiny", f"encoding={encoding}", "train.seq_len=64",
                            "eval.lengths=[64]", *shape])
    torch.manual_seed(0)
    ours = posbench.build_model(cfg, bench.VOCAB).double()
    for p in ours.encoding.parameters():  # T5's table starts at zero: make it matter
        torch.nn.init.normal_(p)
    m = cfg.model
    theirs = bench.BaselineGPT(m.n_layer, m.n_head, m.d_model, encoding).double()
    state = {baseline_name(k): v for k, v in ours.state_dict().items()}
    # T5's one table, which every baseline layer also holds
    state.update({k: state["t5_bias"] for k in theirs.state_dict() if k.endswith(".t5_bias")})
    theirs.load_state_dict(state, strict=True)
    idx = torch.randint(0, bench.VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    # 1e-6: the baseline builds its rotary tables in fp32, posbench in float64
    torch.testing.assert_close(theirs(idx), ours(idx), rtol=1e-6, atol=1e-6)


def test_training_speed_is_recorded_with_its_flops(bench, tmp_path):
    out = tmp_path / "bench.json"
    bench.main(["--device", "cpu", "--encodings", "alibi", "--no-peers", "--no-memory",
                "--seq-len", "32", "--batch-size", "2", "--steps", "1", "--repeats", "2",
                "--warmup", "0", "--threads", "1", "--json", str(out)])
    record = json.loads(out.read_text())
    (row,) = record["contenders"]
    assert (row["impl"], row["encoding"], row["flags"]) == ("posbench", "alibi", "defaults, eager")
    train = row["train"]
    assert train["tokens_per_s"] > 0 and len(train["step_s_all"]) == 2
    # model FLOP/s: 3 x (2 x weights + 2 x layers x width x T) per token, at model=tiny
    per_token = 3 * (2 * (4 * 12 * 128**2 + 256 * 128) + 2 * 4 * 128 * 32)
    assert train["flops"] == pytest.approx(per_token * train["tokens_per_s"])
    assert train["of_peak"] == pytest.approx(train["flops"] / record["train_matmul_flops"])
    assert row["train_memory"] is None and row["eval"] == []


def test_eval_only_measures_every_length_in_one_process(bench, tmp_path):
    out = tmp_path / "bench.json"
    bench.main(["--device", "cpu", "--encodings", "alibi", "--no-peers", "--eval-only",
                "--eval-lengths", "96,48", "--eval-repeats", "1", "--threads", "1",
                "--json", str(out)])
    (row,) = json.loads(out.read_text())["contenders"]
    assert row["train"] is None and row["train_memory"] is None
    assert [(e["length"], e["status"]) for e in row["eval"]] == [(96, "ok"), (48, "ok")]
    for e in row["eval"]:
        assert e["peak_mb"] >= e["start_mb"] > 0 and e["vs_rope"] > 0


def test_a_knob_is_posbench_with_its_options_timed_beside_plain_rope(bench, tmp_path):
    args = bench.argparse.Namespace(model="tiny", seq_len=32)
    knob = bench.Contender.of("rope+model.attn_sinks=true+model.qk_norm=true")
    assert knob == bench.Contender("posbench", "rope", ("model.attn_sinks=true",
                                                        "model.qk_norm=true"))
    names = {n for n, _ in bench.build(knob, args, 64).named_parameters()}
    assert any(n.endswith("sinks") for n in names) and any("q_norm" in n for n in names)
    assert not any(n.endswith("sinks") for n, _ in bench.build(
        bench.Contender.of("rope"), args, 64).named_parameters())
    out = tmp_path / "bench.json"
    bench.main(["--device", "cpu", "--encodings", "rope+model.attn_sinks=true", "--no-peers",
                "--eval-only", "--eval-lengths", "48", "--eval-repeats", "1", "--threads", "1",
                "--json", str(out)])
    (row,) = json.loads(out.read_text())["contenders"]
    assert (row["encoding"], row["overrides"]) == ("rope", ["model.attn_sinks=true"])
    assert row["flags"] == "model.attn_sinks=true, eager" and row["eval"][0]["vs_rope"] > 0


def test_an_eval_case_is_timed_beside_rope(bench):
    """Its window again right after RoPE's on the same window: the median of the pairs' ratios,
    and FLOP/s from the median time against the matmul peak measured in between."""
    args = bench.argparse.Namespace(model="tiny", seq_len=32, eval_repeats=1)
    cpu = torch.device("cpu")
    data = torch.randint(0, bench.VOCAB, (1, 65))
    fire, rope = (bench.scorer(bench.build(bench.Contender("posbench", e), args, 64), data, cpu)
                  for e in ("fire", "rope"))
    fire(64)
    row = bench.side_by_side(fire, bench.timed(fire, 64, cpu), 64, args, cpu, rope)
    own, ref = row["seconds_all"], row["rope_seconds_all"]
    assert len(own) == 2 and len(ref) == 1 and row["vs_rope"] == pytest.approx(own[1] / ref[0])
    assert row["tokens_per_s"] == pytest.approx(64 / ((own[0] + own[1]) / 2))
    assert row["of_peak"] == pytest.approx(
        bench.model_flops_per_token(args, 64, False) * row["tokens_per_s"] / row["matmul_flops"])


def test_x_transformers_runs_at_its_best(bench):
    """Its flash (SDPA) path wherever it accepts the encoding; it refuses it with T5's bias."""
    assert bench.XT_FLAGS["rope"]["attn_flash"] and bench.XT_FLAGS["alibi"]["attn_flash"]
    assert "attn_flash" not in bench.XT_FLAGS["t5"]
    args = bench.argparse.Namespace(compile=True)
    assert bench.flags(bench.Contender("x-transformers", "rope"), args) == (
        "rotary_pos_emb=True, attn_flash=True, compiled")


TINY_EVAL = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "train.seq_len=64",
             "eval.tokens=512", "eval.retrieval.trials=1", "eval.ruler.trials=1"]


@pytest.fixture(scope="module")
def bench_evaluations():
    yield from from_scripts("bench_evaluations")


def test_each_evaluation_is_timed_at_the_length_it_is_given(bench_evaluations, monkeypatch):
    """Each section runs alone at n and writes only n's points (perplexity's own point aside)."""
    ran = {}
    for name in bench_evaluations.SECTIONS:
        cls = posbench.evaluations.registry()[name].cls
        original = cls.run

        def run(self, model, device, original=original, name=name):
            ran[name] = result = original(self, model, device)
            return result

        monkeypatch.setattr(cls, "run", run)
        row = bench_evaluations.case(name, "rope", 128, name, TINY_EVAL)
        assert row["evaluation"] == name and row["length"] == 128 and row["cpu_seconds"] > 0
        assert row["peak_mib"] >= row["start_mib"] > 0
    assert {p["length"] for p in ran["retrieval"]["by_length"]} == {128}
    for task in ran["ruler"]["tasks"].values():
        assert [p["length"] for p in task["by_length"]] == [128]
    assert [p["length"] for p in ran["longppl"]["by_length"]] == [64, 128]


def test_the_evaluation_benchmark_writes_a_row_per_measurement(bench_evaluations, tmp_path):
    out = tmp_path / "rows.json"
    bench_evaluations.main(["--evaluation", "ruler", "--encodings", "alibi", "--lengths", "128",
                            "--overrides", ",".join(TINY_EVAL), "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["evaluation"], r["encoding"], r["length"]) for r in rows] == [
        ("ruler", "alibi", 128), ("perplexity", "alibi", 128)]
    assert all(r["threads"] >= 1 and r["peak_mib"] >= r["start_mib"] for r in rows)
