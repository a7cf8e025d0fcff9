"""Train at a short context, evaluate at long ones, write the run's results.

The run dir holds the run's state: checkpoint.pt every train.ckpt_every steps and at the end of
training, then results.json. Starting the same run again (same run dir, same config but for the
keys in RESUME_FREE) picks up what is there, and on CPU ends bit for bit where an uninterrupted run
would have:
- results.json with status ok: nothing to do (`finished`);
- checkpoint.pt: resume from it (model, optimizer, step, RNG states, the open loss window);
- neither: start at step 0.
A run that fails once started writes results.json with status failed and the reason, and keeps
its last good checkpoint, from which the next start resumes. A non-finite loss is such a failure:
on CPU it is caught at the step that made it; on CUDA, to spare a host sync per step, at the next
log step or checkpoint, always before the bad weights are saved, so the checkpoint kept is good.
One process at a time runs a run dir: it holds run.lock from plan_run to the end of train; a
second start is refused while the owner lives, and a killed owner's lock is taken over.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf

from posbench import distributed
from posbench.checkpoint import CHECKPOINT, load_checkpoint, save_checkpoint
from posbench.config import flatten, to_container
from posbench.errors import CheckpointError, ConfigError, one_line
from posbench.data import prepare
from posbench.data.tasks import IGNORE
from posbench.data.tokens import TokenData
from posbench.data.windows import check_train_len, eval_plan, train_batch
from posbench.evaluate import evaluate, with_train_length
from posbench.io import FileLock, LockHeld, write_json
from posbench.loggers import NoLogger, make_logger
from posbench.model import build_model
from posbench.progress import Bar
from posbench.results import RESULTS, load_results, print_curve, results_record, write_results
from posbench.trainlog import LOSS_PLOT, METRICS, MetricsLog, Validation, plot_losses
from posbench.retrieval import Passkeys, evaluate_retrieval, mixer, plan_passkeys
from posbench.version import __version__

# config keys that change neither the weights nor the training loss: they may differ on resume
RESUME_FREE = ("eval.", "logger.", "train.resume", "train.ckpt_every", "dataset.cache_dir")
LOCK = "run.lock"  # held by the one process that runs the run dir


class RunFailed(Exception):
    """The run started but did not finish; its results.json says status failed and why."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a started run, after its results.json recorded where it stopped."""


@dataclass
class Start:
    """A run whose config and run dir were accepted, before anything but its lock is written."""
    device: torch.device
    data: TokenData
    model: torch.nn.Module
    state: Optional[dict]  # the checkpoint to resume from; None: step 0
    lock: Optional[FileLock]  # the run dir's, held until the run ends; None on ranks > 0
    passkeys: Optional[Passkeys] = None  # when the run plants or asks passkeys

    def release(self) -> None:
        if self.lock:
            self.lock.release()


@dataclass
class Progress:
    """What a failure report needs, kept current by the training loop."""
    first: int = 0  # step this session started from
    step: int = 0  # steps done
    saved_step: Optional[int] = None  # step of the checkpoint on disk
    last_loss: Optional[float] = None  # last finite per-step training loss


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' is not accepted: no CUDA device is visible; expected "
                          "device=cpu or device=auto")
    return torch.device(name)


def lr_at(step: int, cfg) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, cfg, device):
    """AdamW in three groups: weight matrices with weight decay; gains and biases without; the
    encoding's parameters (position tables, bias tables, slopes, generators) without weight
    decay, as their references train them (minGPT's position table, T5's Adafactor), and at
    train.position_lr_mult times the learning rate (docs/encodings.md, "Training defaults")."""
    encoding = getattr(model, "encoding", None)  # the peers in scripts/bench.py have none
    position = list(encoding.parameters()) if encoding is not None else []
    own = {id(p) for p in position}
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in own]
    no_decay = [p for p in model.parameters() if p.dim() < 2 and id(p) not in own]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0},
              {"params": position, "weight_decay": 0.0, "lr_mult": cfg.position_lr_mult}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def prepare_run(cfg: DictConfig):
    """Everything in the config that can be refused before any training."""
    device = distributed.setup(resolve_device(cfg.device))
    if cfg.train.batch_size % distributed.world_size():
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} is not accepted with "
                          f"{distributed.world_size()} processes; expected a multiple of it")
    data = prepare(cfg.dataset)
    check_train_len(data, cfg.train.seq_len)
    eval_cfg = with_train_length(cfg.eval, cfg.train.seq_len)
    for length in eval_cfg.lengths:
        eval_plan(data, length, eval_cfg)
    return device, data


