"""Tokenizers: byte level (no files) and GPT-2 BPE read from local files, never downloaded.

Documents are tokenized in parallel on every core (order kept, memory bounded), with progress."""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import sys
import tempfile
import unicodedata
from functools import lru_cache
from multiprocessing import Pool
from pathlib import Path
from typing import Iterable, Iterator, Optional, Tuple

import numpy as np
from tqdm import tqdm

from posbench.config import ConfigError

# nominal vocabulary sizes: what a model is built with before any data is read
TOKENIZERS = {"byte": 256, "gpt2": 50257}
# tiktoken caches OpenAI's files under the sha1 of their URL
TIKTOKEN_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"


def _bytes_to_unicode() -> dict:
    """GPT-2's reversible map from bytes to printable characters: BPE runs on these."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _pretokenizer() -> re.Pattern:
    """GPT-2's split pattern. It needs \\p{L} and \\p{N}, which the standard library's `re` lacks,
    so the two classes are spelled out from unicodedata (built once per process, ~1 s)."""
    ranges = {"L": [], "N": []}
    for cp in range(sys.maxunicode + 1):
        group = ranges.get(unicodedata.category(chr(cp))[0])
        if group is not None:
            if group and group[-1][1] == cp - 1:
                group[-1][1] = cp
            else:
                group.append([cp, cp])
    cls = {k: "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in v) for k, v in ranges.items()}
    return re.compile(rf"""'s|'t|'re|'ve|'m|'ll|'d| ?[{cls['L']}]+| ?[{cls['N']}]+"""
                      rf"""| ?[^\s{cls['L']}{cls['N']}]+|\s+(?!\S)|\s+""")


class GPT2BPE:
    """Byte-level BPE from vocab.json (token -> id) and merges.txt (ranked pairs), as GPT-2."""

    def __init__(self, vocab_path: Path, merges_path: Path):
        self.encoder = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
        lines = Path(merges_path).read_text(encoding="utf-8").splitlines()
        merges = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.byte_chars = _bytes_to_unicode()
        self.pattern = _pretokenizer()
        self.bpe = lru_cache(maxsize=1 << 18)(self._bpe)

    def _bpe(self, word: str) -> Tuple[str, ...]:
        parts = tuple(word)
        while len(parts) > 1:
            pair = min(zip(parts, parts[1:]), key=lambda p: self.ranks.get(p, float("inf")))
            if pair not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = tuple(merged)
        return parts

    def encode(self, text: str) -> list:
        ids = []
        for piece in self.pattern.findall(text):
            word = "".join(self.byte_chars[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[token] for token in self.bpe(word))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        tokens = {i: t for t, i in self.encoder.items()}
        bytes_of = {c: b for b, c in self.byte_chars.items()}
        text = "".join(tokens[int(i)] for i in ids)
        return bytes(bytes_of[c] for c in text).decode("utf-8", errors="replace")


def _gpt2_candidates(tokenizer_path: Optional[str]):
    """(vocab, merges) pairs to look for, in order; OpenAI's own names for the same two files
    are encoder.json and vocab.bpe."""
    if tokenizer_path:
        folder = Path(tokenizer_path).expanduser()
        yield folder / "vocab.json", folder / "merges.txt"
        yield folder / "encoder.json", folder / "vocab.bpe"
        return
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        pass
    else:
        for repo in ("openai-community/gpt2", "gpt2"):
            vocab, merges = (try_to_load_from_cache(repo, f) for f in ("vocab.json", "merges.txt"))
            if isinstance(vocab, str) and isinstance(merges, str):
                yield Path(vocab), Path(merges)
    cache = Path(os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
                 or Path(tempfile.gettempdir()) / "data-gym-cache")
    sha1 = lambda name: hashlib.sha1((TIKTOKEN_URL + name).encode()).hexdigest()
    yield cache / sha1("encoder.json"), cache / sha1("vocab.bpe")


def gpt2_files(tokenizer_path: Optional[str]) -> Tuple[Path, Path]:
    for vocab, merges in _gpt2_candidates(tokenizer_path):
        if vocab.is_file() and merges.is_file():
            return vocab, merges
    where = (f"dataset.tokenizer_path={tokenizer_path!r} holds no vocab.json + merges.txt"
             if tokenizer_path else "none were found in the Hugging Face or tiktoken cache")
    raise ConfigError(f"dataset.tokenizer=gpt2 needs the GPT-2 BPE files and {where} (nothing is "
                      "downloaded); expected dataset.tokenizer_path=DIR with vocab.json and "
                      "merges.txt, or dataset.tokenizer=byte")


class Tokenizer:
    """What preparation needs of a tokenizer: an identity for the cache name, the vocabulary
    size, and a parallel `encode_all`."""

    def __init__(self, dataset_cfg):
        self.name = dataset_cfg.tokenizer  # a name config.check accepted
        self.files = gpt2_files(dataset_cfg.get("tokenizer_path")) if self.name == "gpt2" else None
        if self.files is None:
            self.identity, self.vocab_size = "byte", 256
        else:
            digest = hashlib.sha256(b"".join(p.read_bytes() for p in self.files)).hexdigest()
            self.identity = f"gpt2:{digest[:16]}"
            self.vocab_size = len(json.loads(self.files[0].read_text(encoding="utf-8")))

    def encode_all(self, documents: Iterable[bytes], desc: str) -> Iterator[np.ndarray]:
        docs = tqdm(documents, desc=desc, unit="doc", leave=False)
        if self.files is None:  # byte level is a copy: no processes needed
            for doc in docs:
                yield np.frombuffer(doc, dtype=np.uint8)
            return
        # bounded batches: Pool.imap alone would read the whole corpus into its queue
        with Pool(os.cpu_count(), initializer=_start_worker, initargs=self.files) as pool:
            while batch := list(itertools.islice(docs, 4096)):
                yield from pool.imap(_encode, batch, chunksize=16)


_worker_bpe: Optional[GPT2BPE] = None


def _start_worker(vocab: Path, merges: Path) -> None:
    global _worker_bpe
    _worker_bpe = GPT2BPE(vocab, merges)


def _encode(doc: bytes) -> np.ndarray:
    ids = _worker_bpe.encode(doc.decode("utf-8", errors="replace"))
    return np.asarray(ids, dtype=np.int64)
