"""Tokenizers: byte level (no files) and GPT-2 BPE read from local files, never downloaded.

GPT-2's BPE runs in tiktoken (Rust, threads that release the GIL), in bounded batches, with
progress."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Tuple

import numpy as np
import tiktoken
from tqdm import tqdm

from posbench.core.errors import ConfigError

# nominal vocabulary sizes: what a model is built with before any data is read
TOKENIZERS = {"byte": 256, "gpt2": 50257}
# tiktoken caches OpenAI's files under the sha1 of their URL
TIKTOKEN_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
# GPT-2's pre-tokenizer: its encoder.py's regex, with the contractions grouped as tiktoken
# writes them ('s|'t|'re|'ve|'m|'ll|'d, run faster). \s is Unicode's White_Space, as in GPT-2.
GPT2_SPLIT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# text per tiktoken batch: enough for every thread, while the ids held at once stay small
BATCH_BYTES = 1 << 22


def _byte_chars() -> List[str]:
    """GPT-2's reversible map from each byte to the printable character its files spell it
    with."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


class GPT2BPE:
    """Byte-level BPE from vocab.json (token -> id) and merges.txt (ranked pairs), as GPT-2.

    tiktoken merges first the adjacent pair whose union has the lowest rank. Ranking each union
    by its line in merges.txt makes that GPT-2's rule (the pair listed first) for the merge
    lists BPE training writes, GPT-2's own included (tests/test_datasets.py checks it against
    the reference rule on a vocabulary it trains); vocab.json then names each rank's id."""

    def __init__(self, vocab_path: Path, merges_path: Path):
        def refuse(why: str):
            return ConfigError(f"GPT-2 BPE files {vocab_path} + {merges_path} are not accepted: "
                               f"{why}; expected GPT-2's vocab.json (token -> id) and "
                               "merges.txt (one pair a line)")

        try:
            vocab = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
            lines = Path(merges_path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise refuse(str(err)) from None
        if not isinstance(vocab, dict):
            raise refuse("vocab.json is not an object")
        byte_chars = _byte_chars()
        tokens = list(byte_chars)
        for n, line in enumerate(lines, 1):
            if line and not line.startswith("#version"):
                pair = line.split()
                if len(pair) != 2:
                    raise refuse(f"merges line {n} is {line!r}, not a pair")
                tokens.append("".join(pair))
        tokens = list(dict.fromkeys(tokens))  # a token listed twice keeps its first rank
        byte_of = {c: b for b, c in enumerate(byte_chars)}
        foreign = next((t for t in tokens if not all(c in byte_of for c in t)), None)
        if foreign is not None:
            raise refuse(f"merges.txt spells {foreign!r} in characters that stand for no byte")
        missing = [t for t in tokens if not isinstance(vocab.get(t), int)]
        if missing:
            raise refuse(f"vocab.json has no id for {missing[0]!r} ({len(missing)} tokens)")
        self.vocab_size = len(vocab)
        self.ids = np.array([vocab[t] for t in tokens], dtype=np.int64)  # rank -> id
        ranks = {bytes(byte_of[c] for c in token): rank for rank, token in enumerate(tokens)}
        self.encoding = tiktoken.Encoding("gpt2", pat_str=GPT2_SPLIT, mergeable_ranks=ranks,
                                          special_tokens={})

    def encode_batch(self, texts: List[str]) -> List[np.ndarray]:
        ranks = self.encoding.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1)
        return [self.ids[np.asarray(r, dtype=np.int64)] for r in ranks]


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
    if tokenizer_path:
        raise ConfigError(f"dataset.tokenizer_path={tokenizer_path!r} is not accepted: it holds "
                          "no vocab.json + merges.txt (nothing is downloaded); expected a folder "
                          "with GPT-2's vocab.json and merges.txt (or encoder.json and vocab.bpe)")
    raise ConfigError("dataset.tokenizer=gpt2 without dataset.tokenizer_path is not accepted: no "
                      "GPT-2 vocab.json + merges.txt is in the Hugging Face or tiktoken cache "
                      "(nothing is downloaded); expected dataset.tokenizer_path=DIR with "
                      "vocab.json and merges.txt, or dataset.tokenizer=byte")


class Tokenizer:
    """What preparation needs of a tokenizer: an identity for the cache name, the vocabulary
    size, and `encode_all`."""

    def __init__(self, dataset_cfg):
        """From the typed dataset config (posbench/data/base.py: dataset_config)."""
        self.name = dataset_cfg.tokenizer  # a name the dataset's check accepted
        files = gpt2_files(dataset_cfg.tokenizer_path) if self.name == "gpt2" else None
        self.bpe = GPT2BPE(*files) if files else None
        if self.bpe is None:
            self.identity, self.vocab_size = "byte", 256
        else:
            digest = hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()
            self.identity = f"gpt2:{digest[:16]}"
            self.vocab_size = self.bpe.vocab_size

    def encode_all(self, documents: Iterable[bytes], desc: str) -> Iterator[np.ndarray]:
        docs = tqdm(documents, desc=desc, unit="doc", leave=False)
        if self.bpe is None:  # byte level is a copy
            for doc in docs:
                yield np.frombuffer(doc, dtype=np.uint8)
            return
        batch, size = [], 0
        for doc in docs:
            batch.append(doc.decode("utf-8", errors="replace"))
            size += len(doc)
            if size >= BATCH_BYTES:
                yield from self.bpe.encode_batch(batch)
                batch, size = [], 0
        yield from self.bpe.encode_batch(batch)
