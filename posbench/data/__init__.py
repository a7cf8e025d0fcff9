"""Datasets: text corpora, hub datasets, local files and synthetic tasks, one registered class
each (the contract is in posbench/data/base.py). Every module in this package is imported here,
so a new file registers its datasets by being there; nothing else changes."""
from __future__ import annotations

import importlib
import pkgutil

from posbench.data.base import (Data, Dataset, DatasetConfig, build_dataset, check_dataset,
                                dataset_class, register, registry)

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")


def prepare(dataset_cfg) -> Data:
    """The dataset's data: a corpus's token file (built on first use, then cached) or a task's
    generator."""
    return build_dataset(dataset_cfg).prepare()


def vocab_size(dataset_cfg) -> int:
    """The vocabulary a model of this dataset is built with, before any data is read."""
    return build_dataset(dataset_cfg).vocab_size


__all__ = ["Data", "Dataset", "DatasetConfig", "build_dataset", "check_dataset", "dataset_class",
           "prepare", "register", "registry", "vocab_size"]