def config_changes(saved: dict, cfg: DictConfig) -> list:
    """(key, saved value, new value) for every key outside RESUME_FREE that differs."""
    old, new = flatten(saved), flatten(to_container(cfg))
    keys = list(new) + [k for k in old if k not in new]
    return [(k, old.get(k, "<absent>"), new.get(k, "<absent>")) for k in keys
            if not k.startswith(RESUME_FREE) and old.get(k, "<absent>") != new.get(k, "<absent>")]


def require_same_run(cfg: DictConfig, saved: dict, path: Path) -> None:
    changes = config_changes(saved, cfg)
    if changes:
        key, old, new = changes[0]
        more = f" (and {len(changes) - 1} more keys)" if len(changes) > 1 else ""
        raise ConfigError(f"{key}={new!r} is not accepted: run dir {str(path.parent)!r} already "
                          f"holds {path.name} of a run with {key}={old!r}{more}; expected that "
                          "config (only eval.* and logger.* may differ) or a new run dir "
                          "(nothing was overwritten)")


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
    record = read_results(run_dir)
    if record is None or record.get("status") != "ok":
        status = "none" if record is None else record.get("status")
        raise ConfigError(f"run dir {str(run_dir)!r} holds no finished results.json (status "
                          f"{status}); expected a run that finished: `posbench train` with its "
                          "config resumes it")
    return record


def finished(cfg: DictConfig, run_dir: Path) -> bool:
    """Whether the run dir holds this run's results with status ok, so there is nothing to do.
    Another config's results are refused, never mistaken for this run's."""
    record = read_results(run_dir)
    if not cfg.train.resume or record is None or record.get("status") != "ok":
        return False
    require_same_run(cfg, record["config"], Path(run_dir) / RESULTS)
    return True


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


def plan_run(cfg: DictConfig, run_dir: Path) -> Start:
    """Takes the run dir's lock (on rank 0), checks the config against the data and the run dir,
    and builds the model, from its checkpoint when there is one. Writes nothing but the lock,
    which it releases when it refuses."""
    run_dir = Path(run_dir)
    lock = lock_run_dir(run_dir) if distributed.is_main() else None
    try:
        # the run dir first: refusing it costs nothing, preparing the data may tokenize a corpus
        held = [p.name for p in (run_dir / RESULTS, run_dir / CHECKPOINT) if p.exists()]
        if held and not cfg.train.resume:
            raise ConfigError(f"train.resume=false is not accepted: run dir {str(run_dir)!r} "
                              f"holds {' and '.join(held)}; expected train.resume=true to "
                              "continue that run, or a new run dir (nothing was overwritten)")
        if finished(cfg, run_dir):
            raise ConfigError(f"run dir {str(run_dir)!r} already holds results.json (status ok); "
                              "expected a new run dir (nothing was overwritten)")
        device, data = prepare_run(cfg)
        passkeys = plan_passkeys(cfg, data)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, data.vocab_size)
        state = None
        if (run_dir / CHECKPOINT).exists():
            state = load_checkpoint(run_dir / CHECKPOINT)
            check_resumable(cfg, state, run_dir / CHECKPOINT, data, model)
        return Start(device, data, model.to(device), state, lock, passkeys)
    except BaseException:
        if lock:
            lock.release()
        raise


def check_resumable(cfg: DictConfig, state: dict, path: Path, data: TokenData, model) -> None:
    """Refuses a checkpoint of another version, config or corpus; loads its weights."""
    if state["posbench"] != __version__:
        raise CheckpointError(f"run dir {str(path.parent)!r} holds {path.name} of posbench "
                              f"{state['posbench']}; expected one of posbench "
                              f"{__version__} to resume, or a new run dir (nothing was "
                              "overwritten)")
    require_same_run(cfg, state["config"], path)
    require_same_corpus(state["dataset"], path, data, "the same corpus to resume, or a new run "
                        "dir (nothing was overwritten)")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:  # eval.lengths can size a learned table
        new = flatten(to_container(cfg))
        saved = ", ".join(f"{k}={v!r}" for k, v in flatten(state["config"]).items()
                          if k.startswith("eval.") and new.get(k) != v)
        raise ConfigError(f"{path} does not fit the model of this config ("
                          f"{' '.join(str(err).split())[:200]}); expected the eval values it was "
                          f"trained with: {saved}") from None


def require_same_corpus(trained_on: str, path: Path, data: TokenData, expected: str) -> None:
    """Refuses data other than the corpus (fingerprint `trained_on`) that `path` was trained on."""
    if trained_on != data.fingerprint:
        raise ConfigError(f"dataset {data.name} now has fingerprint {data.fingerprint}; {path} was "
                          f"trained on {trained_on}; expected {expected}")


