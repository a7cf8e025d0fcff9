"""A run's lifecycle in its run dir, in one place: the skip or resume decision, the plan, training
and evaluation, the failure record, and loading the trained model afterwards.

One start of a run (`posbench train`, a sweep's job, `train()` from Python) goes:
1. RunDir(cfg, run_dir) reads results.json, once: `finished` holds it when it records this run
   with status ok (and train.resume is true), so there is nothing to train; results of another
   config are refused, never mistaken for this run's.
2. RunDir.plan() takes run.lock (on rank 0; a second process is refused while the owner lives,
   a killed owner's lock is taken over), refuses a used run dir under train.resume=false and a
   results.json that another process wrote since step 1, checks the config against the data
   (every training and evaluation window), builds the model and, when checkpoint.pt is there,
   loads it after refusing one of another version, config or corpus. It writes nothing but the
   lock, which it releases when it refuses.
3. train() trains from the checkpoint's step (posbench/runs/train.py: fit), evaluates, and writes
   results.json last. On CPU a resumed run ends bit for bit where an uninterrupted one would
   have. A run that fails once started writes results.json with status failed (interrupted, for
   Ctrl-C) and the reason, and keeps its last good checkpoint, from which the next start
   resumes; it raises RunFailed (Interrupted). The lock is released at the end.
A finished run's model is loaded by trained_model (`posbench eval`, `posbench inspect`) and
load_run (Python).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf

from posbench.runs import distributed
from posbench.runs.checkpoint import CHECKPOINT, Checkpoint
from posbench.config import flatten, to_container, with_defaults
from posbench import evaluations
from posbench.data import Data, prepare
from posbench.core.device import resolve_device
from posbench.core.errors import CheckpointError, ConfigError, one_line
from posbench.evaluations import Evaluation
from posbench.evaluations import retrieval, ruler
from posbench.evaluations.base import planting
from posbench.core.io import FileLock, LockHeld, write_json
from posbench.runs.budget import Budget, require_same_device
from posbench.runs.budget import plan as plan_budget
from posbench.runs.loggers import NoLogger, make_logger
from posbench.model.transformer import build_model
from posbench.runs.results import (RESULTS, length_metrics, load_results, print_curve,
                                   results_record, summary_metrics, write_results)
from posbench.runs.train import Progress, fit, training_options
from posbench.runs.trainlog import Validation
from posbench.core.version import __version__

# config keys that change neither the weights nor the training loss: they may differ on resume
RESUME_FREE = ("eval.", "logger.", "train.resume", "train.ckpt_every", "dataset.cache_dir")
LOCK = "run.lock"  # held by the one process that runs the run dir


class RunFailed(Exception):
    """The run started but did not finish; its results.json says status failed and why."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a started run, after its results.json recorded where it stopped."""


def read_results(run_dir: Path) -> Optional[dict]:
    path = Path(run_dir) / RESULTS
    if not path.exists():
        return None
    try:
        return load_results(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} is unreadable ({err}); expected a results.json written by "
                          "posbench: delete it to run again") from None


def finished_results(run_dir: Path) -> dict:
    """The run's results.json, refused unless the run finished (status ok)."""
    if not Path(run_dir).is_dir():
        raise ConfigError(f"run dir {str(run_dir)!r} does not exist; expected a finished run dir")
    record = read_results(run_dir)
    if record is None or record.get("status") != "ok":
        status = "none" if record is None else record.get("status")
        raise ConfigError(f"run dir {str(run_dir)!r} holds no finished results.json (status "
                          f"{status}); expected a run that finished: `posbench train` with its "
                          "config resumes it")
    return record


def config_changes(saved: dict, cfg: DictConfig) -> list:
    """(key, saved value, new value) for every key outside RESUME_FREE that differs."""
    old, new = flatten(to_container(with_defaults(saved))), flatten(to_container(cfg))
    keys = list(new) + [k for k in old if k not in new]
    return [(k, old.get(k, "<absent>"), new.get(k, "<absent>")) for k in keys
            if not k.startswith(RESUME_FREE) and old.get(k, "<absent>") != new.get(k, "<absent>")]


def require_same_run(cfg: DictConfig, saved: dict, path: Path) -> None:
    changes = config_changes(saved, cfg)
    if changes:
        key, old, new = changes[0]
        others = [k for k, _, _ in changes[1:]]
        more = f" (also {', '.join(others)})" if others else ""
        raise ConfigError(f"{key}={new!r} is not accepted: run dir {str(path.parent)!r} already "
                          f"holds {path.name} of a run with {key}={old!r}{more}; expected that "
                          "config (only eval.* and logger.* may differ) or a new run dir "
                          "(nothing was overwritten)")


