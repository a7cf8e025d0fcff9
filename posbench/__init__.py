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

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Union

import torch
from omegaconf import DictConfig

import posbench.resolvers  # noqa: F401  the ${posbench.*} resolvers of conf/config.yaml
from posbench.config import ConfigError, check, register_schemas
from posbench.encodings import Dims, build_encoding, list_encodings

__version__ = "0.1.0"

register_schemas()


def compose(overrides: Optional[List[str]] = None) -> DictConfig:
    """The config the CLI's `train` would see for these overrides (no hydra node)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="posbench.conf", version_base=None):
        cfg = hydra_compose(config_name="config", overrides=list(overrides or []))
    check(cfg)
    return cfg


def build_model(cfg: DictConfig, vocab_size: Optional[int] = None):
    """The GPT with the config's encoding. vocab_size defaults to the dataset tokenizer's."""
    from posbench.data import vocab_size as dataset_vocab
    from posbench.model import GPT

    m = cfg.model
    dims = Dims(n_layer=m.n_layer, n_head=m.n_head, d_model=m.d_model,
                train_len=cfg.train.seq_len, max_len=max([cfg.train.seq_len, *cfg.eval.lengths]))
    return GPT(vocab_size or dataset_vocab(cfg.dataset), m.n_layer, m.n_head, m.d_model,
               m.mlp_ratio, build_encoding(cfg, dims))


@dataclass
class Run:
    """A finished run, as posbench.load_run reads it from its run dir."""
    model: torch.nn.Module  # the trained model, in eval mode
    config: DictConfig  # the config it was trained with
    results: dict  # its results.json
    run_dir: Path


def load_run(run_dir: Union[str, Path], device: Union[str, torch.device] = "cpu") -> Run:
    """The trained model of a finished run dir (`posbench train`'s hydra.run.dir, or a sweep's
    job dir) on `device`, with its config and results; ConfigError, in one line, for a run dir
    that holds no finished run or a checkpoint that fails its digest."""
    from posbench.train import finished_results, trained_model

    run_dir = Path(run_dir)
    results = finished_results(run_dir)
    trained = trained_model(run_dir, device)
    return Run(trained.model, trained.config, results, run_dir)


__all__ = ["ConfigError", "Run", "build_model", "compose", "list_encodings", "load_run",
           "__version__"]
