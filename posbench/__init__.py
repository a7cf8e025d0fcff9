"""posbench: which positional encoding lets a transformer trained short work long?

Public API (stable):
    cfg = posbench.compose(["encoding=alibi", "model=tiny"])
    model = posbench.build_model(cfg)
    logits = model(idx, pos=None)
    posbench.list_encodings()
    run = posbench.load_run("outputs/...")  # a finished run dir: run.model (eval mode, on CPU
    run.config, run.results                 # or device=...), its config, its results.json
"""
from __future__ import annotations

from typing import List, Optional

from omegaconf import DictConfig, open_dict

import posbench.core.resolvers  # noqa: F401  the ${posbench.*} resolvers of conf/config.yaml
from posbench.config import check, register_schemas, register_target_schema
from posbench.encodings import list_encodings
from posbench.core.composing import composer
from posbench.core.errors import ConfigError
from posbench.core.resolvers import override_key
from posbench.model.transformer import build_model
from posbench.runs.run import Run, load_run
from posbench.core.version import __version__

register_schemas()


def compose(overrides: Optional[List[str]] = None) -> DictConfig:
    """The config the CLI's `train` would see for these overrides (no hydra node)."""
    overrides = list(overrides or [])
    with composer() as compose_config:
        # without the encoding's own keys, which a user's `_target_` class types only once
        # register_target_schema has imported it
        chosen = [o for o in overrides if not override_key(o).startswith("encoding.")]
        cfg = compose_config(chosen, hydra=True)
        if register_target_schema(cfg) or chosen != overrides:
            cfg = compose_config(overrides)
        else:  # nothing the first composition lacked: it is the config, less its hydra node
            with open_dict(cfg):
                del cfg["hydra"]
    check(cfg)
    return cfg


__all__ = ["ConfigError", "Run", "build_model", "compose", "list_encodings", "load_run",
           "__version__"]
