"""The key tokens an evaluator run chooses for eval.longppl, cached: every run of a sweep that one
evaluator judges is scored on the same key tokens, so only the first runs the evaluator's long
and short passes (the dearest part of LongPPL); the others read them back.

Where: `<evaluator run dir>/longppl_keys/<the key's sha256, 32 hex digits>.bin`, one file per
length. Beside the evaluator rather than in dataset.cache_dir: the key tokens belong to one
evaluator, so every run that names it finds them wherever the runs live, they go with it when it
is moved or deleted, and no two evaluators share a folder; the token cache is keyed by corpus
alone and may sit on another disk than the runs.

The key is everything that decides the key tokens, so that a change of any of them misses:
  - the evaluator: the sha256 of its checkpoint.pt (its weights and config), and its eval-time
    options (evaluations/base.py eval_options) as this posbench reads its config, a LongRoPE
    factors file by the sha256 of what it holds;
  - the windows: the corpus fingerprint, the length, the first scored position, and the sha256
    of the windows' tokens themselves, so whatever picks them (eval.protocol, eval.stride,
    eval.tokens, dataset.bos) is in the key without being listed;
  - the rule: trunc_len, block, alpha, beta;
  - what rounds the evaluator's losses differently: eval.batch_tokens and the device type.
Only the key-token mask is kept, 1 bit a target: the evaluator's losses serve the rule alone,
and a sweep changes alpha or beta rarely enough that keeping 16 bytes a target to re-apply it
is not worth it. The run's own key tokens (evaluator null) are its own and never cached.

File: one JSON line {"key": the key as text, "shape": [windows, length], "sha256": of the rest},
then the mask as np.packbits of its rows. Written atomically (core/io.py): runs that miss at
once each compute it and replace the file with the same bytes. Read back verified: a file whose
key, shape, size or digest does not match is recomputed and replaced, never trusted.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Callable, Optional, Tuple

import numpy as np
import torch

from posbench.core.io import atomic_path

FOLDER = "longppl_keys"
FORMAT = 1  # of the file and of the key rule's code: raised when either changes


def windows_digest(rows: torch.Tensor) -> str:
    return hashlib.sha256(rows.contiguous().numpy().tobytes()).hexdigest()


def key_text(key: dict) -> str:
    return json.dumps({"format": FORMAT, **key}, sort_keys=True)


def key_path(folder: Path, text: str) -> Path:
    return Path(folder) / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.bin"


def read(path: Path, text: str, shape: Tuple[int, int]) -> Optional[torch.Tensor]:
    """The mask stored at `path` under key `text`; None where there is no file. ValueError (or
    OSError) where the file does not hold it whole."""
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    head, _, body = blob.partition(b"\n")
    meta = json.loads(head)
    size = math.prod(shape)
    if not isinstance(meta, dict) or meta.get("key") != text \
            or meta.get("shape") != list(shape) or len(body) != (size + 7) // 8 \
            or meta.get("sha256") != hashlib.sha256(body).hexdigest():
        raise ValueError(f"{path.name} does not hold the key tokens of its key")
    bits = np.unpackbits(np.frombuffer(body, dtype=np.uint8), count=size)
    return torch.from_numpy(bits.astype(bool).reshape(shape))


def write(path: Path, text: str, mask: torch.Tensor) -> None:
    body = np.packbits(mask.numpy().ravel()).tobytes()
    head = json.dumps({"key": text, "shape": list(mask.shape),
                       "sha256": hashlib.sha256(body).hexdigest()})
    with atomic_path(path) as tmp:
        tmp.write_bytes(head.encode() + b"\n" + body)


def cached_keys(folder: Path, key: dict, shape: Tuple[int, int],
                compute: Callable[[], torch.Tensor]) -> Tuple[torch.Tensor, str]:
    """The key-token mask stored under `key` in `folder`, else compute()'s, stored; and a few
    words on where it came from, for the run's log."""
    text = key_text(key)
    path = key_path(folder, text)
    try:
        mask = read(path, text, shape)
        if mask is not None:
            return mask, "from cache"
        source = "computed"
    except (OSError, ValueError):
        source = f"computed (its cached {path} was corrupt or unreadable: replaced)"
    mask = compute()
    try:
        write(path, text, mask)
    except OSError as err:  # the evaluator's dir may not be ours to write: the run goes on
        source += f", not cached ({err})"
    return mask, source
