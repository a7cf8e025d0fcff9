"""checkpoint.pt: a plain torch.save of the training state (tensors and plain containers only, so
`torch.load(path, weights_only=True)` opens it as it is; its keys are Checkpoint's fields, the
version under "posbench"), and beside it checkpoint.pt.sha256, its digest in `sha256sum` format (`sha256sum -c checkpoint.pt.sha256` checks it). A corrupt or
truncated checkpoint is refused by its digest with one clear line instead of being loaded.

Written atomically, in an order that keeps the digest of the checkpoint on disk listed after a
crash at any point: the new digest goes to checkpoint.pt.sha256.next (accepted too), then the new
checkpoint replaces the old, then the .next file replaces checkpoint.pt.sha256. That last step is
one rename, so a Ctrl-C between the checkpoint being in place and save_checkpoint returning (the
caller then believes the older one is kept) has almost no room to land."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from posbench.core.errors import CheckpointError
from posbench.core.io import atomic_path, write_text

CHECKPOINT = "checkpoint.pt"


def digest_paths(path: Path) -> Tuple[Path, Path]:
    """The digest file of `path`, and the one of a checkpoint being written."""
    return path.with_name(path.name + ".sha256"), path.with_name(path.name + ".sha256.next")


def accepted_digests(path: Path) -> List[str]:
    """The sha256 digests that the digest files of `path` list."""
    return [line.split()[0] for file in digest_paths(path) if file.exists()
            for line in file.read_text().splitlines() if line.strip()]


def save_checkpoint(path: Path, state: dict) -> None:
    path = Path(path)
    digests, pending = digest_paths(path)
    # serialized in memory, written by Python: a full disk is then an OSError naming its cause,
    # where torch.save into a file raises an opaque RuntimeError
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with atomic_path(path) as tmp:
        tmp.write_bytes(buffer.getbuffer())
        write_text(pending, f"{hashlib.sha256(buffer.getbuffer()).hexdigest()}  {path.name}\n")
    os.replace(pending, digests)


def load_checkpoint(path: Path) -> dict:
    """The saved state, on CPU, after checking it against its digest file."""
    path = Path(path)
    digests = digest_paths(path)[0]
    try:
        blob = path.read_bytes()
        accepted = accepted_digests(path)
        if not accepted:
            raise ValueError(f"no {digests.name} beside it")
        if hashlib.sha256(blob).hexdigest() not in accepted:
            raise ValueError(f"sha256 mismatch with {digests.name}")
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({reason}); expected one "
                          f"written by posbench with its {digests.name}: delete {path.name}* to "
                          "train from step 0 (nothing was overwritten)") from None


@dataclass
class Checkpoint:
    """What checkpoint.pt holds: the state an exact resume needs, and what loading the trained
    model needs (config, vocab_size, model). The one place that knows the file's keys."""
    version: str  # the posbench version that wrote it
    config: dict  # the resolved config of the run
    dataset: str  # the fingerprint of the corpus it was trained on
    vocab_size: int
    step: int  # steps done
    model: dict  # state_dict
    optimizer: dict
    rng: dict  # posbench/core/device.py: rng_state
    window: torch.Tensor  # per-step losses of the open log window
    final_loss: float  # mean of the last closed log window
    last_loss: Optional[float]  # last finite per-step loss
    seconds: float  # training time over every start so far
    # train.budget=wallclock: the machine the seconds were spent on (posbench/runs/budget.py:
    # device_name); None under other budgets, and absent from checkpoints saved before it existed
    device: Optional[str] = None
    # train.pack_documents: posbench/runs/lengths.py's SegmentCount so far; None otherwise, and
    # absent from checkpoints saved before it existed
    segment_lengths: Optional[torch.Tensor] = None

    def save(self, path: Path) -> None:
        state = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        state["posbench"] = state.pop("version")
        save_checkpoint(path, state)

    @classmethod
    def load(cls, path: Path) -> "Checkpoint":
        """Checked against its digest, on CPU; a file without these keys is refused."""
        state = load_checkpoint(path)
        names = {field.name for field in dataclasses.fields(cls)} - {"version"} | {"posbench"}
        if set(state) | {"device", "segment_lengths"} != names:
            raise CheckpointError(f"checkpoint {path} is not accepted: it holds {sorted(state)}; "
                                  f"expected a posbench checkpoint, which holds {sorted(names)}")
        state["version"] = state.pop("posbench")
        return cls(**state)
