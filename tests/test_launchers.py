"""Sweeps on clusters (SLURM through submitit: config only here); joblib's parallel sweep runs in
test_cli.py's multirun."""
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

import posbench  # noqa: F401 - registers the schema and encodings


def hydra_cfg(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="posbench.conf", version_base=None):
        return compose("config", overrides=overrides, return_hydra_config=True).hydra


def test_slurm_preset_is_a_ready_submitit_config():
    launcher = hydra_cfg(["hydra/launcher=slurm", "hydra.launcher.partition=gpu"]).launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert launcher.gpus_per_node == 1 and launcher.partition == "gpu"
    assert launcher.max_num_timeout > 0


def test_plain_submitit_slurm_composes():
    launcher = hydra_cfg(["hydra/launcher=submitit_slurm"]).launcher
    assert launcher._target_.endswith("SlurmLauncher")