@dataclass
class Trained:
    """A run's trained model and what it was trained with."""
    model: torch.nn.Module  # in eval mode
    config: DictConfig  # the config it was trained with
    checkpoint: Path
    dataset: str  # fingerprint of the corpus it was trained on

    def require_corpus(self, data: TokenData) -> None:
        require_same_corpus(self.dataset, self.checkpoint, data, "the training corpus")


def trained_model(run_dir: Path, device="cpu") -> Trained:
    """The model of run_dir's checkpoint on `device`, in eval mode: the one loader of trained
    models, for `posbench eval`, `posbench inspect` and posbench.load_run."""
    path = Path(run_dir) / CHECKPOINT
    state = load_checkpoint(path)
    config = OmegaConf.create(state["config"])
    model = build_model(config, state["vocab_size"])
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:  # a checkpoint of another posbench version's model
        raise ConfigError(f"{path} does not fit the model of its config "
                          f"({' '.join(str(err).split())[:200]}); expected a checkpoint of "
                          f"posbench {__version__}") from None
    return Trained(model.to(device).eval(), config, path, state["dataset"])


def rng_state(device: torch.device) -> dict:
    # numpy and python RNGs are not used: batches come from a generator seeded by (seed, step)
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def check_finite(losses: torch.Tensor, first_step: int, last_good: Optional[float]) -> float:
    """The last of `losses` (the losses of steps first_step+1, ...), or FloatingPointError naming
    the first non-finite one and the loss before it."""
    bad = (~torch.isfinite(losses)).nonzero()
    if len(bad):
        i = int(bad[0])
        good = float(losses[i - 1]) if i else last_good
        raise FloatingPointError(f"non-finite training loss {float(losses[i])} at step "
                                 f"{first_step + i + 1}; last good loss "
                                 + (f"{good:.4f}" if good is not None else "none"))
    return float(losses[-1])


