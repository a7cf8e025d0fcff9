"""checkpoint.pt: a one-line JSON header (format, byte count, sha256 of the payload), then the
payload, a torch.save of the training state. Written atomically; a corrupt or truncated file is
refused by its checksum with one clear line instead of being loaded."""
from __future__ import annotations

import hashlib
import io
import json
import pickle
from pathlib import Path

import torch

from posbench.config import ConfigError
from posbench.io import atomic_path

CHECKPOINT = "checkpoint.pt"
MAGIC = b"posbench-checkpoint "
FORMAT = 1


def save_checkpoint(path: Path, state: dict) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    header = {"format": FORMAT, "bytes": len(payload),
              "sha256": hashlib.sha256(payload).hexdigest()}
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(MAGIC + json.dumps(header).encode() + b"\n")
        f.write(payload)


def load_checkpoint(path: Path) -> dict:
    """The saved state, on CPU, after checking the payload against the header."""
    try:
        first, _, payload = Path(path).read_bytes().partition(b"\n")
        if not first.startswith(MAGIC):
            raise ValueError("not a posbench checkpoint")
        header = json.loads(first[len(MAGIC):])
        if header["format"] != FORMAT:
            raise ValueError(f"format {header['format']}, expected {FORMAT}")
        if len(payload) != header["bytes"]:
            raise ValueError(f"truncated: {len(payload)} of {header['bytes']} payload bytes")
        if hashlib.sha256(payload).hexdigest() != header["sha256"]:
            raise ValueError("sha256 mismatch")
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"checkpoint {path} is corrupt or unreadable ({reason}); expected one "
                          "written by posbench: delete it to train from step 0") from None
