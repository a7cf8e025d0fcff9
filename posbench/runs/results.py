"""results.json (schema in docs/design.md), curve.csv and the run's plot."""
from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from posbench.attention.span import lambda_span
from posbench.config import EvalConfig, to_container
from posbench.data.windows import share_tokens
from posbench.encodings.longrope import run_factors
from posbench.encodings.rope import remap_record
from posbench.core.device import machine
from posbench.core.io import write_json, write_text
from posbench.core.parity import ppl_at
from posbench import evaluations
from posbench.evaluations.base import eval_config, with_train_length
from posbench.evaluations.perplexity import plans, ppl_effective_length, protocol_of
from posbench.core.plots import plot_curves, plot_per_position
from posbench.core.version import __version__

RESULTS = "results.json"
# in a sweep's job dir that was refused at its start and holds nothing else: the reason
REFUSED = "refused.json"


def results_record(cfg, model, data, curve: List[dict], train: dict,
                   status: str = "ok", error: Optional[str] = None,
                   sections: Optional[dict] = None) -> dict:
    """`sections`: each section's result by its name (posbench/evaluations/base.py); a section
    that did not run is null."""
    m = cfg.model
    ran = {s: (sections or {}).get(s.name) for s in evaluations.sections()}
    tolerance = cfg.eval.get("ppl_tolerance", EvalConfig.ppl_tolerance)  # older runs lack it
    record = {
        "encoding": cfg.encoding.name, "seed": cfg.seed, "status": status,
        "model": {"params": model.num_params(), "n_layer": m.n_layer, "n_head": m.n_head,
                  "d_model": m.d_model},
        "dataset": {"name": data.name, "fingerprint": data.fingerprint},
        "train": train,
        "eval": {"protocol": cfg.eval.protocol, "tokens_per_length": cfg.eval.tokens,
                 "stride": protocol_of(cfg.eval).stride(cfg.eval),
                 "rope_scaling": cfg.eval.rope_scaling,
                 "rope_scaling_factor": cfg.eval.rope_scaling_factor,
                 # the distance remaps (rerope, self_extend, ...): their values at this L
                 "rope_remap": remap_record(cfg.eval, cfg.train.seq_len),
                 # eval.rope_scaling=longrope: its factors by value
                 "longrope": longrope_record(cfg, data),
                 # eval.attention=lambda: its sinks and window at this L; null: the model's masks
                 "attention": attention_record(cfg.eval, cfg.train.seq_len),
                 "temperature": cfg.eval.get("temperature"),
                 "randomized_positions": cfg.eval.randomized_positions,
                 # the reference of parity between runs (posbench/core/parity.py)
                 "train_len_ppl": ppl_at(curve, cfg.train.seq_len),
                 "ppl_tolerance": tolerance,
                 # the largest lengths where ppl and each section that measures one hold up
                 "effective_length": {
                     "ppl": ppl_effective_length(curve, cfg.train.seq_len, tolerance),
                     **{s.name: result["effective_length"] if result else None
                        for s, result in ran.items() if s.has_effective_length},
                     # NoLiMa's relative rule, where a section gives it
                     **{f"{s.name}_relative": result["relative_effective_length"]
                        for s, result in ran.items()
                        if result and "relative_effective_length" in result}},
                 "curve": curve,
                 **{s.name: result for s, result in ran.items()}},
        "notes": model.encoding.notes(),
        "version": __version__,
        "machine": machine(next(model.parameters()).device),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": to_container(cfg),
    }
    if cfg.train.get("init_from"):
        record["lineage"] = lineage(cfg)
    if error:
        record["error"] = error
    return record


