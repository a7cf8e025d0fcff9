"""Estimates before work: a job's FLOPs and peak memory against measured ones, `--dry-run`
listing a sweep's jobs without running or writing anything, a job that cannot fit the machine
refused in one line (and listed by its sweep's report), and Ctrl-C honoured inside one long
operation."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import posbench
from helpers import posbench_cli, run_in_process
from posbench.runs.estimate import MEMORY_CHECK, available_memory, estimate, refusal

STEP = ["train.seq_len=256", "train.batch_size=4", "train.steps=1", "eval.lengths=[256]"]


@pytest.mark.parametrize("encoding", ["rope", "t5"])  # fused attention; a score hook
def test_training_flops_are_within_a_quarter_of_those_counted_in_a_step(encoding):
    cfg = posbench.compose([f"encoding={encoding}", *STEP])
    model = posbench.build_model(cfg)
    x = torch.randint(0, 256, (4, 256))
    with FlopCounterMode(display=False) as counted:
        model(x, targets=x).mean().backward()
    assert 0.8 < estimate(cfg).train_flops / counted.get_total_flops() < 1.25


MEASURE = """
import resource, sys, torch, posbench
torch.set_num_threads(1)
cfg = posbench.compose(sys.argv[1:])
model = posbench.build_model(cfg)
optimizer = torch.optim.AdamW(model.parameters())
x = torch.randint(0, 256, (cfg.train.batch_size, cfg.train.seq_len))
model(x, targets=x).mean().backward()
optimizer.step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


@pytest.mark.parametrize("encoding", ["rope", "alibi"])
def test_training_memory_is_within_twice_the_measured_peak(encoding):
    overrides = [f"encoding={encoding}", "train.seq_len=1024", "train.batch_size=8",
                 "eval.lengths=[1024]"]
    proc = subprocess.run([sys.executable, "-c", MEASURE, *overrides], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    measured = int(proc.stdout.split()[-1])
    # the peak moves by a few hundred MB with the allocator and what else the process loaded
    assert measured / 2 < estimate(posbench.compose(overrides)).train_bytes < 2 * measured


def test_dry_run_lists_every_job_with_its_estimate_and_writes_nothing(tmp_path):
    proc = posbench_cli("train", "-m", "encoding=rope,alibi", "train.seq_len=128,1000000",
                        "device=cpu", "--dry-run", cwd=tmp_path, in_process=True)
    for job in ("encoding-rope_train.seq_len-128", "encoding-rope_train.seq_len-1000000",
                "encoding-alibi_train.seq_len-128", "encoding-alibi_train.seq_len-1000000"):
        (line,) = [x for x in proc.stdout.splitlines() if x.startswith(f"  {job}: ")]
        assert "training tokens" in line and "FLOPs training" in line and "GiB" in line
    assert proc.stdout.count("    refused: train.seq_len=1000000 is not accepted") == 2
    assert "4 jobs: " in proc.stdout and "2 would be refused" in proc.stdout
    assert list(tmp_path.iterdir()) == []


TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "train.seq_len=32",
        "train.warmup_steps=1", "eval.lengths=[32,64]", "eval.tokens=256", "device=cpu"]


def seconds(text):
    """'11.9 ms', '12 s', '3.1 min', '2.5 h' -> seconds."""
    number, unit = text.split()
    return float(number) * {"ms": 1e-3, "s": 1, "min": 60, "h": 3600}[unit]


