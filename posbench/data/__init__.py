"""Datasets become token files once (posbench/data/tokens.py): corpora say where documents come
from (corpora.py, hub.py), tokenizers turn their bytes into ids (tokenize.py). Synthetic tasks
(tasks.py) are generated instead, when asked for."""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Union

from posbench.errors import ConfigError
from posbench.data.corpora import CORPORA
from posbench.data.tasks import TASKS, TaskData, task_data
from posbench.data.tokenize import TOKENIZERS, Tokenizer
from posbench.data.tokens import (EmptySplitError, TokenData, fingerprint, is_validation,
                                  read_token_dir, write_token_dir)


def vocab_size(dataset_cfg) -> int:
    if dataset_cfg.name in TASKS:
        return TASKS[dataset_cfg.name].vocab_size
    return TOKENIZERS[dataset_cfg.tokenizer]  # a name config.check accepted


def prepare(dataset_cfg) -> Union[TokenData, TaskData]:
    """Token file of the dataset, built on first use and cached by content fingerprint."""
    if dataset_cfg.name not in CORPORA:
        raise ConfigError(f"dataset={dataset_cfg.name!r} is not accepted; expected one of "
                          f"{sorted(CORPORA)}")
    if dataset_cfg.name in TASKS:
        return task_data(dataset_cfg.name)
    tokenizer = Tokenizer(dataset_cfg)
    corpus = CORPORA[dataset_cfg.name](dataset_cfg)
    header = f"tokenizer={tokenizer.identity},val={dataset_cfg.val_fraction}"
    fp = fingerprint([(header, hashlib.sha256(b"").digest())] + corpus.identity)
    target = Path(dataset_cfg.cache_dir) / f"{dataset_cfg.name}-{fp[7:23]}"
    if not target.exists():
        def split(name):
            return (doc for key, fixed, doc in corpus.documents()
                    if (fixed or ("val" if is_validation(key, dataset_cfg.val_fraction)
                                  else "train")) == name)
        try:
            write_token_dir(target, tokenizer.encode_all(split("train"), "tokenize train"),
                            tokenizer.encode_all(split("val"), "tokenize val"),
                            tokenizer.vocab_size, fp, dataset_cfg.name)
        except EmptySplitError as err:
            raise ConfigError(f"dataset={dataset_cfg.name} with dataset.val_fraction="
                              f"{dataset_cfg.val_fraction} is not accepted: {err}; expected "
                              "documents on both sides (a val_fraction in (0, 1), or more "
                              "documents)") from None
    data = read_token_dir(target)
    if dataset_cfg.get("val_stream", False):
        data = dataclasses.replace(data, val_docs=data.val_docs[[0, -1]])
    return data
