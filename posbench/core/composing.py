"""Hydra's composition of posbench's config tree from Python, outside the CLI's Hydra app: the
API's posbench.compose and posbench reproduce, which composes an entry's rows to read them."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, List

from omegaconf import DictConfig


@contextmanager
def composer() -> Iterator[Callable[..., DictConfig]]:
    """`compose(overrides, hydra=False)` over posbench.conf's `config`, the hydra node kept
    with hydra=True. Hydra's global state is cleared first: an earlier composition, or a Hydra
    app that has run in this process, leaves it initialized and Hydra refuses a second one."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    def composed(overrides: List[str], hydra: bool = False) -> DictConfig:
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra)

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="posbench.conf", version_base=None):
        yield composed
