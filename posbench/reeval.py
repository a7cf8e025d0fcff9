"""`posbench eval RUN_DIR [overrides]`: score a trained checkpoint again (new lengths, RoPE scaling,
...) without retraining. The new results sit beside the old ones; nothing is overwritten."""
from __future__ import annotations

import re
from pathlib import Path
from typing import List

from omegaconf import DictConfig, OmegaConf

import posbench
from posbench.checkpoint import CHECKPOINT, load_checkpoint
from posbench.config import ConfigError
from posbench.evaluate import evaluate
from posbench.results import load_results, print_curve, results_record, write_results
from posbench.train import prepare_run


def results_name(run_dir: Path, overrides: List[str]) -> str:
    """results.eval-<overrides>.json, numbered when that name is taken."""
    tag = re.sub(r"[^A-Za-z0-9_.=-]+", "_", ",".join(o.removeprefix("eval.") for o in overrides
                                                    if not o.startswith("hydra")))
    stem = f"results.eval-{tag or 'again'}"[:120]
    name, n = f"{stem}.json", 2
    while (run_dir / name).exists():
        name, n = f"{stem}-{n}.json", n + 1
    return name


def reevaluate(cfg: DictConfig, run_dir: Path, overrides: List[str]) -> dict:
    if any(not o.startswith(("eval.", "device=", "hydra")) for o in overrides):
        raise ConfigError(f"overrides {overrides} are not accepted by posbench eval; expected "
                          "eval.* keys and device= only (the model is the trained one)")
    trained = load_results(run_dir / "results.json")
    device, data = prepare_run(cfg)
    if data.fingerprint != trained["dataset"]["fingerprint"]:
        raise ConfigError(f"dataset fingerprint {data.fingerprint} differs from the run's "
                          f"{trained['dataset']['fingerprint']}; expected the training corpus")
    state = load_checkpoint(run_dir / CHECKPOINT)
    model = posbench.build_model(OmegaConf.create(state["config"]), data.vocab_size)
    model.load_state_dict(state["model"])
    model.to(device)
    curve = evaluate(model, data, cfg.eval, device)
    record = results_record(cfg, model, data, curve, train=trained["train"])
    record["evaluated_from"] = str(run_dir / CHECKPOINT)
    name = results_name(run_dir, overrides)
    write_results(run_dir, record, name=name)
    print_curve(record)
    print(f"wrote {run_dir / name}")
    return record
