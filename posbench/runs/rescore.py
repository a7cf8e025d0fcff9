"""`posbench eval RUN_DIR [overrides]`: score a trained checkpoint again (new lengths, RoPE scaling,
another protocol) without retraining. A re-score is named by what it changed from the run's own
evaluation: `eval.rope_scaling=yarn` writes results.eval-rope_scaling-yarn.json, its curve and
plots (overlaid on the original curve) beside the run's results, which are never overwritten.
The same re-score asked again is skipped, as a finished run is. Over a folder of runs, each
re-score's own output (its progress and table) goes to output.eval-<tag>.log beside its results,
and the command prints a line per re-score and one summary table (summary_lines)."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig

from posbench.runs.checkpoint import CHECKPOINT
from posbench.config import flatten, to_container, with_defaults
from posbench.core.errors import ConfigError
from posbench import evaluations
from posbench.runs.loggers import make_logger, run_group
from posbench.core.resolvers import NAME_CHARS, summary
from posbench.runs.results import (length_metrics, load_results, print_curve, results_record,
                                   summary_metrics, write_results)
from posbench.runs.run import finished_results, prepare_run, trained_model


# the longest name of a file a re-score writes (posbench/runs/results.py write_results; the
# sections' own files, such as retrieval_heatmap.eval-<tag>.png, are shorter): its tag is capped
# so that every one of its files stays within NAME_CHARS
LONGEST_FILE = "accuracy_vs_length.eval-{}.png"
TAG_CHARS = NAME_CHARS - len(LONGEST_FILE.format(""))
OUTPUT = "output.eval-{}.log"  # a re-score's own output, when a folder's runs are re-scored
LABEL_CHARS = 40  # a longer change is cut in the summary table


def override_text(value: Any) -> str:
    """A config value as an override writes it: [128,1024], null, true, yarn."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(override_text, value)) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _scored_with(config: dict) -> dict:
    """The keys a re-score may change, flat: eval.* (a key added after the run was trained
    counts at its default, which is how the run was scored) and device."""
    config = to_container(with_defaults(config))
    return flatten({"eval": config["eval"], "device": config.get("device")})


def eval_changes(trained: dict, cfg: dict) -> Dict[str, Any]:
    """key -> value of every eval.* key and device in `cfg` that differs from the `trained`
    config, in config order."""
    old, new = _scored_with(trained), _scored_with(cfg)
    return {key: value for key, value in new.items() if old.get(key) != value}


def change_tag(changes: Dict[str, Any]) -> str:
    """The short safe name of a re-score: rope_scaling-yarn_lengths-128-4096-1a2b3c, at most
    TAG_CHARS long (a longer one keeps its start and a hash of the whole)."""
    return summary(((key.removeprefix("eval."), override_text(value))
                    for key, value in changes.items()), limit=TAG_CHARS)


def change_label(changes: Dict[str, Any]) -> str:
    """What a re-score changed, for people: rope_scaling=yarn, lengths=[128,4096]."""
    return ", ".join(f"{key.removeprefix('eval.')}={override_text(value)}"
                     for key, value in changes.items())


def rescore_name(tag: str) -> str:
    return f"results.eval-{tag}.json"


@contextmanager
def output_to(path: Path):
    """This process's stdout and stderr (prints, progress lines) into the file `path`."""
    with open(path, "w") as out, redirect_stdout(out), redirect_stderr(out):
        yield


def reevaluate(cfg: DictConfig, run_dir: Path, trained: Optional[dict] = None,
               quiet: bool = False) -> Optional[dict]:
    """Scores run_dir's checkpoint with cfg's eval keys into results.eval-<tag>.json; returns its
    record, or None when there was nothing to do (nothing changed, or that re-score exists).
    `trained`: the run's results.json when the caller has read it already. quiet (a folder's
    runs re-scored): one line here, the re-score's own output in output.eval-<tag>.log, so that
    many re-scores do not bury each other's tables."""
    run_dir = Path(run_dir)
    trained = trained or finished_results(run_dir)
    config = to_container(cfg)
    changes = eval_changes(trained["config"], config)
    if not changes:
        print(f"posbench: skipped {run_dir}: no eval key differs from the run's own, whose "
              "results.json holds this evaluation")
        return None
    tag, label = change_tag(changes), change_label(changes)
    name = rescore_name(tag)
    if (run_dir / name).exists():
        try:
            done = load_results(run_dir / name)
        except (OSError, ValueError) as err:
            raise ConfigError(f"{run_dir / name} is unreadable ({err}); expected a re-score "
                              "written by posbench: delete it to score again") from None
        if not eval_changes(done["config"], config):
            print(f"posbench: skipped {run_dir}: {name} already holds this re-score ({label})")
            return None
        key, value = next(iter(eval_changes(done["config"], config).items()))
        raise ConfigError(f"{key}={override_text(value)} is not accepted: {run_dir / name} holds "
                          f"a re-score with {key}={override_text(_scored_with(done['config'])[key])}"
                          "; expected those eval values, or delete that file to score again "
                          "(nothing was overwritten)")
    if quiet:
        output = run_dir / OUTPUT.format(tag)
        print(f"posbench: re-scoring {run_dir} ({label}); its output: {output.name}", flush=True)
    with output_to(output) if quiet else nullcontext():
        device, data, planned = prepare_run(cfg)
        loaded = trained_model(run_dir, device)
        loaded.require_corpus(data)
        model = loaded.model
        scores = evaluations.run(planned, model, device)
        curve = scores["curve"]
        record = results_record(cfg, model, data, curve, train=trained["train"], sections=scores)
        record["evaluated_from"] = str(run_dir / CHECKPOINT)
        record["rescore"] = {"tag": tag, "label": label, "changes": changes}
        write_results(run_dir, record, name=name, original=trained)
        logger = make_logger(cfg, run_dir, f"{run_dir.name}.eval-{tag}", run_group(run_dir),
                             config, resuming=False, job_type="eval")
        logger.log_curve(curve, step=0, per_length=length_metrics(record))
        logger.finish({**summary_metrics(record), "rescore": label})
        print_curve(record)
        print(f"wrote {run_dir / name}")
    return record


def summary_lines(rescored: List[Tuple[Path, dict]], skipped: int, refused: int,
                  folder: Path) -> List[str]:
    """What `posbench eval` over a folder did, in one table: each re-score (run dir, its
    record) with its perplexity at the run's training length and at its longest length."""
    lines = [f"posbench eval: {len(rescored)} re-score{'s' * (len(rescored) != 1)} written, "
             f"{skipped} skipped" + (f", {refused} refused" if refused else "")
             + (f"; each one's table is in its run dir's {OUTPUT.format('<tag>')}"
                if rescored else "")]
    if not rescored:
        return lines

    def at(curve: Dict[int, dict], n: int) -> str:
        point = curve.get(n)
        if point is None:
            return "—"
        return f"{point['ppl']:.2f} at {n}" if "ppl" in point else f"{point['status']} at {n}"

    rows = [("run", "re-score", "ppl at training length", "ppl at longest length")]
    for run_dir, record in rescored:
        label = record["rescore"]["label"]
        label = label if len(label) <= LABEL_CHARS else label[:LABEL_CHARS - 1] + "…"
        curve = {p["length"]: p for p in record["eval"]["curve"]}
        rows.append((str(run_dir.relative_to(folder)), label,
                     at(curve, record["train"]["seq_len"]), at(curve, max(curve))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return lines + ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths))
                    .rstrip() for row in rows]
