"""Sweeps on clusters (SLURM through submitit: config only here); joblib's parallel sweep runs in
test_cli.py's multirun."""

import posbench  # noqa: F401 - registers the schema and encodings
from posbench.core.composing import composer


def hydra_cfg(overrides):
    with composer() as compose:
        return compose(overrides, hydra=True).hydra


def test_slurm_preset_is_a_ready_submitit_config():
    launcher = hydra_cfg(["hydra/launcher=slurm", "hydra.launcher.partition=gpu"]).launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert launcher.gpus_per_node == 1 and launcher.partition == "gpu"
    assert launcher.max_num_timeout > 0


def test_plain_submitit_slurm_composes():
    launcher = hydra_cfg(["hydra/launcher=submitit_slurm"]).launcher
    assert launcher._target_.endswith("SlurmLauncher")
