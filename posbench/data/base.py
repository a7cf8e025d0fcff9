"""The dataset contract and the registry: where a run's tokens come from.

A dataset is a class registered as `dataset=<name>` (`@register`), built as `cls(cfg)` from its
typed config, with three members:

- `vocab_size`: the vocabulary the model is built with, known before any data is read;
- `prepare()`: the run's data, read (or generated) once, as an object with the `Data` members;
- `check(cfg, run_cfg)`: refuses, in one line, a value the dataset cannot use (before any work).

Two kinds are built in: text corpora (posbench/data/corpus.py: TextCorpus, documents tokenized
into a cached token file, TokenData) and synthetic tasks (posbench/data/tasks.py: Task, instances
generated when asked for, TaskData). Nothing outside this package branches on a dataset's name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Dict, Optional, Protocol, Tuple

import torch
from omegaconf import MISSING, OmegaConf

from posbench.data.tokenize import TOKENIZERS
from posbench.core.errors import ConfigError, did_you_mean, require
from posbench.core.registry import Entry, Registry, typed_defaults

if TYPE_CHECKING:
    from posbench.data.windows import EvalPlan


@dataclass
class DatasetConfig:
    """The keys every dataset has (a dataset's own Config may add more)."""
    name: str = MISSING
    # byte (no files needed) or gpt2 (BPE from local files; see posbench/data/tokenize.py)
    tokenizer: str = "byte"
    # folder with the GPT-2 vocab.json + merges.txt; unset: the Hugging Face or tiktoken cache
    tokenizer_path: Optional[str] = None
    val_fraction: float = 0.05
    # local files instead of the built-in or hub source (file, folder or glob)
    path: Optional[str] = None
    # a Hugging Face hub dataset and its config name (wikitext103, pg19, openwebtext)
    hub: Optional[str] = None
    hub_config: Optional[str] = None
    # score the validation documents as one stream, back to back, as WikiText papers do;
    # evaluation windows then cross document boundaries
    val_stream: bool = False
    # every training and evaluation window starts with a beginning-of-sequence token, one id past
    # the tokenizer's (text corpora; posbench/data/windows.py): its first token is replaced by
    # BOS, and the prediction made at BOS is neither trained nor scored
    bos: bool = False
    cache_dir: str = "${oc.env:POSBENCH_CACHE,${oc.env:HOME}/.cache/posbench}"


class Data(Protocol):
    """What `prepare()` returns: what training and evaluation read of a dataset."""
    name: str
    fingerprint: str  # sha256:<hex> of the contents: a resume and a re-score check it
    vocab_size: int

    def check_train_len(self, seq_len: int, packed: bool = False) -> None:
        """ConfigError unless training rows of seq_len + 1 tokens exist: windows inside one
        document, or with `packed` (train.pack_documents) documents back to back."""

    def train_batch(self, seq_len: int, batch_size: int, seed: int, step: int,
                    plant: Optional[Callable] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (batch_size, seq_len) of step `step`: a function of (seed, step)."""

    def eval_plan(self, length: int, eval_cfg, protocol) -> EvalPlan:
        """The windows evaluation scores at `length` (posbench/evaluations/perplexity.py)."""


class Dataset:
    Config: ClassVar[type] = DatasetConfig
    # documents of text, in which windows may start anywhere and passkeys be planted; False: a
    # generated instance per window, scored whole (a task)
    text: ClassVar[bool] = True

    def __init__(self, cfg):
        self.cfg = cfg

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def prepare(self) -> Data:
        raise NotImplementedError

    @classmethod
    def check(cls, cfg, run_cfg) -> None:
        """Raise ConfigError for values this dataset cannot use. `cfg` is the typed dataset
        config, `run_cfg` the whole composed config."""
        require(cfg.tokenizer in TOKENIZERS, "dataset.tokenizer", cfg.tokenizer,
                f"one of {sorted(TOKENIZERS)}")


_REGISTRY = Registry(Dataset, group="dataset")


def register(name: str, description: str, config: Optional[DatasetConfig] = None):
    """Class decorator: make `cls` available as `dataset=<name>` with default `config`
    (cls.Config() when omitted); `posbench list` shows the description."""
    return lambda cls: _REGISTRY.add(cls, name, description, config)


def registry() -> Dict[str, Entry]:
    return _REGISTRY.by_name()


def dataset_class(dataset_cfg) -> type:
    name = dataset_cfg.get("name")
    if name not in _REGISTRY:
        raise ConfigError(f"dataset={name!r} is not accepted{did_you_mean(name, _REGISTRY)}; "
                          "expected one of: " + ", ".join(sorted(_REGISTRY)))
    return _REGISTRY[name].cls


def dataset_config(dataset_cfg):
    """The typed config object of a dataset node: its keys and types checked against the
    dataset's Config (a run saved before a key existed gets its default)."""
    cls = dataset_class(dataset_cfg)
    try:
        typed = OmegaConf.merge(typed_defaults(cls.Config),
                                OmegaConf.to_container(dataset_cfg, resolve=True))
    except Exception as err:  # omegaconf's message names the key and the type
        key = getattr(err, "full_key", None)
        raise ConfigError(f"dataset={dataset_cfg.name}: " + (f"dataset.{key}: " if key else "")
                          + str(err).splitlines()[0]) from None
    return OmegaConf.to_object(typed)


def check_dataset(run_cfg) -> None:
    dataset_class(run_cfg.dataset).check(dataset_config(run_cfg.dataset), run_cfg)


def build_dataset(dataset_cfg) -> Dataset:
    return dataset_class(dataset_cfg)(dataset_config(dataset_cfg))
