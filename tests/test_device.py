"""The RNG states a checkpoint keeps (posbench/core/device.py), across the device it resumes on, and
the CPU threads a job takes."""
import os

import torch

from posbench.core.device import (busy_warning, job_threads, rng_state, set_rng_state, set_threads,
                             usable_cores)


def test_a_cpu_checkpoint_resumes_on_cuda_with_the_seeded_cuda_generator(monkeypatch):
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *args: restored.append(args))
    saved = rng_state(torch.device("cpu"))
    assert "cuda" not in saved
    expected = torch.rand(3)
    set_rng_state(saved, torch.device("cuda"))
    assert torch.equal(torch.rand(3), expected) and restored == []
    set_rng_state({**saved, "cuda": "state"}, torch.device("cuda", 0))
    assert restored == [("state", torch.device("cuda", 0))]


def test_threads_share_the_usable_cores_among_parallel_jobs(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert usable_cores({}) == 16
    assert usable_cores({"SLURM_CPUS_PER_TASK": "4"}) == 4  # SLURM's allotment is smaller
    assert job_threads(16, 1, {}) == 16
    assert job_threads(16, 4, {}) == 4  # hydra.launcher.n_jobs=4
    assert job_threads(16, -1, {}) == 1  # joblib's default: one job per core
    assert job_threads(16, -4, {}) == 1 and job_threads(2, 8, {}) == 1
    assert job_threads(16, 4, {"OMP_NUM_THREADS": "3"}) is None  # the user's choice stands


def test_busy_cores_are_named_in_one_line():
    line = busy_warning(2.4, 2, 2)
    assert line == ("the 1-minute load average is 2.4 on the 2 cores this process may use, so 2 "
                    "torch threads compete with other work and may train many times slower; "
                    "OMP_NUM_THREADS=1 runs one")
    assert busy_warning(0.3, 2, 2) is None and busy_warning(5.0, 2, 1) is None


def test_a_job_sets_its_threads_and_warns_when_the_cores_are_busy(monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "getloadavg", lambda: (6.0, 0.0, 0.0))
    try:
        set_threads(2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    assert capsys.readouterr().out.startswith("posbench: warning: the 1-minute load average is 6.0")