def longrope_record(cfg, data) -> Optional[dict]:
    """The factors file's values in effect (eval.longrope_factors, posbench/encodings/longrope.py),
    its path, and `search_windows_scored`: how many of the windows the curve scored share a
    token with the windows its search chose them on (posbench longrope picks windows that the
    run's own curve does not score; a re-score at other lengths may); null where the file names
    no search windows or the data are a task's. None without longrope."""
    if cfg.eval.get("rope_scaling") != "longrope":
        return None
    path = cfg.eval.longrope_factors
    record = {"path": str(Path(path).resolve()), **run_factors(cfg).record(),
              "search_windows_scored": None}
    windows = json.loads(Path(path).read_text()).get("windows")
    scored = plans(data, with_train_length(eval_config(cfg.eval), cfg.train.seq_len))
    if windows and all(plan.starts is not None for plan in scored):
        searched = [(windows["starts"], windows["length"] + 1)]
        record["search_windows_scored"] = int(sum(
            share_tokens(plan.starts, plan.length + 1, searched).sum() for plan in scored))
    return record


def lineage(cfg) -> List[dict]:
    """The runs this one continues (train.init_from, an extension's parent, and the runs that one
    continues), first run first: each its run dir and what it trained at."""
    parent = Path(cfg.train.init_from)
    record = load_results(parent / RESULTS)
    t = record["config"]["train"]
    return record.get("lineage", []) + [{
        "run_dir": str(parent), "encoding": record["encoding"], "seq_len": t["seq_len"],
        "steps": t["steps"], "rope_scaling": t.get("rope_scaling", "none"),
        "rope_scaling_factor": t.get("rope_scaling_factor"), "pose_span": t.get("pose_span")}]


def curve_csv(curve: List[dict]) -> str:
    accuracy = ["accuracy", "token_accuracy"] if any("accuracy" in p for p in curve) else []
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=["length", "loss", "ppl", "tokens", *accuracy,
                                             "status"], extrasaction="ignore")
    writer.writeheader()
    for point in curve:
        writer.writerow({"status": "ok", **point})
    return out.getvalue()


def per_position_csv(curve: List[dict]) -> str:
    """Mean loss by position in the window, one row per bin: [start, end) positions."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["length", "start", "end", "loss", "tokens"])
    for point in curve:
        bins = point.get("per_position")
        if bins:
            for row in zip(bins["start"], bins["end"], bins["loss"], bins["tokens"]):
                writer.writerow([point["length"], row[0], row[1], f"{row[2]:.6g}", row[3]])
    return out.getvalue()


def rescore_label(record: dict) -> str:
    """What a re-score changed, `rope_scaling=yarn, lengths=[128,4096]`; "" for a run's own
    results."""
    return record.get("rescore", {}).get("label", "")


def write_results(run_dir: Path, record: dict, name: str = RESULTS,
                  original: Optional[dict] = None) -> None:
    """results.json, curve.csv, ppl_vs_length.png, per_position.csv and .png, and for a task
    accuracy_vs_length.png; `name` lets re-scores sit beside, and their plots overlay the
    `original` results' curve; each section that ran writes its own files."""
    stem = Path(name).stem.replace("results", "", 1)
    curve = record["eval"]["curve"]
    train_len = record["train"]["seq_len"]
    changed = rescore_label(record)
    title = (f"{record['encoding']} (seed {record['seed']}, {record['eval']['protocol']})"
             + (f"\nre-scored: {changed}" if changed else ""))
    label = f"{record['encoding']} {changed}" if changed else record["encoding"]
    write_text(run_dir / f"curve{stem}.csv", curve_csv(curve))
    for metric in ("ppl", "accuracy"):
        if not any(metric in p for p in curve):
            continue
        series = {label: [(p["length"], p[metric], None) for p in curve if metric in p]}
        base_of = {}
        if original is not None:
            base = f"{record['encoding']} as trained"
            series = {base: [(p["length"], p[metric], None) for p in original["eval"]["curve"]
                             if metric in p], **series}
            base_of = {label: base}
        plot_curves(series, train_len, run_dir / f"{metric}_vs_length{stem}.png", title=title,
                    metric=metric, base_of=base_of)
    for section in evaluations.sections():
        if record["eval"].get(section.name):
            section.write(record["eval"][section.name], train_len, run_dir, stem, title)
    if any("per_position" in p for p in curve):
        write_text(run_dir / f"per_position{stem}.csv", per_position_csv(curve))
        plot_per_position(curve, train_len, run_dir / f"per_position{stem}.png", title=title)
    write_json(run_dir / name, record)  # last: its presence means the run is complete


