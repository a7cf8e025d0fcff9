"""What a job will cost, before it starts: tokens, FLOPs and peak memory, from the config alone.

The formulas (docs/design.md, "Estimates"), with B the batch per process, L the training length,
n an evaluation length, d = model.d_model, V the vocabulary, P the parameters:
- training FLOPs: 6·N·tokens + 6·n_layer·L·d·tokens (Kaplan et al. 2020: weights, then attention
  scores and their weighted sum, forward and backward; the scores' half over the q/k width, which
  model.decoupled_rope widens by n_head·d^R), N the parameters outside the encoding
  (its tables are looked up, not multiplied; the tied embedding counts once, as the output layer),
  plus 3 times the encoding's own forward FLOPs per step (PositionalEncoding.flops over the
  causal pairs L(L+1)/2), all for the run's steps (train.budget=flops sets them,
  posbench/runs/budget.py; under wallclock, train.steps);
- evaluation FLOPs: (2·N + 2·n_layer·n·d) per processed token, summed over the lengths;
- training memory: 16·P bytes (fp32 weights, gradients and AdamW's two moments), plus
  4·B·L·(28·n_layer·d + 4·V) bytes of activations kept for the backward pass, plus, for an
  encoding with a score hook, 4 blocks of attention scores in fp32 (posbench/attention/paths.py
  bounds a block), plus 0.5 GiB for the interpreter, torch and the corpus;
- evaluation memory at the longest length n: 4·P bytes, plus 4·b·n·(16·d + 2·V·min(1, 4096/n))
  bytes with b = max(1, eval.batch_tokens // n) windows per forward pass, plus 10 score blocks
  and the 0.5 GiB as above.
The constants were measured on CPU in fp32 (tiny model; RoPE, ALiBi and T5 up to 8192 tokens)
and round up; bf16 autocast on CUDA needs less. A contextual encoding (CoPE) keeps more per
score than a bias does: training it at 4096 tokens took about 1.5 GB more than the estimate.

Wall time is not derived from FLOPs (a machine's speed is not known in advance): `--dry-run`
times a few real steps of the job's model on this machine (step_seconds) and extrapolates.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from posbench.attention.decoupled_rope import rotary_width
from posbench.attention.paths import BLOCK_ELEMENTS
from posbench.config import ROPE_REMAPS, to_container
from posbench.evaluations.base import with_train_length
from posbench.evaluations.perplexity import protocol_of

BASE_BYTES = 1 << 29  # the interpreter, torch and the corpus
ACTIVATIONS_PER_LAYER = 28  # fp32 values kept per token and unit of d_model, per layer
LOGIT_COPIES = 4  # fp32 values kept per token and vocabulary entry: logits, softmax, gradients
EVAL_ACTIVATIONS = 16  # fp32 values alive per token and unit of d_model in a forward pass
# score blocks alive at once on the blockwise path (scores, probabilities, masks): training
# recomputes a block in its backward pass and keeps fewer
TRAIN_SCORE_BLOCKS, EVAL_SCORE_BLOCKS = 4, 10
LOGIT_CHUNK = 4096  # positions whose logits exist at once (model.token_losses)
MEMORY_CHECK = "POSBENCH_MEMORY_CHECK"  # =0: start a job the estimate says will not fit
# a step's time: the mean of at most MEASURED_STEPS steps, or of those begun within
# MEASURE_SECONDS, after one warm-up step (allocations, first-call kernels); a warm-up step longer
# than MEASURE_SECONDS is the measure itself, so that a big model costs one step
MEASURED_STEPS, MEASURE_SECONDS = 3, 1.0


@dataclass(frozen=True)
class Estimate:
    params: int
    tokens: int  # trained on
    train_flops: float
    eval_flops: float
    train_bytes: int  # expected peak of training
    eval_bytes: int  # expected peak at the longest evaluation length
    eval_length: int


def _score_blocks(blocks: int, batch: int, heads: int, length: int) -> int:
    """fp32 bytes of `blocks` score blocks of the blockwise path: whole rows of at most
    BLOCK_ELEMENTS scores, 16 query rows at least."""
    block = min(batch * heads * length * length, max(BLOCK_ELEMENTS, 16 * batch * heads * length))
    return 4 * blocks * block


def _processed_tokens(eval_cfg, length: int) -> int:
    """Tokens fed to the model at one length: windows times the length."""
    scored = protocol_of(eval_cfg).stride(eval_cfg) or length
    return math.ceil(eval_cfg.tokens / scored) * length


def _meta_model(cfg):
    from posbench.model.transformer import build_model

    with torch.device("meta"):
        return build_model(cfg)


def _weights(model) -> int:
    """The parameters that multiply (the encoding's own count in its flops)."""
    return model.num_params() - sum(p.numel() for p in model.encoding.parameters())


def step_flops(cfg, model=None) -> float:
    """Training FLOPs of one step (the formula above): the weights and the attention core, the
    same for every encoding and attention path, plus 3 x the encoding's own forward FLOPs."""
    model = model or _meta_model(cfg)
    m, t = cfg.model, cfg.train
    tokens = t.batch_size * t.seq_len
    own = model.encoding.flops(t.batch_size, t.seq_len, t.seq_len * (t.seq_len + 1) // 2)
    qk_width = m.d_model + m.n_head * (rotary_width(m) or 0)  # MLA's rotary parts widen q.k
    return (6 * _weights(model) * tokens
            + 3 * m.n_layer * t.seq_len * (qk_width + m.d_model) * tokens + 3 * own)


def estimate(cfg, world_size: int = 1, steps: Optional[int] = None) -> Estimate:
    """The estimate of a checked config (no data read: the model is built on the meta device),
    over `steps` training steps (its budget's: posbench/runs/budget.py; None: train.steps)."""
    model = _meta_model(cfg)
    params = model.num_params()
    weights = _weights(model)
    # sinks take the blockwise path on CPU, as a score hook does
    hooks = cfg.model.get("attn_sinks", False) or any(
        getattr(model.encoding, hook) is not None
        for hook in ("score_mod", "row_mod", "value_mod", "mix_heads"))
    # a distance remap (eval only) scores in blocks too
    eval_hooks = hooks or cfg.eval.rope_scaling in ROPE_REMAPS
    m, t = cfg.model, cfg.train
    vocab = model.head.weight.shape[0]
    steps = steps or t.steps
    tokens = t.batch_size * t.seq_len * steps
    train_flops = steps * step_flops(cfg, model)
    eval_cfg = with_train_length(cfg.eval, t.seq_len)
    eval_flops = sum(_processed_tokens(eval_cfg, n) * (2 * weights + 2 * m.n_layer * n * m.d_model)
                     for n in eval_cfg.lengths)
    batch = t.batch_size // world_size
    train_bytes = (BASE_BYTES + 16 * params + 4 * batch * t.seq_len * (
        ACTIVATIONS_PER_LAYER * m.n_layer * m.d_model + LOGIT_COPIES * vocab)
        + (_score_blocks(TRAIN_SCORE_BLOCKS, batch, m.n_head, t.seq_len) if hooks else 0))
    n = max(eval_cfg.lengths)
    windows = max(1, eval_cfg.batch_tokens // n)
    eval_bytes = (BASE_BYTES + 4 * params + 4 * windows * n * (
        EVAL_ACTIVATIONS * m.d_model + 2 * vocab * min(1.0, LOGIT_CHUNK / n))
        + (_score_blocks(EVAL_SCORE_BLOCKS, windows, m.n_head, n) if eval_hooks else 0))
    return Estimate(params, tokens, float(train_flops), float(eval_flops), int(train_bytes),
                    int(eval_bytes), n)


_step_seconds: Dict[str, float] = {}  # measured step times, by what sets a step's cost


def step_seconds(cfg, device: torch.device, threads: int, world_size: int = 1) -> float:
    """Seconds of one training step of cfg's job on this machine: real optimizer steps of its
    model at its batch (per process) and length, on random tokens, under `threads` torch
    threads. Cached by what sets a step's cost (model, encoding, batch, length, device,
    threads), so a sweep measures each of its shapes once; seeds and train.steps share one."""
    t = cfg.train
    batch = t.batch_size // world_size
    key = json.dumps([to_container(cfg.model), to_container(cfg.encoding), batch, t.seq_len,
                      t.get("pose_span"), str(device), threads], sort_keys=True, default=str)
    if key not in _step_seconds:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
                _step_seconds[key] = _measure_step(cfg, device, batch)
        finally:
            torch.set_num_threads(previous)
    return _step_seconds[key]


def _measure_step(cfg, device: torch.device, batch: int) -> float:
    from posbench.model.transformer import build_model
    from posbench.runs import train as training

    t = cfg.train
    model = build_model(cfg).to(device)
    optimizer = training.make_optimizer(model, t, device)
    training.prepare_training(model, t)
    model.encoding.at_step(0)
    x, y = torch.randint(model.head.weight.shape[0], (2, batch, t.seq_len)).to(device)

    def step() -> torch.Tensor:
        return training.train_step(model, model, optimizer, x, y, t.lr, t.grad_clip)

    began = time.perf_counter()
    step().item()  # warm-up: allocations, first-call kernels
    if time.perf_counter() - began > MEASURE_SECONDS:  # one long step: its overheads are small
        return time.perf_counter() - began
    began, n = time.perf_counter(), 0
    while n < MEASURED_STEPS and (n == 0 or time.perf_counter() - began < MEASURE_SECONDS):
        loss, n = step(), n + 1
    loss.item()  # waits for a GPU's queued steps
    return (time.perf_counter() - began) / n


def wall_time(cfg, est: Estimate, device: torch.device, threads: int,
              world_size: int = 1) -> Tuple[float, str]:
    """The job's expected seconds on this machine, and a line saying how they were found: the
    run's steps times a measured step (step_seconds), or train.budget_seconds under a wallclock
    budget, plus the evaluation at the same rate per FLOP (its FLOPs over a step's)."""
    t = cfg.train
    steps = est.tokens // (t.batch_size * t.seq_len)
    step = step_seconds(cfg, device, threads, world_size)
    evaluating = step * est.eval_flops / (est.train_flops / steps / world_size)
    wallclock = t.get("budget") == "wallclock"
    training = t.budget_seconds if wallclock else steps * step
    total = training + evaluating
    how = (f"{span(training)} of train.budget_seconds" if wallclock
           else f"{steps} steps x {span(step)}")
    return total, (f"about {span(total)}: {how}, a step measured on "
                   f"this machine ({threads} thread{'s' * (threads > 1)}), + {span(evaluating)} "
                   "evaluating (by FLOPs)" + ("; train.compile is not timed, the steps ran "
                                              "eager" if t.compile else ""))


def span(seconds: float) -> str:
    """11.9 ms, 1.2 s, 95 s, 3.1 min, 83 min, 2.5 h."""
    if seconds < 0.9995:
        return f"{seconds * 1000:.3g} ms"
    value, unit = ((seconds, "s") if seconds < 100 else (seconds / 60, "min") if seconds < 6000
                   else (seconds / 3600, "h"))
    return f"{value:.2g} {unit}" if value < 10 else f"{value:.0f} {unit}"


def _cgroup_room() -> Optional[int]:
    """Bytes left under this process's cgroup v2 memory limit (a container, a SLURM job)."""
    folder = Path("/sys/fs/cgroup")
    try:
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((folder / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def available_memory(device: torch.device) -> Tuple[Optional[int], str]:
    """Bytes a job can use on `device`, and where the number comes from; (None, why) when it
    cannot be known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {torch.cuda.get_device_name(device)}"
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None, "no /proc/meminfo"
    available = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines()
                     if line.startswith("MemAvailable:"))
    room = _cgroup_room()
    if room is not None and room < available:
        return room, "under this cgroup's memory.max"
    return available, "MemAvailable"


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**29 else f"{n / 2**20:.0f} MiB"


def count(n: float) -> str:
    """4.1M, 3.3G: three significant digits and an SI prefix."""
    for value, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= value:
            return f"{n / value:.3g}{prefix}"
    return f"{n:.3g}"


def describe(est: Estimate) -> str:
    return (f"{count(est.params)} parameters, {count(est.tokens)} training tokens, "
            f"{est.train_flops:.2g} FLOPs training + {est.eval_flops:.2g} evaluating; peak "
            f"memory about {gib(est.train_bytes)} training, {gib(est.eval_bytes)} evaluating at "
            f"{est.eval_length}").replace("e+", "e")


def refusal(cfg, est: Estimate, room: Optional[int], source: str) -> Optional[str]:
    """Why the job's training cannot fit in `room` bytes (source: where that number comes from),
    in one line; None when it fits, when room is unknown, or with POSBENCH_MEMORY_CHECK=0."""
    if room is None or est.train_bytes <= room or os.environ.get(MEMORY_CHECK) == "0":
        return None
    t, m = cfg.train, cfg.model
    return (f"train.seq_len={t.seq_len} is not accepted with train.batch_size={t.batch_size} "
            f"(model n_layer={m.n_layer}, d_model={m.d_model}): training needs about "
            f"{gib(est.train_bytes)} by estimate, {gib(room)} of memory are available "
            f"({source}); expected a smaller train.seq_len or train.batch_size, or "
            f"{MEMORY_CHECK}=0 to start it anyway")


def eval_warning(est: Estimate, room: Optional[int]) -> Optional[str]:
    """A warning when the longest evaluation length will likely run out of memory: that length
    is then recorded as oom and the others still run, so it does not refuse the job."""
    if room is None or est.eval_bytes <= room:
        return None
    return (f"eval.lengths entry {est.eval_length} needs about {gib(est.eval_bytes)} by "
            f"estimate, {gib(room)} are available: it will likely be recorded as oom; a lower "
            "eval.batch_tokens or a shorter length fits")
