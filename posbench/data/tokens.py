"""Token files: documents become one flat token file (cached by content fingerprint, checksummed)
that training and evaluation read by memory map. Documents never cross the train/val split."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Tuple

import numpy as np
import torch

from posbench.data.documents import file_digest
from posbench.data.windows import IGNORE, EvalPlan, starts_within, with_bos
from posbench.core.errors import ConfigError
from posbench.core.io import write_failed

FORMAT = 1


class EmptySplitError(ValueError):
    """No document landed on one side of the train/validation split."""


@dataclass
class TokenData:
    tokens: np.ndarray  # memory-mapped, all documents back to back: train first, then val
    train_docs: np.ndarray  # (n+1,) offsets of the train documents into `tokens`
    val_docs: np.ndarray
    vocab_size: int
    fingerprint: str
    name: str
    bos: Optional[int] = None  # the BOS token's id under dataset.bos (posbench/data/windows.py)

    def longest(self, split: str) -> int:
        docs = self.train_docs if split == "train" else self.val_docs
        return int(np.diff(docs).max()) if len(docs) > 1 else 0

    def check_train_len(self, seq_len: int, packed: bool = False) -> None:
        # packed rows run across documents: only the training split as a whole must be longer
        held = int(self.train_docs[-1] - self.train_docs[0]) if packed else self.longest("train")
        if held >= seq_len + 1:
            return
        if packed:
            raise ConfigError(f"train.seq_len={seq_len} is not accepted; the training documents "
                              f"of {self.name} hold {held} tokens in all, expected <= {held - 1}")
        raise ConfigError(f"train.seq_len={seq_len} is not accepted; the longest training "
                          f"document of {self.name} has {held} tokens, expected <= {held - 1}, "
                          "or train.pack_documents=true (rows of documents back to back)")

    def train_batch(self, seq_len: int, batch_size: int, seed: int, step: int,
                    plant: Optional[Callable[[np.ndarray, int, int], None]] = None):
        """Batch `step` of a seeded run: uniform over all windows inside training documents. It
        depends on (seed, step) alone, so a resumed run sees exactly the batches it would have
        seen. `plant` (train.retrieval_mix and ruler_mix: posbench/evaluations/base.py,
        plant_share) replaces some rows in place, from its own generators of (seed, step)."""
        rng = np.random.default_rng([seed, step])
        first, counts = starts_within(self.train_docs, seq_len + 1)
        cum = np.cumsum(counts)
        picks = rng.integers(0, cum[-1], size=batch_size)
        doc = np.searchsorted(cum, picks, side="right")
        starts = first[doc] + picks - (cum[doc] - counts[doc])
        rows = np.stack([self.tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64)
        if plant is not None:
            plant(rows, seed, step)
        rows = torch.from_numpy(with_bos(rows, self.bos))
        x, y = rows[:, :-1], rows[:, 1:]
        if self.bos is not None:
            y = y.clone()
            y[:, 0] = IGNORE  # the prediction made at BOS
        return x, y

    def document_batch(self, seq_len: int, batch_size: int, seed: int, step: int):
        """Batch `step` under train.pack_documents: rows of seq_len + 1 tokens of the training
        documents back to back, from offsets uniform over them, a function of (seed, step) alone.
        Returns x, y, pos and segments, each (batch_size, seq_len): the pieces of documents in a
        row are its segments, numbered from 0, and a piece's positions restart at 0, so that
        each piece is read as it would be alone; a target that starts the next piece is IGNORE
        (nothing is predicted across a document's start). Under dataset.bos each piece's first
        token is BOS, the prediction made at it not trained."""
        rng = np.random.default_rng([seed, step])
        first, end = int(self.train_docs[0]), int(self.train_docs[-1])
        starts = first + rng.integers(0, end - first - seq_len, size=batch_size)
        index = starts[:, None] + np.arange(seq_len + 1)
        rows = self.tokens[index].astype(np.int64)
        doc = np.searchsorted(self.train_docs, index, side="right") - 1
        begins = np.ones_like(index, dtype=bool)
        begins[:, 1:] = doc[:, 1:] != doc[:, :-1]
        pos = index - np.maximum(self.train_docs[doc], starts[:, None])
        if self.bos is not None:
            rows[begins] = self.bos
        y = rows[:, 1:].copy()
        y[begins[:, 1:]] = IGNORE
        if self.bos is not None:
            y[begins[:, :-1]] = IGNORE
        return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in
                     (rows[:, :-1], y, pos[:, :-1], (doc - doc[:, :1])[:, :-1]))

    def eval_plan(self, length: int, eval_cfg, protocol) -> EvalPlan:
        """The validation windows the protocol (posbench/evaluations/perplexity.py) starts at,
        scored from its stride's position on."""
        starts = protocol.starts(self, length, eval_cfg)
        block = protocol.stride(eval_cfg)
        first = 0 if block is None else length - block
        if self.bos is not None:
            first = max(first, 1)  # the prediction made at BOS is not scored
        return EvalPlan(length, len(starts), first, lambda i, j: (with_bos(
            np.stack([self.tokens[s:s + length + 1] for s in starts[i:j]]), self.bos), None),
            starts)


def write_token_dir(target: Path, train: Iterable[np.ndarray], val: Iterable[np.ndarray],
                    vocab_size: int, fingerprint: str, name: str) -> None:
    """Write tokens.bin + meta.json into a temporary folder, then rename it into place, so a
    crash never leaves a half-written cache."""
    dtype = np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        offsets = {"train": [0], "val": []}
        with open(tmp / "tokens.bin", "wb") as f:
            for split, docs in (("train", train), ("val", val)):
                if split == "val":
                    offsets["val"].append(offsets["train"][-1])
                for doc in docs:
                    f.write(np.asarray(doc, dtype=dtype).tobytes())
                    offsets[split].append(offsets[split][-1] + len(doc))
            f.flush()
            os.fsync(f.fileno())
        for split, docs in offsets.items():
            if len(docs) < 2:
                raise EmptySplitError(f"no {split} documents")
        meta = {"format": FORMAT, "name": name, "fingerprint": fingerprint, "vocab_size": vocab_size,
                "dtype": np.dtype(dtype).name, "train_docs": offsets["train"],
                "val_docs": offsets["val"], "sha256": file_digest(tmp / "tokens.bin").hex()}
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "meta.json").exists():
                raise
            shutil.rmtree(tmp)  # another process finished first; theirs is identical
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # a full disk, not a read
            raise write_failed(target, err) from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_token_dir(path: Path) -> TokenData:
    """Open a token folder, refusing a corrupt or truncated one by its checksum."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        tokens_path = path / "tokens.bin"
        if file_digest(tokens_path).hex() != meta["sha256"]:
            raise ValueError("checksum mismatch")
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"token cache {path} is corrupt or incomplete ({err}); delete it and "
                          "run again to rebuild it") from None
    tokens = np.memmap(tokens_path, dtype=meta["dtype"], mode="r")
    return TokenData(tokens, np.array(meta["train_docs"], dtype=np.int64),
                     np.array(meta["val_docs"], dtype=np.int64), meta["vocab_size"],
                     meta["fingerprint"], meta["name"])


def fingerprint(items: Iterable[Tuple[str, bytes]]) -> str:
    """Of (name, sha256 digest) pairs: a corpus's identity (posbench/data/documents.py)."""
    h = hashlib.sha256()
    for key, digest in items:
        h.update(key.encode() + b"\0" + digest)
    return "sha256:" + h.hexdigest()


def is_validation(key: str, val_fraction: float) -> bool:
    """A document's split follows from its name alone, so adding files never reshuffles others."""
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < val_fraction
