"""The training log on disk: metrics.csv gets a row every train.log_every steps and every
train.val_every steps, loss_vs_step.png plots it, its validation loss is the trained model's
loss on fixed windows, and a resumed run keeps only the rows up to its checkpoint. (A run killed
and resumed writes the same file as an uninterrupted one: tests/test_resume.py.)"""
import re

import pytest
from omegaconf import OmegaConf

from helpers import posbench_cli, results
from posbench.runs.train import lr_at
from posbench.runs.trainlog import MetricsLog, read_metrics


@pytest.mark.figures  # it reads the PNG
def test_metrics_csv_logs_training_and_validation_and_the_run_dir_is_named(tmp_path, toy):
    # eval.tokens = batch_size x seq_len: the final evaluation at L scores the very windows that
    # validation scores, through evaluate() instead
    args = [a for a in toy if not a.startswith(("train.steps=", "eval.tokens="))]
    proc = posbench_cli("train", *args, "train.steps=12", "train.log_every=5",
                        "train.val_every=4", "eval.tokens=64", "hydra.run.dir=run", cwd=tmp_path,
                        in_process=True)
    run_dir = tmp_path / "run"
    lines = proc.stdout.splitlines()
    start = lines.index(f"posbench: run dir {run_dir}")
    assert re.match(r"posbench: estimate: [\d.]+k parameters, 768 training tokens, ",
                    lines[start + 1])  # 2 x 32 tokens x 12 steps
    assert lines[-1] == f"posbench: run dir {run_dir} holds its results"
    rows = read_metrics(run_dir / "metrics.csv")
    assert [r["step"] for r in rows] == [4, 5, 8, 10, 12]
    assert [r["step"] for r in rows if r["loss"] is not None] == [5, 10, 12]
    assert [r["step"] for r in rows if r["val_loss"] is not None] == [4, 8, 12]
    record = results(run_dir)
    cfg = OmegaConf.create(record["config"]["train"])
    for row in rows:
        if row["loss"] is not None:
            assert row["lr"] == lr_at(row["step"] - 1, cfg)
            assert row["tokens_per_second"] > 0
    assert rows[-1]["loss"] == record["train"]["final_loss"]  # written exactly
    at_l = next(p for p in record["eval"]["curve"] if p["length"] == 32)
    assert rows[-1]["val_loss"] == pytest.approx(at_l["loss"], rel=1e-6)
    assert (run_dir / "loss_vs_step.png").read_bytes()[:4] == b"\x89PNG"


def test_a_resumed_log_keeps_the_complete_rows_up_to_its_checkpoint(tmp_path):
    path = tmp_path / "metrics.csv"
    log = MetricsLog(path, 0)
    for step in (5, 10, 15):
        log.append(step, loss=float(step), lr=0.1, tokens_per_second=1.0)
    log.append(20, val_loss=2.5)
    with open(path, "a") as f:
        f.write("2")  # a row cut short by a kill: its step is not 2
    MetricsLog(path, 10)
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(5, 5.0), (10, 10.0)]
    MetricsLog(path, 0)
    assert read_metrics(path) == []
