"""`posbench inspect RUN_DIR`: learned positions' PCA and attention mass by lag, at toy size,
through the console script's own function in this process."""
import json
import math
import sys

import pytest
import torch

import posbench
from posbench.attention.paths import attend, attention_probs
from posbench.cli import main
from conftest import TOY
from helpers import run_in_process

# eval.lengths reaching 4 x train.seq_len: a learned table then has rows for every inspected length
RUN = [o for o in TOY if not o.startswith("eval.lengths")] + ["eval.lengths=[32,128]"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A trained toy run dir per encoding: learned (a table) and alibi (a score hook)."""
    root = tmp_path_factory.mktemp("inspect")
    mp = pytest.MonkeyPatch()
    dirs = {}
    for name in ("learned", "alibi"):
        mp.setattr(sys, "argv", ["posbench", "train", *RUN, f"encoding={name}",
                                 f"hydra.run.dir={root / name}"])
        main()
        dirs[name] = root / name
    mp.undo()
    return dirs


def check_names_written(stdout, run_dir, names):
    """The last line names every file inspect wrote, by its path, and each exists."""
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("wrote ")
    named = last[len("wrote "):].split(", ")
    assert named == [str(run_dir / n) for n in names]
    assert all((run_dir / n).is_file() for n in names)


def check_attention(record, train_len=32):
    lengths = record["attention"]["lengths"]
    assert [p["length"] for p in lengths] == [train_len, 4 * train_len]
    for point in lengths:
        assert len(point["mass"]) == 1 and len(point["mass"][0]) == 2  # layers x heads
        for heads in point["mass"]:
            for mass in heads:  # every query's probabilities sum to 1 over its lags
                assert sum(mass) == pytest.approx(1, abs=1e-5)
                assert min(mass) >= 0
    assert lengths[0]["mass_beyond_train_len"] is None
    beyond = lengths[1]["mass_beyond_train_len"]
    assert all(0 <= m <= 1 for heads in beyond for m in heads)
    for point in lengths:  # query t spreads over t+1 keys: entropy <= mean of log(t+1)
        bound = sum(math.log(t + 1) for t in range(point["length"])) / point["length"]
        assert all(0 <= e <= bound + 1e-9 for heads in point["entropy"] for e in heads)
        # query 0 puts all of its mass on the first token
        assert all(1 / point["length"] - 1e-9 <= m <= 1 for heads in point["sink_mass"]
                   for m in heads)


def test_learned_run_gets_both_plots_and_leaves_results_alone(runs, monkeypatch, capsys):
    run_dir = runs["learned"]
    before = {n: (run_dir / n).read_bytes() for n in ("results.json", "checkpoint.pt")}
    proc = run_in_process(["inspect", str(run_dir)], monkeypatch, capsys)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr
    for name in ("inspect_positions.png", "inspect_attention.png", "inspect_by_length.png"):
        assert (run_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((run_dir / "inspect.json").read_text())
    check_attention(record)
    positions = record["positions"]
    assert positions["rows"] == 128 and len(positions["pcs"][0]) == 3
    assert positions["cos_by_offset"][0] == pytest.approx(1, abs=1e-5)  # cos(P[t], P[t])
    assert before == {n: (run_dir / n).read_bytes() for n in before}
    check_names_written(proc.stdout, run_dir, ["inspect_positions.png", "inspect_attention.png",
                                               "inspect_by_length.png", "inspect.json"])


def test_encoding_without_table_skips_positions_with_a_note(runs, monkeypatch, capsys):
    run_dir = runs["alibi"]
    proc = run_in_process(["inspect", str(run_dir), "--lengths", "32,128"], monkeypatch, capsys)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert "skipped inspect_positions.png" in proc.stdout
    assert not (run_dir / "inspect_positions.png").exists()
    record = json.loads((run_dir / "inspect.json").read_text())
    assert record["positions"] is None
    check_attention(record)
    check_names_written(proc.stdout, run_dir, ["inspect_attention.png", "inspect_by_length.png",
                                               "inspect.json"])


@pytest.mark.parametrize("args", [["inspect"], ["inspect", "no/such/run"],
                                  ["inspect", "RUN", "--lengths", "0,x"]])
def test_bad_arguments_are_one_line(args, runs, monkeypatch, capsys):
    args = [str(runs["learned"]) if a == "RUN" else a for a in args]
    proc = run_in_process(args, monkeypatch, capsys)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("posbench: error:")


@pytest.mark.parametrize("name", ["alibi", "rope", "cope"])
def test_attention_probs_are_the_ones_attend_uses(name):
    cfg = posbench.compose([f"encoding={name}", "model.n_layer=1", "model.d_model=32",
                            "model.n_head=2", "train.seq_len=16", "eval.lengths=[40]"])
    enc = posbench.build_model(cfg, 256).encoding.double()
    q, k, v = torch.randn(3, 2, 2, 40, 16, dtype=torch.float64)
    pos = torch.arange(40).expand(2, 40)
    probs = attention_probs(q, k, pos, enc, 0)
    torch.testing.assert_close(probs @ v, attend(q, k, v, pos, enc, 0))
    rows = attention_probs(q, k, pos, enc, 0, start=10, end=25)  # one block of queries
    torch.testing.assert_close(rows, probs[:, :, 10:25, :25])
