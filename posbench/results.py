"""results.json (schema in shared/DESIGN.md), curve.csv and the run's plot."""
from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path
from typing import List, Optional

import posbench
from posbench.config import to_container
from posbench.io import write_json, write_text

RESULTS = "results.json"


def results_record(cfg, model, data, curve: List[dict], train: dict,
                   status: str = "ok", error: Optional[str] = None) -> dict:
    m = cfg.model
    record = {
        "encoding": cfg.encoding.name, "seed": cfg.seed, "status": status,
        "model": {"params": model.num_params(), "n_layer": m.n_layer, "n_head": m.n_head,
                  "d_model": m.d_model},
        "dataset": {"name": data.name, "fingerprint": data.fingerprint},
        "train": train,
        "eval": {"protocol": cfg.eval.protocol, "tokens_per_length": cfg.eval.tokens,
                 "rope_scaling": cfg.eval.rope_scaling, "logn_scaling": cfg.eval.logn_scaling,
                 "curve": curve},
        "notes": model.encoding.notes(),
        "version": posbench.__version__,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": to_container(cfg),
    }
    if error:
        record["error"] = error
    return record


def curve_csv(curve: List[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=["length", "loss", "ppl", "tokens", "status"],
                            extrasaction="ignore")
    writer.writeheader()
    for point in curve:
        writer.writerow({"status": "ok", **point})
    return out.getvalue()


def write_results(run_dir: Path, record: dict, name: str = RESULTS) -> None:
    """results.json, curve.csv and ppl_vs_length.png; `name` lets re-evaluations sit beside."""
    from posbench.report import plot_curves

    stem = Path(name).stem.replace("results", "", 1)
    curve = record["eval"]["curve"]
    write_text(run_dir / f"curve{stem}.csv", curve_csv(curve))
    plot_curves({record["encoding"]: [(p["length"], p["ppl"], None) for p in curve if "ppl" in p]},
                record["train"]["seq_len"], run_dir / f"ppl_vs_length{stem}.png",
                title=f"{record['encoding']} (seed {record['seed']})")
    write_json(run_dir / name, record)  # last: its presence means the run is complete


def load_results(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def print_curve(record: dict) -> None:
    train_len = record["train"]["seq_len"]
    print(f"\n{record['encoding']}: trained at {train_len}, final train loss "
          f"{record['train']['final_loss']:.4f}")
    print(f"{'length':>8} {'loss':>8} {'ppl':>9}")
    for p in record["eval"]["curve"]:
        if "loss" in p:
            mark = "  <- train length" if p["length"] == train_len else ""
            print(f"{p['length']:>8} {p['loss']:>8.4f} {p['ppl']:>9.3f}{mark}")
        else:
            print(f"{p['length']:>8} {p['status']:>8}")