def require_same_corpus(trained_on: str, path: Path, data: Data, expected: str) -> None:
    """Refuses data other than the corpus (fingerprint `trained_on`) that `path` was trained on."""
    if trained_on != data.fingerprint:
        raise ConfigError(f"dataset {data.name} now has fingerprint {data.fingerprint}; {path} was "
                          f"trained on {trained_on}; expected {expected}")


def lock_run_dir(run_dir: Path) -> FileLock:
    """The run dir's lock, so that two processes (a sweep started twice, a requeued job beside
    its old self) never train one run dir at once and race on its checkpoint."""
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock = FileLock(run_dir / LOCK)
    except LockHeld as owner:
        raise ConfigError(f"run dir {str(run_dir)!r} is not accepted: {owner} is running it "
                          f"(its {LOCK}); expected one process per run dir: wait for that one to "
                          "end, or stop it (nothing was overwritten)") from None
    if lock.stale_owner:
        print(f"posbench: took over the stale lock of run dir {str(run_dir)!r}: "
              f"{lock.stale_owner} is gone", flush=True)
    return lock


def prepare_run(cfg: DictConfig):
    """The device, the data and the planned evaluations (posbench/evaluations/), after refusing
    what the config asks of them that they cannot give: a batch that does not split over the
    processes, windows the data does not hold."""
    device = distributed.setup(resolve_device(cfg.device))
    if cfg.train.batch_size % distributed.world_size():
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} is not accepted with "
                          f"{distributed.world_size()} processes; expected a multiple of it")
    data = prepare(cfg.dataset)
    data.check_train_len(cfg.train.seq_len, cfg.train.get("pack_documents", False))
    return device, data, evaluations.plan(cfg, data, load_trained=trained_model)


@dataclass
class Start:
    """A run whose config and run dir were accepted, before anything but its lock is written."""
    device: torch.device
    data: Data
    model: torch.nn.Module
    checkpoint: Optional[Checkpoint]  # to resume from; None: step 0
    lock: Optional[FileLock]  # the run dir's, held until the run ends; None on ranks > 0
    evaluations: List[Evaluation]  # planned, run after training
    plant: Optional[Callable] = None  # train_batch's, for train.retrieval_mix and ruler_mix
    validation: Optional[Validation] = None  # every train.val_every steps, on rank 0
    budget: Optional[Budget] = None  # how long it trains (train.budget)

    def release(self) -> None:
        if self.lock:
            self.lock.release()