def length_metrics(record: dict) -> Dict[int, dict]:
    """Per evaluated length, the sections' scalars that join its wandb row."""
    out: Dict[int, dict] = {}
    for section in evaluations.sections():
        if record["eval"].get(section.name):
            for length, metrics in section.length_metrics(record["eval"][section.name]).items():
                out.setdefault(length, {}).update(metrics)
    return out


def summary_metrics(record: dict) -> Dict[str, Any]:
    """The scalars of a run's (or a re-score's) wandb summary: perplexity at the training
    length, every effective length of eval.effective_length and the sections' own."""
    out = {"train_len_ppl": record["eval"]["train_len_ppl"],
           **{f"effective_length/{k}": v for k, v in record["eval"]["effective_length"].items()}}
    for section in evaluations.sections():
        if record["eval"].get(section.name):
            out.update(section.summary_metrics(record["eval"][section.name]))
    return out


def load_results(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def attention_record(eval_cfg, train_len: int) -> Optional[dict]:
    """eval.attention=lambda's values in effect, defaults filled in; None without it."""
    if eval_cfg.get("attention", "global") != "lambda":
        return None
    span = lambda_span(train_len, eval_cfg.get("lambda_sinks"), eval_cfg.get("lambda_window"))
    return {"kind": "lambda", "sinks": span.sinks, "window": span.width}


def eval_options(record: dict) -> str:
    """The protocol and eval-time options a record was scored with, in one line."""
    e = record["eval"]
    factor = e.get("rope_scaling_factor")
    options = [f"protocol {e['protocol']}", f"{e['tokens_per_length']} tokens per length"]
    if e.get("stride"):
        options.append(f"stride {e['stride']}")
    remap = e.get("rope_remap")
    if remap:  # a factor left out: ReRoPE's infinite k, Self-Extend's dynamic G
        options.append(f"rope_scaling {e['rope_scaling']} (" + ", ".join(
            f"{key} {remap[key]:g}" for key in ("near", "window", "shift", "factor", "chunk")
            if remap.get(key) is not None) + ")")
    elif e.get("longrope"):
        longrope = e["longrope"]
        shared = longrope["search_windows_scored"]
        options.append(f"rope_scaling longrope (factors for {longrope['length']} from "
                       f"{longrope['path']}" + (f"; {shared} scored windows share tokens with "
                                                "the search's" if shared else "") + ")")
    elif e.get("rope_scaling", "none") != "none":
        options.append(f"rope_scaling {e['rope_scaling']} "
                       + (f"(static factor {factor:g})" if factor else "(dynamic)"))
    if e.get("temperature"):
        options.append(f"temperature {e['temperature']}")
    if e.get("attention"):
        options.append("attention lambda (sinks {sinks}, window {window})".format(**e["attention"]))
    if record["encoding"] == "randomized":
        options.append(f"randomized_positions {e.get('randomized_positions')}")
    return ", ".join(options)


def print_curve(record: dict) -> None:
    train_len = record["train"]["seq_len"]
    changed = rescore_label(record)
    print(f"\n{record['encoding']}" + (f" re-scored ({changed})" if changed else "")
          + f": trained at {train_len}, final train loss {record['train']['final_loss']:.4f}")
    print(f"  {eval_options(record)}")
    curve = record["eval"]["curve"]
    accuracy = any("accuracy" in p for p in curve)
    print(f"{'length':>8} {'loss':>8} {'ppl':>9}" + (f" {'exact':>7}" if accuracy else ""))
    for p in curve:
        if "loss" in p:
            mark = "  <- train length" if p["length"] == train_len else ""
            exact = f" {p['accuracy']:>7.3f}" if "accuracy" in p else ""
            print(f"{p['length']:>8} {p['loss']:>8.4f} {p['ppl']:>9.3f}{exact}{mark}")
        else:
            print(f"{p['length']:>8} {p['status']:>8}")
    label = record["encoding"] + (f" ({changed})" if changed else "")
    for section in evaluations.sections():  # the tables a sweep's report prints, for this run
        if record["eval"].get(section.name):
            print("\n".join(section.report_lines([record], {0: label})))
