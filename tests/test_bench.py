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


@pytest.fixture(scope="module")
def bench():
    # imported by name from scripts/, so that the memory cases' spawned processes find it too
    sys.path.insert(0, str(SCRIPT.parent))
    yield importlib.import_module("bench")
    sys.path.remove(str(SCRIPT.parent))


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


def test_small_run_writes_the_json(bench, tmp_path):
    out = tmp_path / "bench.json"
    bench.main(["--device", "cpu", "--encodings", "alibi", "--no-peers", "--seq-len", "32",
                "--batch-size", "2", "--steps", "1", "--repeats", "2", "--warmup", "0",
                "--eval-lengths", "64", "--threads", "1", "--json", str(out)])
    record = json.loads(out.read_text())
    (row,) = record["contenders"]
    assert (row["impl"], row["encoding"]) == ("posbench", "alibi")
    assert row["train"]["tokens_per_s"] > 0 and len(row["train"]["step_s_all"]) == 2
    assert row["train_memory"]["status"] == "ok" and row["train_memory"]["peak_mb"] > 0
    assert [(e["length"], e["status"]) for e in row["eval"]] == [(64, "ok")]