def _stat(path: Path):
    """What changes when a file is written (atomically: a new inode) or appears."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class RunDir:
    """One start of a run in its run dir: what the dir holds, read once, and the decision."""

    def __init__(self, cfg: DictConfig, run_dir: Path):
        self.cfg, self.path = cfg, Path(run_dir)
        self._seen = _stat(self.path / RESULTS)
        record = read_results(self.path)
        # this run's results with status ok: nothing to train (another config's are refused)
        self.finished: Optional[dict] = None
        if cfg.train.resume and record is not None and record.get("status") == "ok":
            require_same_run(cfg, record["config"], self.path / RESULTS)
            self.finished = record

    def plan(self) -> Start:
        """Takes the run dir's lock (on rank 0), checks the config against the data and the run
        dir, and builds the model, from its checkpoint when there is one. Writes nothing but the
        lock, which it releases when it refuses."""
        cfg, run_dir = self.cfg, self.path
        lock = lock_run_dir(run_dir) if distributed.is_main() else None
        try:
            # the run dir first: refusing it costs nothing, preparing the data may tokenize
            held = [p.name for p in (run_dir / RESULTS, run_dir / CHECKPOINT) if p.exists()]
            if held and not cfg.train.resume:
                raise ConfigError(f"train.resume=false is not accepted: run dir {str(run_dir)!r} "
                                  f"holds {' and '.join(held)}; expected train.resume=true to "
                                  "continue that run, or a new run dir (nothing was overwritten)")
            if self.finished is not None:
                raise ConfigError(f"run dir {str(run_dir)!r} already holds results.json (status "
                                  "ok); expected a new run dir (nothing was overwritten)")
            if _stat(run_dir / RESULTS) != self._seen:
                raise ConfigError(f"run dir {str(run_dir)!r} is not accepted: another process "
                                  "wrote its results.json while this one started; expected one "
                                  "process per run dir (nothing was overwritten)")
            device, data, planned = prepare_run(cfg)
            plant = planting(retrieval.training_mix(cfg, data), ruler.training_mix(cfg, data))
            t = cfg.train
            # before the first step: data too short for its windows is refused, not a failed run
            validation = (Validation(data, t.seq_len, t.batch_size, device, training_options(t))
                          if distributed.is_main() and t.val_every else None)
            torch.manual_seed(cfg.seed)
            model = build_model(cfg, data.vocab_size)
            budget = plan_budget(cfg)
            checkpoint = None
            if (run_dir / CHECKPOINT).exists():
                checkpoint = Checkpoint.load(run_dir / CHECKPOINT)
                check_resumable(cfg, checkpoint, run_dir / CHECKPOINT, data, model)
                require_same_device(budget, checkpoint.device, device)
            elif cfg.train.get("init_from"):
                initial_weights(Path(cfg.train.init_from), data, model)
            return Start(device, data, model.to(device), checkpoint, lock, planned, plant,
                         validation, budget)
        except BaseException:
            if lock:
                lock.release()
            raise


def initial_weights(parent: Path, data: Data, model) -> None:
    """train.init_from: loads the weights of a finished run (an extension's parent,
    posbench/runs/extend.py), refused in one line when it did not finish, was trained on other data
    or holds another model."""
    finished_results(parent)
    path = parent / CHECKPOINT
    checkpoint = Checkpoint.load(path)
    require_same_corpus(checkpoint.dataset, path, data, "the corpus it was trained on")
    try:
        model.load_state_dict(checkpoint.model)
    except RuntimeError as err:  # e.g. a learned table sized by other lengths
        raise ConfigError(f"train.init_from={str(parent)!r} is not accepted: its weights do not "
                          f"fit this model ({' '.join(str(err).split())[:200]}); expected a run "
                          "of the same model and encoding") from None


def check_resumable(cfg: DictConfig, checkpoint: Checkpoint, path: Path, data: Data,
                    model) -> None:
    """Refuses a checkpoint of another version, config or corpus; loads its weights."""
    if checkpoint.version != __version__:
        raise CheckpointError(f"run dir {str(path.parent)!r} holds {path.name} of posbench "
                              f"{checkpoint.version}; expected one of posbench "
                              f"{__version__} to resume, or a new run dir (nothing was "
                              "overwritten)")
    require_same_run(cfg, checkpoint.config, path)
    require_same_corpus(checkpoint.dataset, path, data, "the same corpus to resume, or a new run "
                        "dir (nothing was overwritten)")
    try:
        model.load_state_dict(checkpoint.model)
    except RuntimeError as err:  # eval.lengths can size a learned table
        new = flatten(to_container(cfg))
        saved = ", ".join(f"{k}={v!r}" for k, v in flatten(checkpoint.config).items()
                          if k.startswith("eval.") and new.get(k) != v)
        raise ConfigError(f"{path} does not fit the model of this config ("
                          f"{' '.join(str(err).split())[:200]}); expected the eval values it was "
                          f"trained with: {saved}") from None


def record_failure(cfg: DictConfig, start: Start, run_dir: Path, progress: Progress,
                   err: BaseException, again: str = "starting the run again") -> RunFailed:
    """Writes results.json with status failed (interrupted, for Ctrl-C) and the reason; the
    failure in one line, which says that `again` (the command that resumes) resumes it."""
    t, steps = cfg.train, start.budget.steps
    reason = one_line(err)
    status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
    if steps is None:  # a wallclock budget: the clock ends training, not a step count
        where = f"after step {progress.step}"
    else:
        where = (f"at step {progress.step + 1} of {steps}" if progress.step < steps
                 else "after training")
    record = results_record(cfg, start.model, start.data, [], status=status, error=reason,
                            train={"seq_len": t.seq_len, "steps": steps,
                                   "steps_done": progress.step, "last_loss": progress.last_loss,
                                   "checkpoint_step": progress.saved_step,
                                   "resumed_from_step": progress.first})
    kept = (f"its checkpoint at step {progress.saved_step} is kept: {again} resumes from it"
            if progress.saved_step is not None else "no checkpoint was saved")
    try:
        if distributed.is_main():
            write_json(run_dir / RESULTS, record)
    except OSError as write_err:
        kept += f"; results.json could not be written either ({one_line(write_err)})"
    return RunFailed(f"run {str(run_dir)!r} {'stopped' if status == 'interrupted' else 'failed'} "
                     f"{where}: {reason}; {kept}")


def train(cfg: DictConfig, run_dir: Path, group: str, name: str,
          start: Optional[Start] = None, again: str = "starting the run again") -> Optional[dict]:
    """Trains (or resumes) the run in `run_dir`, evaluates it and writes its results; raises
    RunFailed after recording a failure in results.json (whose line names `again`, what
    resumes it). Under torchrun only rank 0 writes and evaluates; the other ranks return None
    after training. Releases the run dir's lock."""
    run_dir = Path(run_dir)
    start = start or RunDir(cfg, run_dir).plan()
    try:
        return run_started(cfg, run_dir, group, name, start, again)
    finally:
        start.release()