def fit(cfg: DictConfig, start: Start, run_dir: Path, logger, progress: Progress) -> dict:
    """Trains from the start's step to train.steps; returns the `train` part of results.json."""
    t, device, model, data = cfg.train, start.device, start.model, start.data
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    optimizer = make_optimizer(model, t, device)
    net = distributed.wrap(model, device)
    step_fn = torch.compile(net) if t.compile else net
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else nullcontext())
    # per-step losses of the open log window, kept on device (no host sync per step on CUDA);
    # final_loss is the mean of the last window, so the open window is part of the checkpoint
    losses = torch.zeros(t.log_every, device=device)
    n, final_loss, seconds = 0, float("nan"), 0.0
    if start.state:
        state = start.state
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"], device)
        n = len(state["window"])
        losses[:n] = state["window"].to(device)
        final_loss, seconds, progress.last_loss = (state["final_loss"], state["seconds"],
                                                   state["last_loss"])
    first = progress.first
    tokens_per_step = t.batch_size * t.seq_len
    main = distributed.is_main()
    metrics = MetricsLog(run_dir / METRICS, first) if main else None
    validation = (Validation(data, t.seq_len, t.batch_size, device, autocast)
                  if main and t.val_every else None)
    plant = mixer(start.passkeys, t.get("retrieval_mix", 0.0))
    session = time.perf_counter()

    def elapsed() -> float:
        return seconds + time.perf_counter() - session

    model.train()
    bar = Bar(f"train {cfg.encoding.name}", t.steps, "step", initial=first,
              enabled=distributed.is_main())
    for step in range(first, t.steps):
        lr = lr_at(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        x, y = (distributed.shard(z).to(device, non_blocking=True) for z in
                train_batch(data, t.seq_len, t.batch_size, cfg.seed, step, plant))
        with autocast:
            # mean over trained targets (tasks mark the others IGNORE; text trains on all)
            loss = step_fn(x, targets=y).sum() / (y != IGNORE).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        losses[n] = distributed.mean(loss.detach())  # the global batch's loss on every rank
        n += 1
        done = step + 1
        bar.update()
        log = n == t.log_every or done == t.steps
        save = done == t.steps or (t.ckpt_every > 0 and done % t.ckpt_every == 0)
        if device.type == "cpu" or log or save:
            progress.last_loss = check_finite(losses[:n], done - n, progress.last_loss)
        row = {}
        if log:
            final_loss = losses[:n].mean().item()
            n = 0
            tps = tokens_per_step * (done - first) / (time.perf_counter() - session)
            row = {"loss": final_loss, "lr": lr, "tokens_per_second": tps}
        if validation is not None and done % t.val_every == 0:
            row["val_loss"] = validation(model)
        if row:
            bar.log(**{key: f"{row[key]:.3f}" for key in ("loss", "val_loss") if key in row},
                    **({"lr": f"{lr:.2e}", "tok_s": f"{tps:.0f}"} if log else {}))
            if main:
                metrics.append(done, **row)
            logger.log({"train/step": done, **{f"train/{key}": value
                                               for key, value in row.items()}}, step=done)
        if save and distributed.is_main():
            save_checkpoint(run_dir / CHECKPOINT, {
                "posbench": __version__, "config": to_container(cfg),
                "dataset": data.fingerprint, "vocab_size": data.vocab_size, "step": done,
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": rng_state(device), "window": losses[:n].cpu(), "final_loss": final_loss,
                "last_loss": progress.last_loss, "seconds": elapsed()})
            progress.saved_step = done
        progress.step = done
    bar.close()
    if main:
        plot_losses(run_dir / METRICS, run_dir / LOSS_PLOT,
                    f"{cfg.encoding.name} (seed {cfg.seed}), trained at {t.seq_len}")
    wall = elapsed()
    return {"seq_len": t.seq_len, "steps": t.steps, "tokens": tokens_per_step * t.steps,
            "final_loss": final_loss, "tokens_per_second": tokens_per_step * t.steps / wall,
            "wall_seconds": wall, "resumed_from_step": first}


def record_failure(cfg: DictConfig, start: Start, run_dir: Path, progress: Progress,
                   err: BaseException) -> RunFailed:
    """Writes results.json with status failed (interrupted, for Ctrl-C) and the reason; the
    failure in one line."""
    t = cfg.train
    reason = one_line(err)
    status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
    where = (f"at step {progress.step + 1} of {t.steps}" if progress.step < t.steps
             else "after training")
    record = results_record(cfg, start.model, start.data, [], status=status, error=reason,
                            train={"seq_len": t.seq_len, "steps": t.steps,
                                   "steps_done": progress.step, "last_loss": progress.last_loss,
                                   "checkpoint_step": progress.saved_step,
                                   "resumed_from_step": progress.first})
    kept = (f"its checkpoint at step {progress.saved_step} is kept: starting the run again "
            "resumes from it" if progress.saved_step is not None else "no checkpoint was saved")
    try:
        if distributed.is_main():
            write_json(run_dir / RESULTS, record)
    except OSError as write_err:
        kept += f"; results.json could not be written either ({one_line(write_err)})"
    return RunFailed(f"run {str(run_dir)!r} {'stopped' if status == 'interrupted' else 'failed'} "
                     f"{where}: {reason}; {kept}")


def train(cfg: DictConfig, run_dir: Path, group: str, name: str,
          start: Optional[Start] = None) -> Optional[dict]:
    """Trains (or resumes) the run in `run_dir`, evaluates it and writes its results; raises
    RunFailed after recording a failure in results.json. Under torchrun only rank 0 writes and
    evaluates; the other ranks return None after training. Releases the run dir's lock."""
    run_dir = Path(run_dir)
    start = start or plan_run(cfg, run_dir)
    try:
        return run_started(cfg, run_dir, group, name, start)
    finally:
        start.release()


def run_started(cfg: DictConfig, run_dir: Path, group: str, name: str,
                start: Start) -> Optional[dict]:
    """train() once its run dir is planned (and locked)."""
    main = distributed.is_main()
    for tmp in run_dir.glob(f".{CHECKPOINT}.*"):  # a checkpoint write cut short by a kill
        if main:
            tmp.unlink()
    logger = (make_logger(cfg, run_dir, name, group, to_container(cfg), start.state is not None)
              if main else NoLogger())
    progress = Progress()
    if start.state:
        progress.first = progress.step = progress.saved_step = start.state["step"]
    try:
        summary = fit(cfg, start, run_dir, logger, progress)
        if not main:
            return None
        curve = evaluate(start.model, start.data, cfg.eval, start.device, cfg.train.seq_len)
        retrieval = (evaluate_retrieval(start.model, start.passkeys, cfg.eval, cfg.train.seq_len,
                                        start.device)
                     if cfg.eval.retrieval.enabled else None)
        record = results_record(cfg, start.model, start.data, curve, train=summary,
                                retrieval=retrieval)
        write_results(run_dir, record)
    except Exception as err:  # noqa: BLE001 - any failure of a started run is recorded
        raise record_failure(cfg, start, run_dir, progress, err) from err
    except KeyboardInterrupt as err:  # recorded like a failure, but it stops a sweep too
        raise Interrupted(str(record_failure(cfg, start, run_dir, progress, err))) from None
    logger.log_curve(curve, step=cfg.train.steps + 1)  # after every training row
    logger.finish({"final_loss": summary["final_loss"],
                   "train_len_ppl": record["eval"]["train_len_ppl"],
                   **{f"effective_length/{k}": v
                      for k, v in record["eval"]["effective_length"].items()}})
    print_curve(record)
    return record


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
