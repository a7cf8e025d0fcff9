"""torchrun with 2 CPU processes (gloo) trains what one process trains with the same global batch."""
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import posbench_cli, results, run_in_process
from posbench.runs import distributed

ARGS = ["train", "model.n_layer=1", "model.d_model=32", "model.n_head=2", "train.steps=4",
        "train.batch_size=4", "train.seq_len=32", "train.warmup_steps=1", "eval.lengths=[32,64]",
        "eval.tokens=256", "device=cpu"]


# t5 switched to nope at step 2: the T5 bias table takes no gradient from then on
@pytest.mark.parametrize("encoding", [["encoding=alibi"],
                                      ["encoding=t5", "train.switch_encoding_at=0.5"]],
                         ids=["alibi", "t5_switched"])
def test_two_gloo_processes_match_one_process(tmp_path, encoding):
    posbench = shutil.which("posbench")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    posbench_cli(*ARGS, *encoding, "hydra.run.dir=single", cwd=tmp_path, env=env)
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", "--no-python", posbench, *ARGS, *encoding,
                          "hydra.run.dir=ddp"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert ddp.returncode == 0, (ddp.stdout + ddp.stderr)[-3000:]
    one = results(tmp_path / "single")
    two = results(tmp_path / "ddp")
    assert math.isclose(one["train"]["final_loss"], two["train"]["final_loss"], rel_tol=1e-5)
    for a, b in zip(one["eval"]["curve"], two["eval"]["curve"]):
        assert a["length"] == b["length"] and math.isclose(a["loss"], b["loss"], rel_tol=1e-5)
    assert one["eval"]["curve"][0]["loss"] != 0
    # every weight, the T5 table that no step after the switch trains among them
    weights = [torch.load(tmp_path / run / "checkpoint.pt", weights_only=True)["model"]
               for run in ("single", "ddp")]
    for name, weight in weights[0].items():
        if isinstance(weight, torch.Tensor):
            torch.testing.assert_close(weights[1][name], weight, rtol=1e-5, atol=1e-6, msg=name)


def test_batch_not_divisible_by_processes_is_refused(tmp_path, monkeypatch, capsys):
    """As a rank of `torchrun --nproc_per_node=2` sees it (its process group faked: the refusal
    comes before any collective)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda *args, **kwargs: None)
    monkeypatch.chdir(tmp_path)
    args = [a if not a.startswith("train.batch_size") else "train.batch_size=3" for a in ARGS]
    proc = run_in_process([*args, "hydra.run.dir=r"], monkeypatch, capsys)
    assert proc.returncode == 2
    assert "train.batch_size=3 is not accepted with 2 processes" in proc.stderr
    assert not (tmp_path / "r" / "results.json").exists()


def test_the_process_group_outlasts_an_evaluation_on_rank_0(monkeypatch):
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group",
                        lambda *args, **kwargs: calls.append(kwargs))
    distributed.setup(torch.device("cpu"))
    assert calls[0]["timeout"].total_seconds() >= 6 * 3600  # NCCL's default is 10 minutes