def test_dry_run_gives_each_job_and_the_sweep_a_wall_time_measured_on_this_machine(tmp_path):
    proc = posbench_cli("train", "-m", *TINY, "train.steps=1000", "seed=0,1",
                        "train.batch_size=2,10000000", "--dry-run", cwd=tmp_path, in_process=True)
    timed = re.findall(r"^    time: about ([\d.]+ \w+): 1000 steps x ([\d.]+ m?s), a step "
                       r"measured on this machine \(1 thread\), \+ ([\d.]+ m?s) evaluating",
                       proc.stdout, flags=re.M)
    assert len(timed) == 2, proc.stdout
    # one shape, measured once: both seeds show the same step
    assert timed[0] == timed[1]
    total, step, evaluating = (seconds(x) for x in timed[0])
    assert 0 < step < 5 and total == pytest.approx(1000 * step + evaluating, rel=0.1)
    assert proc.stdout.count("    time: not measured: it would be refused") == 2
    (last,) = [x for x in proc.stdout.splitlines() if x.startswith("4 jobs: ")]
    everything = re.search(r", about ([\d.]+ \w+) on this machine \(2 jobs timed\)", last)
    assert everything and seconds(everything[1]) == pytest.approx(2 * total, rel=0.1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_dry_run_for_a_gpu_on_a_machine_without_one_says_why_it_has_no_time(tmp_path):
    proc = posbench_cli("train", *TINY[:-1], "device=cuda", "--dry-run", cwd=tmp_path,
                        in_process=True)
    assert "  run: " in proc.stdout and "FLOPs training" in proc.stdout
    assert "    time: not measured: no CUDA device is visible on this machine" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_step_is_measured_once_per_shape_under_the_jobs_threads(monkeypatch):
    from posbench.runs import estimate as estimates, train as training

    steps, threads = [], []
    real = training.train_step

    def counted(*args, **kwargs):
        steps.append(1)
        threads.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "train_step", counted)
    monkeypatch.setattr(estimates, "_step_seconds", {})
    before, rng = torch.get_num_threads(), torch.get_rng_state()
    cpu = torch.device("cpu")
    for seed, total in ((0, 100), (1, 5000)):  # seeds and lengths of training share a shape
        cfg = posbench.compose([*TINY, "train.batch_size=2", f"seed={seed}",
                                f"train.steps={total}"])
        assert 0 < estimates.step_seconds(cfg, cpu, 2) < 5
    measured = len(steps)
    assert 2 <= measured <= 1 + estimates.MEASURED_STEPS and set(threads) == {2}
    # the caller's threads and random state are left as they were
    assert torch.get_num_threads() == before and torch.equal(torch.get_rng_state(), rng)
    estimates.step_seconds(posbench.compose([*TINY, "train.batch_size=4"]), cpu, 2)
    assert len(steps) > measured  # another batch is another shape


def test_a_job_that_cannot_fit_is_refused_in_one_line_and_its_sweep_lists_it(tmp_path, toy,
                                                                             monkeypatch, capsys):
    cfg = posbench.compose(["train.seq_len=1000000"])  # model=tiny, batch 16: terabytes
    room, source = available_memory(torch.device("cpu"))
    assert 0 < room and source in ("MemAvailable", "under this cgroup's memory.max")
    line = refusal(cfg, estimate(cfg), room, source)
    assert line.startswith("train.seq_len=1000000 is not accepted with train.batch_size=16")
    os.environ[MEMORY_CHECK] = "0"
    try:
        assert refusal(cfg, estimate(cfg), room, source) is None
    finally:
        del os.environ[MEMORY_CHECK]

    monkeypatch.chdir(tmp_path)
    single = run_in_process(["train", "train.seq_len=1000000", "device=cpu"], monkeypatch, capsys)
    (error,) = single.stderr.strip().splitlines()
    assert single.returncode == 2 and error.startswith(f"posbench: error: {line[:60]}")
    assert " GiB by estimate, " in error
    assert list(tmp_path.iterdir()) == []  # refused before Hydra made outputs/<date>/

    args = [a for a in toy if not a.startswith("train.batch_size=")]
    sweep = run_in_process(["train", "-m", *args, "train.batch_size=2,10000000",
                            "hydra.sweep.dir=sweep"], monkeypatch, capsys)
    assert sweep.returncode == 2
    refused = tmp_path / "sweep" / "train.batch_size-10000000"
    assert sorted(p.name for p in refused.iterdir()) == ["refused.json"]
    assert "is not accepted with train.batch_size=10000000" in json.loads(
        (refused / "refused.json").read_text())["error"]
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert f"- sweep/{refused.name} (refused): train.seq_len=32 is not accepted" in summary


HELD_OFF = """
import sys, torch
from posbench.cli import honour_ctrl_c
torch.set_num_threads(1)
matrix = torch.randn(5000, 5000, dtype=torch.float64)  # before "started": on a loaded machine
with honour_ctrl_c(grace=2):                          # the draw alone can outlast the sleep
    print("started", flush=True)
    torch.linalg.eigvals(matrix)  # ~30 s in one call
"""


def test_ctrl_c_inside_one_long_operation_stops_the_process_within_seconds():
    proc = subprocess.Popen([sys.executable, "-c", HELD_OFF], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline() == "started\n"
    time.sleep(1)  # inside the call
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - sent < 8, err
    assert "a long operation held off Ctrl-C, stopping now" in err
