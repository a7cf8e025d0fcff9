"""The device a run computes on and at what precision, in one place: `device=auto|cpu|cuda`,
bf16 autocast on CUDA (fp32 on CPU) for training and every evaluation, TF32 matmuls where
training runs on CUDA, and the RNG states a checkpoint keeps for an exact resume."""
from __future__ import annotations

from contextlib import nullcontext

import torch

from posbench.errors import ConfigError


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
    # torch.manual_seed(seed) left it before the model was built (posbench/run.py), so the
    # resume is deterministic in the run's seed, though it cannot continue a stream that the CPU
    # run never drew from.
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
