"""The device a run computes on and at what precision, in one place: `device=auto|cpu|cuda`,
bf16 autocast on CUDA (fp32 on CPU) for training and every evaluation, TF32 matmuls where
training runs on CUDA, the RNG states a checkpoint keeps for an exact resume, and how many CPU
threads torch uses."""
from __future__ import annotations

import os
import platform
from contextlib import nullcontext
from typing import Mapping, Optional

import torch

from posbench.core.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' is not accepted: no CUDA device is visible; expected "
                          "device=cpu or device=auto")
    return torch.device(name)


def autocast(device: torch.device):
    """The precision of every forward pass, in training and evaluation: bf16 autocast on CUDA,
    plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def allow_tf32(device: torch.device) -> None:
    """TF32 for the fp32 matmuls that autocast leaves (optimizer, fp32 islands) on CUDA."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def rng_state(device: torch.device) -> dict:
    # numpy and python RNGs are not used: batches come from a generator seeded by (seed, step)
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    # A checkpoint written on CPU has no CUDA state: the CUDA generator is then left as
    # torch.manual_seed(seed) left it before the model was built (posbench/runs/run.py), so the
    # resume is deterministic in the run's seed, though it cannot continue a stream that the CPU
    # run never drew from.
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def cpu_model() -> str:
    """The processor's model name: /proc/cpuinfo's on Linux, platform.processor() elsewhere."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(device: torch.device) -> dict:
    """What computed a record, beside its config. Float kernels round differently from one
    processor (or torch build, or thread count) to another, and training carries the difference
    on: a run repeats bit for bit on one machine, and only within noise on another."""
    record = {"torch": torch.__version__, "cpu": cpu_model(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "threads": torch.get_num_threads()}
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)
    return record


def usable_cores(environ: Mapping[str, str] = os.environ) -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's cpuset), or
    SLURM_CPUS_PER_TASK where SLURM allots fewer."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    slurm = environ.get("SLURM_CPUS_PER_TASK", "")
    return max(1, min(cores or 1, int(slurm) if slurm.isdigit() else cores or 1))


def job_threads(cores: int, n_jobs: int, environ: Mapping[str, str] = os.environ
                ) -> Optional[int]:
    """Torch threads for one job: the usable cores shared among the `n_jobs` jobs a sweep runs at
    once (hydra.launcher.n_jobs; joblib's -1 is one job per core); None where the user set
    OMP_NUM_THREADS, which torch reads itself. Torch's default, every core, oversubscribes cores
    that other jobs share: a toy run trained 13x slower than on one thread."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    jobs = cores + 1 + n_jobs if n_jobs < 0 else n_jobs
    return max(1, cores // max(1, jobs))


def busy_warning(load: float, cores: int, threads: int) -> Optional[str]:
    """A line when the 1-minute load average says other work already keeps the usable cores
    busy, where `threads` > 1 would compete with it; else None."""
    if threads <= 1 or load < cores:
        return None
    return (f"the 1-minute load average is {load:.1f} on the {cores} cores this process may use, "
            f"so {threads} torch threads compete with other work and may train many times "
            "slower; OMP_NUM_THREADS=1 runs one")


def set_threads(n_jobs: int) -> None:
    """Sets torch's threads for a job of a sweep of `n_jobs` parallel jobs (see job_threads),
    and warns in one line when the cores are busy."""
    cores = usable_cores()
    threads = job_threads(cores, n_jobs)
    if threads is None:
        return
    torch.set_num_threads(threads)
    warning = busy_warning(os.getloadavg()[0], cores, threads)
    if warning:
        print(f"posbench: warning: {warning}", flush=True)
