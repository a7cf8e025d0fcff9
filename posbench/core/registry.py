"""The one registry shape of every kind of component: encodings, datasets and evaluations each
keep a Registry (name -> Entry) and a `register` class decorator built on it."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf


@functools.lru_cache(maxsize=None)
def typed_defaults(config_cls: type) -> DictConfig:
    """A typed config's defaults, built once per class: OmegaConf.merge copies its first config,
    so `OmegaConf.merge(typed_defaults(cls), values)` types `values` without building the
    structured config again (milliseconds a check, and a sweep checks every job)."""
    return OmegaConf.structured(config_cls)


@dataclass(frozen=True)
class Entry:
    name: str
    cls: type
    description: str  # what `posbench list` shows
    # the typed config node that `<group>=<name>` selects: cls.Config() or a preset of it
    config: Any = None


class Registry(dict):
    """name -> Entry for subclasses of `base`. With a Hydra config `group`, registering a name
    also stores its config node there, so that `<group>=<name>` composes it."""

    def __init__(self, base: type, group: Optional[str] = None):
        super().__init__()
        self.base, self.group = base, group

    def add(self, cls: type, name: str, description: str, config: Any = None) -> type:
        assert issubclass(cls, self.base), cls
        node = None
        if self.group is not None:
            node = dataclasses.replace(config or cls.Config(), name=name)
            ConfigStore.instance().store(group=self.group, name=name, node=node)
        self[name] = Entry(name, cls, description, node)
        return cls

    def by_name(self) -> Dict[str, Entry]:
        return dict(sorted(self.items()))
