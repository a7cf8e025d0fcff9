"""Datasets become token files once (posbench/data/tokens.py); corpora say where documents come
from, tokenizers turn their bytes into ids."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from posbench.config import ConfigError
from posbench.data.corpora import CORPORA
from posbench.data.tokens import (TokenData, fingerprint, is_validation, read_token_dir,
                                  write_token_dir)

TOKENIZERS = {"byte": 256}


def vocab_size(dataset_cfg) -> int:
    if dataset_cfg.tokenizer not in TOKENIZERS:
        raise ConfigError(f"dataset.tokenizer={dataset_cfg.tokenizer!r} is not accepted; expected "
                          f"one of {sorted(TOKENIZERS)}")
    return TOKENIZERS[dataset_cfg.tokenizer]


def prepare(dataset_cfg) -> TokenData:
    """Token file of the dataset, built on first use and cached by content fingerprint."""
    if dataset_cfg.name not in CORPORA:
        raise ConfigError(f"dataset={dataset_cfg.name!r} is not accepted; expected one of "
                          f"{sorted(CORPORA)}")
    vocab = vocab_size(dataset_cfg)
    documents = CORPORA[dataset_cfg.name](dataset_cfg)
    fp = fingerprint([(f"tokenizer={dataset_cfg.tokenizer},val={dataset_cfg.val_fraction}", b"")]
                     + documents)
    target = Path(dataset_cfg.cache_dir) / f"{dataset_cfg.name}-{fp[7:23]}"
    if not target.exists():
        train = [d for k, d in documents if not is_validation(k, dataset_cfg.val_fraction)]
        val = [d for k, d in documents if is_validation(k, dataset_cfg.val_fraction)]
        if not train or not val:
            raise ConfigError(f"dataset.val_fraction={dataset_cfg.val_fraction} leaves an empty "
                              f"split of {len(documents)} documents; expected a value in (0, 1) "
                              "that puts documents on both sides")
        tokenize = lambda docs, split: (np.frombuffer(d, dtype=np.uint8) for d in
                                        tqdm(docs, desc=f"tokenize {split}", leave=False))
        write_token_dir(target, tokenize(train, "train"), tokenize(val, "val"), vocab, fp,
                        dataset_cfg.name)
    return read_token_dir(target)
