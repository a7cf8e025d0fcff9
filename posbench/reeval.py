"""`posbench eval RUN_DIR [overrides]`: score a trained checkpoint again (new lengths, RoPE scaling,
...) without retraining. The new results sit beside the old ones; nothing is overwritten."""
from __future__ import annotations

import re
from pathlib import Path
from typing import List

from omegaconf import DictConfig

from posbench.checkpoint import CHECKPOINT
from posbench.config import ConfigError
from posbench.evaluate import evaluate
from posbench.results import print_curve, results_record, write_results
from posbench.train import finished_results, prepare_run, trained_model


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
    trained = finished_results(run_dir)
    device, data = prepare_run(cfg)
    loaded = trained_model(run_dir, device)
    loaded.require_corpus(data)
    model = loaded.model
    curve = evaluate(model, data, cfg.eval, device, cfg.train.seq_len)
    record = results_record(cfg, model, data, curve, train=trained["train"])
    record["evaluated_from"] = str(run_dir / CHECKPOINT)
    name = results_name(run_dir, overrides)
    write_results(run_dir, record, name=name)
    print_curve(record)
    print(f"wrote {run_dir / name}")
    return record
