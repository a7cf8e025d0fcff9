"""Data-parallel training under torchrun (`torchrun --nproc_per_node=N --no-python posbench
train ...`): one process per device, each takes its slice of the same global batch, and
DistributedDataParallel averages the gradients, so N processes compute what one process computes
with the whole batch. Rank 0 alone writes files, logs and evaluates."""
from __future__ import annotations

import atexit
import os
from datetime import timedelta

import torch
import torch.distributed as dist


# Rank 0 evaluates alone (train.eval_every, train.val_every, and the final evaluation before a
# sweep's next job) while the other ranks wait in their next collective, which NCCL aborts after
# its default 10 minutes. A rank that fails takes the others down through torchrun, so this long
# limit only delays the report of a true hang.
TIMEOUT = timedelta(hours=24)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def setup(device: torch.device) -> torch.device:
    """Joins torchrun's process group (no-op in a single process); returns this rank's device."""
    if world_size() == 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
        # left to the interpreter's exit, the group's threads are torn down unjoined and a rank
        # that finishes first (one that does not evaluate) can abort: "terminate called without
        # an active exception", SIGABRT, and torchrun stops rank 0 with it
        atexit.register(leave)
    return device


def leave() -> None:
    """Destroys this rank's process group, where it is still there."""
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    if world_size() == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    from posbench.model.schedule import SwitchedEncoding

    # Under a switch (train.switch_encoding_at) one of the two encodings takes no gradient in
    # each phase. DDP then has to look for unused parameters at every step (a walk of the
    # autograd graph, cheap beside the step); it leaves their gradients None, so AdamW leaves
    # them alone, as in one process. Freezing them instead would need a new DDP (and a
    # recompile) at the switch, as DDP's reducer does not follow requires_grad changes.
    switched = isinstance(getattr(model, "encoding", None), SwitchedEncoding)
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                   find_unused_parameters=switched)


def shard(batch: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous slice of the global batch."""
    rows = batch.shape[0] // world_size()
    start = int(os.environ.get("RANK", "0")) * rows
    return batch[start:start + rows]


def mean(values: torch.Tensor) -> torch.Tensor:
    """Elementwise mean over ranks (the values themselves in a single process)."""
    if world_size() == 1:
        return values
    values = values.clone()
    dist.all_reduce(values)
    return values / world_size()
