"""Text corpora: a dataset whose documents are tokenized once into a token file, cached by content
fingerprint (posbench/data/tokens.py). A corpus says where its documents come from
(`documents()`, posbench/data/documents.py); the tokenizer and the train/validation split are
the same for all of them."""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from posbench.data.base import Dataset
from posbench.data.documents import Documents
from posbench.data.tokenize import TOKENIZERS, Tokenizer
from posbench.data.tokens import (EmptySplitError, TokenData, fingerprint, is_validation,
                                  read_token_dir, write_token_dir)
from posbench.core.errors import ConfigError


class TextCorpus(Dataset):
    def documents(self) -> Documents:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        # nominal: a name check() accepted; dataset.bos adds its token after the tokenizer's
        return TOKENIZERS[self.cfg.tokenizer] + self.cfg.bos

    def prepare(self) -> TokenData:
        """The token file of the corpus, built on first use and cached by fingerprint."""
        cfg = self.cfg
        tokenizer = Tokenizer(cfg)
        docs = self.documents()
        header = f"tokenizer={tokenizer.identity},val={cfg.val_fraction}"
        fp = fingerprint([(header, hashlib.sha256(b"").digest())] + docs.identity)
        target = Path(cfg.cache_dir) / f"{cfg.name}-{fp[7:23]}"
        if not target.exists():
            def split(name):
                return (doc for key, fixed, doc in docs.read()
                        if (fixed or ("val" if is_validation(key, cfg.val_fraction)
                                      else "train")) == name)
            try:
                write_token_dir(target, tokenizer.encode_all(split("train"), "tokenize train"),
                                tokenizer.encode_all(split("val"), "tokenize val"),
                                tokenizer.vocab_size, fp, cfg.name)
            except EmptySplitError as err:
                raise ConfigError(f"dataset={cfg.name} with dataset.val_fraction="
                                  f"{cfg.val_fraction} is not accepted: {err}; expected "
                                  "documents on both sides (a val_fraction in (0, 1), or more "
                                  "documents)") from None
        data = read_token_dir(target)
        if cfg.val_stream:
            data = dataclasses.replace(data, val_docs=data.val_docs[[0, -1]])
        if cfg.bos:
            data = dataclasses.replace(data, vocab_size=data.vocab_size + 1, bos=data.vocab_size)
        return data