def run_started(cfg: DictConfig, run_dir: Path, group: str, name: str, start: Start,
                again: str) -> Optional[dict]:
    """train() once its run dir is planned (and locked)."""
    main = distributed.is_main()
    for tmp in run_dir.glob(f".{CHECKPOINT}.*"):  # a checkpoint write cut short by a kill
        if main:
            tmp.unlink()
    logger = (make_logger(cfg, run_dir, name, group, to_container(cfg),
                          start.checkpoint is not None) if main else NoLogger())
    progress = Progress()
    if start.checkpoint:
        progress.first = progress.step = progress.saved_step = start.checkpoint.step
    try:
        summary, scores = fit(cfg, start, run_dir, logger, progress)
        if not main:
            return None
        scores = scores or evaluations.run(start.evaluations, start.model, start.device)
        record = results_record(cfg, start.model, start.data, scores["curve"], train=summary,
                                sections=scores)
        write_results(run_dir, record)
    except Exception as err:  # noqa: BLE001 - any failure of a started run is recorded
        raise record_failure(cfg, start, run_dir, progress, err, again) from err
    except KeyboardInterrupt as err:  # recorded like a failure, but it stops a sweep too
        raise Interrupted(str(record_failure(cfg, start, run_dir, progress, err, again))) from None
    # after every training row
    logger.log_curve(scores["curve"], step=summary["steps"] + 1, per_length=length_metrics(record))
    logger.finish({"final_loss": summary["final_loss"], **summary_metrics(record)})
    print_curve(record)
    return record


@dataclass
class Trained:
    """A run's trained model and what it was trained with."""
    model: torch.nn.Module  # in eval mode
    config: DictConfig  # the config it was trained with
    checkpoint: Path
    dataset: str  # fingerprint of the corpus it was trained on

    def require_corpus(self, data: Data) -> None:
        require_same_corpus(self.dataset, self.checkpoint, data, "the training corpus")


def trained_model(run_dir: Path, device="cpu") -> Trained:
    """The model of run_dir's checkpoint on `device`, in eval mode: the one loader of trained
    models, for `posbench eval`, `posbench inspect` and posbench.load_run."""
    path = Path(run_dir) / CHECKPOINT
    checkpoint = Checkpoint.load(path)
    config = OmegaConf.create(checkpoint.config)
    model = build_model(config, checkpoint.vocab_size)
    try:
        model.load_state_dict(checkpoint.model)
    except RuntimeError as err:  # a checkpoint of another posbench version's model
        raise ConfigError(f"{path} does not fit the model of its config "
                          f"({' '.join(str(err).split())[:200]}); expected a checkpoint of "
                          f"posbench {__version__}") from None
    return Trained(model.to(device).eval(), config, path, checkpoint.dataset)


@dataclass
class Run:
    """A finished run, as posbench.load_run reads it from its run dir."""
    model: torch.nn.Module  # the trained model, in eval mode
    config: DictConfig  # the config it was trained with
    results: dict  # its results.json
    run_dir: Path


def load_run(run_dir: Union[str, Path], device: Union[str, torch.device] = "cpu") -> Run:
    """The trained model of a finished run dir (`posbench train`'s hydra.run.dir, or a sweep's
    job dir) on `device`, with its config and results. Refused in one line: ConfigError for a
    run dir that holds no finished run, CheckpointError for a checkpoint that fails its digest."""
    run_dir = Path(run_dir)
    results = finished_results(run_dir)
    trained = trained_model(run_dir, device)
    return Run(trained.model, trained.config, results, run_dir)
