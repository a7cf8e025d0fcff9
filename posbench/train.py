"""Train at a short context, evaluate at long ones, write the run's results."""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm import tqdm

import posbench
from posbench.config import ConfigError, to_container
from posbench.data import prepare
from posbench.data.windows import check_train_len, eval_windows, train_batch
from posbench.evaluate import evaluate
from posbench.io import atomic_path
from posbench.loggers import make_logger
from posbench.results import print_curve, results_record, write_results


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
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def prepare_run(cfg: DictConfig):
    """Everything that can reject the config, done before any training."""
    device = resolve_device(cfg.device)
    data = prepare(cfg.dataset)
    check_train_len(data, cfg.train.seq_len)
    for length in cfg.eval.lengths:
        eval_windows(data, length, cfg.eval.tokens)
    return device, data


def train(cfg: DictConfig, run_dir: Path, group: str, name: str) -> dict:
    run_dir = Path(run_dir)
    if (run_dir / "results.json").exists():
        raise ConfigError(f"hydra.run.dir={str(run_dir)!r} already holds results.json; expected "
                          "a new run dir (nothing was overwritten)")
    device, data = prepare_run(cfg)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model = posbench.build_model(cfg, data.vocab_size).to(device)
    optimizer = make_optimizer(model, cfg.train, device)
    step_fn = torch.compile(model.token_losses) if cfg.train.compile else model.token_losses
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else nullcontext())
    logger = make_logger(cfg, run_dir, name, group, to_container(cfg))

    t = cfg.train
    tokens_per_step = t.batch_size * t.seq_len
    window = torch.zeros((), device=device)  # loss summed on device: no host sync per step
    window_steps, final_loss = 0, float("nan")
    model.train()
    start = time.perf_counter()
    progress = tqdm(range(t.steps), desc=f"train {cfg.encoding.name}", unit="step")
    for step in progress:
        lr = lr_at(step, t)
        for group_ in optimizer.param_groups:
            group_["lr"] = lr
        x, y = (z.to(device, non_blocking=True) for z in
                train_batch(data, t.seq_len, t.batch_size, cfg.seed, step))
        with autocast:
            loss = step_fn(x, y).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        window += loss.detach()
        window_steps += 1
        if window_steps == t.log_every or step == t.steps - 1:
            final_loss = (window / window_steps).item()
            if not math.isfinite(final_loss):
                raise FloatingPointError(f"non-finite training loss at step {step}")
            elapsed = time.perf_counter() - start
            tps = tokens_per_step * (step + 1) / elapsed
            progress.set_postfix(loss=f"{final_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}")
            logger.log({"train/step": step + 1, "train/loss": final_loss, "train/lr": lr,
                        "train/tokens_per_second": tps})
            window.zero_()
            window_steps = 0
    wall = time.perf_counter() - start

    with atomic_path(run_dir / "checkpoint.pt") as tmp:
        torch.save({"model": model.state_dict(), "config": to_container(cfg),
                    "step": t.steps, "version": posbench.__version__}, tmp)

    curve = evaluate(model, data, cfg.eval, device)
    record = results_record(cfg, model, data, curve, train={
        "seq_len": t.seq_len, "steps": t.steps, "tokens": tokens_per_step * t.steps,
        "final_loss": final_loss, "tokens_per_second": tokens_per_step * t.steps / wall,
        "wall_seconds": wall})
    write_results(run_dir, record)
    logger.log_curve(curve)
    logger.finish({"final_loss": final_loss})
    print_curve(record)
    return record
