"""Speed and memory of posbench's encodings, side by side with peers at their best.

    python scripts/bench.py --device cpu --encodings rope,alibi,t5 --json out.json
    python scripts/bench.py --eval-only --no-peers --encodings all --eval-lengths 1024,16384
    python scripts/bench.py --eval-only --no-peers --encodings rope,rope+model.attn_sinks=true

Per encoding: training tokens/s and median step time (AdamW step included), peak training memory,
eval time, tokens/s and peak memory per length (one window of each length, batch 1). Next to
tokens/s, the model's FLOP/s (model_flops_per_token) as a fraction of the matmul peak measured in
the same run (a large fp32 matmul on CPU, bf16 on CUDA); on CUDA also MFU against the device's
dense bf16 peak. With x-transformers installed (`pip install -e .[peers]`), the same measurements
run for its equivalent model in its fastest correct configuration (XT_FLAGS: attn_flash=True
where it accepts the encoding) and for a minimal nanoGPT-style baseline written below (with no
positional encoding, and with RoPE, ALiBi and T5 bias written in the obvious way), at the same
shape (layers, heads, width, vocabulary, tied embeddings), batch, sequence, dtype, threads and
compilation (--compile compiles every contender), and the table prints posbench's ratios to them
and how each contender ran.

Training speed is measured in this process, contenders interleaved step block by step block with
the matmul peak, so that a shared machine's load hits all of them alike; the median over repeats
is reported. Memory is measured in a fresh subprocess per case (peak RSS on CPU, peak allocated
on CUDA); on CPU a case runs under an address-space cap (--mem-cap-gb), and a case that exceeds
it is recorded as "oom", as posbench's evaluate() records such points. An eval case then times
its window again, each time right after posbench's RoPE on the same window, for its time
relative to RoPE's measured side by side.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import platform
import resource
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import posbench
from posbench.encodings.alibi import alibi_slopes
from posbench.encodings.t5 import T5Bias, t5_bucket
from posbench.evaluations.base import is_oom
from posbench.runs.train import make_optimizer

VOCAB = 256  # posbench's byte-level default
# dense bf16 peak FLOP/s by device name; the first substring that matches wins
BF16_PEAK = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12),
             ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10G", 125e12)]
# encodings with an x-transformers equivalent: the Decoder flags that select it, in its fastest
# correct configuration. attn_flash=True (off by default) sends its attention through SDPA, fused
# on CPU and GPU; x-transformers refuses it with T5's relative bias (an assertion in Decoder).
XT_FLAGS = {"rope": {"rotary_pos_emb": True, "attn_flash": True},
            "alibi": {"alibi_pos_bias": True, "attn_flash": True},
            "t5": {"rel_pos_bias": True}}


# ------------------------------------------------------------------ the nanoGPT-style baseline
# encodings the baseline writes out the obvious way, for the cost of posbench's generality
BASELINE_ENCODINGS = ("nope", "rope", "alibi", "t5")
T5 = T5Bias.Config()  # posbench's defaults: the same buckets in the baseline


class BaselineAttention(nn.Module):
    """nanoGPT's attention with one encoding hard-wired: RoPE rotates q and k; ALiBi and T5 add
    their (H, T, T) bias as SDPA's float mask, built in each forward as their reference code
    does."""

    def __init__(self, d_model: int, n_head: int, encoding: str, t5_bias: Optional[nn.Parameter]):
        super().__init__()
        self.n_head, self.encoding, self.t5_bias = n_head, encoding, t5_bias
        self.c_attn = nn.Linear(d_model, 3 * d_model, bias=False)
        self.c_proj = nn.Linear(d_model, d_model, bias=False)
        if encoding == "alibi":
            slopes = torch.tensor(alibi_slopes(n_head)).view(n_head, 1, 1)
            self.register_buffer("slopes", slopes, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        if self.encoding == "rope":
            q, k = rotary(q), rotary(k)
        if self.encoding in ("alibi", "t5"):
            lag = torch.arange(T, device=x.device).view(T, 1) - torch.arange(T, device=x.device)
            if self.encoding == "alibi":
                bias = -self.slopes * lag
            else:
                buckets = t5_bucket(lag, T5.num_buckets, T5.max_distance)
                bias = self.t5_bias[buckets].permute(2, 0, 1)
            bias = bias.masked_fill(lag < 0, float("-inf")).to(q.dtype)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


def rotary(x, base: float = 10000.0):
    """Half-split RoPE, tables in the input's dtype."""
    T, d = x.shape[-2:]
    inv_freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = (torch.cat((a, a), dim=-1).to(x.dtype) for a in (angles.cos(), angles.sin()))
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class BaselineBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, encoding: str, t5_bias):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = BaselineAttention(d_model, n_head, encoding, t5_bias)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model, bias=False), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model, bias=False))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class BaselineGPT(nn.Module):
    """nanoGPT's model with one encoding written in: the plain reference for each."""

    def __init__(self, n_layer: int, n_head: int, d_model: int, encoding: str):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d_model)
        # T5's buckets x H, shared by all layers as in posbench
        self.t5_bias = (nn.Parameter(torch.zeros(T5.num_buckets, n_head)) if encoding == "t5"
                        else None)
        self.blocks = nn.Sequential(*(BaselineBlock(d_model, n_head, encoding, self.t5_bias)
                                      for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.lm_head(self.ln_f(self.blocks(self.wte(idx))))


# ------------------------------------------------------------------ contenders
@dataclass(frozen=True)
class Contender:
    impl: str      # posbench | x-transformers | baseline
    encoding: str  # posbench's name; the baseline's is one of BASELINE_ENCODINGS
    # posbench's model or encoding options beside its defaults (an architecture knob)
    overrides: Tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return "+".join((f"{self.impl}:{self.encoding}", *self.overrides))

    @classmethod
    def of(cls, spec: str) -> "Contender":
        """posbench's contender from --encodings' `NAME` or `NAME+KEY=VALUE+...`."""
        encoding, *overrides = spec.split("+")
        return cls("posbench", encoding, tuple(overrides))


def contenders(encodings: List[str], peers: bool) -> List[Contender]:
    out = [Contender.of(e) for e in encodings]
    if peers:
        out += [Contender("x-transformers", e) for e in encodings if e in XT_FLAGS]
        out += [Contender("baseline", e) for e in BASELINE_ENCODINGS
                if e in encodings or e == "nope"]
    return out


def flags(c: Contender, args) -> str:
    """How the contender runs: the output and docs/benchmarks.md state it."""
    if c.impl == "x-transformers":
        out = ", ".join(f"{k}=True" for k in XT_FLAGS[c.encoding])
        if "attn_flash" not in XT_FLAGS[c.encoding]:
            out += " (attn_flash refused with rel_pos_bias)"
    elif c.impl == "baseline":
        out = "SDPA is_causal" if c.encoding in ("nope", "rope") else "SDPA float mask"
    else:
        out = ", ".join(c.overrides) or "defaults"
    return out + (", compiled" if args.compile else ", eager")


def shape(args):
    """(n_layer, n_head, d_model) of the posbench model preset."""
    m = posbench.compose([f"model={args.model}"]).model
    return m.n_layer, m.n_head, m.d_model


def model_flops_per_token(args, n: int, train: bool) -> float:
    """Matmul FLOPs per token of the preset's shape at context n, the same for every contender:
    2 per weight of the blocks and of the tied embedding (the output head), plus the causal
    attention's q k^T and p v, 2 * layers * width * n on average over the n positions (half of
    the full square's 4 * layers * width * n); training counts 3x the forward."""
    m = posbench.compose([f"model={args.model}"]).model
    weights = m.n_layer * (4 + 2 * m.mlp_ratio) * m.d_model ** 2 + VOCAB * m.d_model
    forward = 2 * weights + 2 * m.n_layer * m.d_model * n
    return 3 * forward if train else forward


def matmul_flops(device: torch.device) -> float:
    """FLOP/s of one large square matmul, the peak this run measures: fp32 n = 2048 on CPU
    (within 5% of n = 4096 on the 2-core machine of docs/benchmarks.md, at an eighth of the
    time), bf16 n = 8192 on CUDA."""
    n, dtype, reps = ((2048, torch.float32, 2) if device.type == "cpu" else
                      (8192, torch.bfloat16, 20))
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
    a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - start)


def build(c: Contender, args, max_len: int) -> nn.Module:
    n_layer, n_head, d_model = shape(args)
    if c.impl == "posbench":
        cfg = posbench.compose([f"model={args.model}", f"encoding={c.encoding}",
                                f"train.seq_len={args.seq_len}", f"eval.lengths=[{max_len}]",
                                *c.overrides])
        return posbench.build_model(cfg, VOCAB)
    if c.impl == "baseline":
        return BaselineGPT(n_layer, n_head, d_model, c.encoding)
    from x_transformers import Decoder, TransformerWrapper

    head_dim = d_model // n_head  # rotary on the whole head, as posbench (x-transformers: half)
    layers = Decoder(dim=d_model, depth=n_layer, heads=n_head, attn_dim_head=head_dim,
                     rotary_emb_dim=head_dim, ff_no_bias=True, **XT_FLAGS[c.encoding])
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=max_len, attn_layers=layers,
                              use_abs_pos_emb=False, tie_embedding=True)


def token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, through each model's own loss path."""
    if hasattr(model, "token_losses"):  # posbench: chunked, fp32 logits, as runs/train.py calls it
        return model.token_losses(x, y).mean()
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------ training speed (in process)
class Trainer:
    """One contender's model, optimizer and compiled-or-not loss, as posbench's runs/train.py runs
    it."""

    def __init__(self, c: Contender, args, device: torch.device):
        torch.manual_seed(0)
        self.model = build(c, args, args.seq_len).to(device).train()
        self.optimizer = make_optimizer(self.model, argparse.Namespace(lr=1e-3, weight_decay=0.1,
                                                                        position_lr_mult=10.0),
                                        device)
        self.loss = torch.compile(token_loss) if args.compile else token_loss
        self.device = device

    def step(self, x, y):
        with autocast(self.device):
            loss = self.loss(self.model, x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()


def train_speed(cs: List[Contender], args, device: torch.device) -> dict:
    """Median seconds per step of each contender, measured in interleaved blocks of steps."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (args.batch_size, args.seq_len + 1), generator=g).to(device)
    x, y = data[:, :-1], data[:, 1:]
    trainers = {c: Trainer(c, args, device) for c in cs}
    for c, t in trainers.items():  # warm-up: allocator, thread pools, compilation
        start = time.perf_counter()
        for _ in range(args.warmup):
            t.step(x, y)
        sync(device)
        print(f"  {c.label:24s} warm-up: {args.warmup} steps in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    times, peaks = {c: [] for c in cs}, []
    for r in range(args.repeats):
        for c, t in trainers.items():
            sync(device)
            start = time.perf_counter()
            for _ in range(args.steps):
                t.step(x, y)
            sync(device)
            times[c].append((time.perf_counter() - start) / args.steps)
        peaks.append(matmul_flops(device))
        # a line per repeat, so that a run cut short still tells what it measured
        print(f"  repeat {r + 1}/{args.repeats}, ms per step: " + ", ".join(
            f"{c.label} {1e3 * times[c][-1]:.1f}" for c in cs), flush=True)
    peak, spec = statistics.median(peaks), bf16_peak(device)
    out = {"matmul_flops": peak, "matmul_flops_all": peaks}
    for c, t in trainers.items():
        step = statistics.median(times[c])
        row = {"params": sum(p.numel() for p in t.model.parameters()), "step_s": step,
               "step_s_all": times[c], "tokens_per_s": args.batch_size * args.seq_len / step}
        row["flops"] = model_flops_per_token(args, args.seq_len, True) * row["tokens_per_s"]
        row["of_peak"] = row["flops"] / peak
        if spec:
            row["mfu"] = row["flops"] / spec
        out[c] = row
    return out


def bf16_peak(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK if key in name), None)


# ------------------------------------------------------------------ memory cases (subprocesses)
def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated on CUDA; on CPU the process's peak RSS, VmHWM (ru_maxrss would do, but
    Linux carries it over from the parent through fork and exec)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib / 1024


def reset_peak_memory(device: torch.device) -> None:
    """The peak starts again from what is in use now (on CPU, Linux's clear_refs 5 resets VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def in_fresh_process(args) -> torch.device:
    """The settings every measuring process starts with: threads, and on CPU the memory cap."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cpu":
        cap = int(args.mem_cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return device


def out_of_memory(err: Exception) -> dict:
    if not is_oom(err):  # only out-of-memory is recorded, as evaluate() does
        raise err
    return {"status": "oom"}


def run_train(c: Contender, args) -> dict:
    """In a fresh process: peak memory and seconds of one training step after a warm-up step."""
    device = in_fresh_process(args)
    start_mb = peak_memory_mb(device)  # the interpreter, torch and the libraries
    try:
        trainer = Trainer(c, args, device)
        data = torch.randint(0, VOCAB, (args.batch_size, args.seq_len + 1), device=device)
        trainer.step(data[:, :-1], data[:, 1:])
        reset_peak_memory(device)
        seconds = timed(lambda n: trainer.step(data[:, :-1], data[:, 1:]), 0, device)
        return {"status": "ok", "seconds": seconds, "peak_mb": peak_memory_mb(device),
                "start_mb": start_mb}
    except Exception as err:  # noqa: BLE001
        return out_of_memory(err)


def run_evals(c: Contender, args) -> dict:
    """In a fresh process: {length: result} for one scored window of each eval length,
    ascending, the peak memory reset before each. Each window is timed once, then again
    --eval-repeats times, each right after posbench's RoPE on the same window and followed by the
    matmul peak, for its ratio to RoPE and its FLOP/s measured side by side."""
    device = in_fresh_process(args)
    start_mb = peak_memory_mb(device)
    lengths = sorted(args.eval_lengths)
    model = build(c, args, lengths[-1]).to(device).eval()
    rope = Contender("posbench", "rope")
    reference = None if c == rope else build(rope, args, lengths[-1]).to(device).eval()
    out = {}
    for n in lengths:
        try:
            data = torch.randint(0, VOCAB, (1, n + 1), device=device)
            call = scorer(model, data, device)
            # warm-up: CUDA compiles FlexAttention for each shape, so it warms up at the timed
            # length; the CPU only needs its allocator and threads, so a short window will do
            call(n if device.type == "cuda" else min(n, args.seq_len))
            reset_peak_memory(device)
            seconds = timed(call, n, device)
            out[n] = {"status": "ok", "peak_mb": peak_memory_mb(device), "start_mb": start_mb}
            paired = None if reference is None else scorer(reference, data, device)
            out[n].update(side_by_side(call, seconds, n, args, device, paired))
        except Exception as err:  # noqa: BLE001
            out[n] = out_of_memory(err)
    return out


def scorer(model: nn.Module, data: torch.Tensor, device: torch.device):
    """call(n): the model's loss on the first n tokens of data, as evaluate() scores a window."""

    @torch.no_grad()
    def call(n):
        with autocast(device):
            token_loss(model, data[:, :n], data[:, 1:n + 1])

    return call


def timed(call, n: int, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    call(n)
    sync(device)
    return time.perf_counter() - start


def side_by_side(call, first: float, length: int, args, device, reference=None) -> dict:
    """--eval-repeats more timings of call(length), each after reference(length) (RoPE's, when
    given) and followed by the matmul peak: the medians, the median ratio of each pair, and the
    model FLOP/s of the median time as a fraction of the peak."""
    if reference is not None:
        reference(min(length, args.seq_len))
    own, ref, peaks = [first], [], []
    for _ in range(args.eval_repeats):
        if reference is not None:
            ref.append(timed(reference, length, device))
        own.append(timed(call, length, device))
        peaks.append(matmul_flops(device))
    seconds, peak = statistics.median(own), statistics.median(peaks)
    flops = model_flops_per_token(args, length, False) * length / seconds
    out = {"seconds": seconds, "seconds_all": own, "tokens_per_s": length / seconds,
           "flops": flops, "of_peak": flops / peak, "matmul_flops": peak}
    if ref:
        out["vs_rope"] = statistics.median(o / r for o, r in zip(own[1:], ref))
        out["rope_seconds_all"] = ref
    return out


def memory_cases(cs: List[Contender], args) -> dict:
    """{(contender, mode, length): result}: a fresh process for each contender's training step
    (unless --eval-only), then one for each contender's eval lengths, one after another."""
    ctx = multiprocessing.get_context("spawn")
    jobs = [] if args.eval_only else [(c, "train", run_train) for c in cs]
    jobs += [(c, "eval", run_evals) for c in cs]
    out = {}
    for c, mode, fn in jobs:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
            try:
                result = pool.submit(fn, c, args).result()
            except concurrent.futures.process.BrokenProcessPool:  # killed, e.g. by the OOM killer
                result = {"status": "killed"}
        lengths = [args.seq_len] if mode == "train" else sorted(args.eval_lengths)
        for n in lengths:
            out[(c, mode, n)] = result if mode == "train" or "status" in result else result[n]
            print(f"  {c.label:24s} {mode:5s} {n:6d}: {fmt_case(out[(c, mode, n)])}", flush=True)
    return out


def fmt_case(r: dict) -> str:
    if r["status"] != "ok":
        return r["status"]
    line = f"{r['seconds']:.2f} s, {r['peak_mb']:.0f} MiB"
    if "of_peak" in r:
        line += f", {r['tokens_per_s']:.0f} tok/s, {100 * r['of_peak']:.0f}% of peak"
    if "vs_rope" in r:
        line += f", {r['vs_rope']:.2f}x rope's time"
    return line


# ------------------------------------------------------------------ report
def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def print_table(cs: List[Contender], speed: dict, mem: dict, args) -> None:
    print("\nhow each contender runs:")
    for c in cs:
        print(f"  {c.label:24s} {flags(c, args)}")
    if speed:
        print_speed(cs, speed, mem, args)
    if mem:
        print(f"\neval (batch 1, one window per length; median of {1 + args.eval_repeats}): "
              "seconds, peak MiB, tokens/s, model FLOP/s as % of the matmul peak, time / RoPE's "
              "(median of the pairs)")
        print(f"{'contender':24s} {'length':>6s} {'s':>8s} {'peak MiB':>9s} {'tok/s':>8s} "
              f"{'% peak':>7s} {'x rope':>7s}")
        for c in cs:
            for n in args.eval_lengths:
                r = mem[(c, "eval", n)]
                if r["status"] != "ok":
                    print(f"{c.label:24s} {n:6d} {r['status']:>8s}")
                    continue
                vs = f"{r['vs_rope']:.2f}" if "vs_rope" in r else "-"
                print(f"{c.label:24s} {n:6d} {r['seconds']:8.2f} {r['peak_mb']:9.0f} "
                      f"{r['tokens_per_s']:8.0f} {100 * r['of_peak']:6.1f}% {vs:>7s}")


def print_speed(cs: List[Contender], speed: dict, mem: dict, args) -> None:
    print(f"\ntraining: model={args.model} batch={args.batch_size} seq_len={args.seq_len} "
          f"device={args.device} threads={torch.get_num_threads()} (median of {args.repeats}); "
          f"matmul peak {speed['matmul_flops'] / 1e9:.1f} GFLOP/s (median)")
    head = (f"{'contender':24s} {'params':>9s} {'tok/s':>9s} {'step ms':>8s} {'peak MiB':>9s}"
            f" {'GFLOP/s':>8s} {'% peak':>7s}")
    print(head + ("    MFU" if args.device == "cuda" else "")
          + "  vs x-transformers  vs baseline (same)  vs baseline:nope")
    for c in cs:
        s, m = speed[c], mem.get((c, "train", args.seq_len), {"status": "-"})
        peak = f"{m['peak_mb']:.0f}" if m["status"] == "ok" else m["status"]
        line = (f"{c.label:24s} {s['params']:9d} {s['tokens_per_s']:9.0f} "
                f"{1e3 * s['step_s']:8.1f} {peak:>9s} {s['flops'] / 1e9:8.1f} "
                f"{100 * s['of_peak']:6.1f}%")
        if args.device == "cuda":
            line += f"  {100 * s['mfu']:4.1f}%" if "mfu" in s else "      -"
        if c.impl == "posbench" and not c.overrides:  # a knob has no peer of its own
            for peer, width in ((Contender("x-transformers", c.encoding), 17),
                                (Contender("baseline", c.encoding), 18),
                                (Contender("baseline", "nope"), 16)):
                tps = speed[peer]["tokens_per_s"] if peer in speed else None
                cell = ratio(s["tokens_per_s"], tps) if tps else "-"
                line += f"  {cell:>{width}s}"
        print(line)


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    info = {"cpu": cpu, "cores": multiprocessing.cpu_count(), "threads": torch.get_num_threads(),
            "load_1min": round(__import__("os").getloadavg()[0], 2), "torch": torch.__version__,
            "python": platform.python_version(), "date": datetime.date.today().isoformat()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--encodings", default="rope,alibi,t5",
                   help="comma-separated, or all; NAME+KEY=VALUE adds posbench options to one "
                        "(rope+model.attn_gate=elementwise)")
    p.add_argument("--model", default="tiny", help="a posbench model preset")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--eval-lengths", default="1024,4096,16384")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--compile", action="store_true", help="torch.compile every contender's loss")
    p.add_argument("--no-peers", action="store_true", help="posbench only")
    p.add_argument("--no-speed", action="store_true", help="skip the training-speed measurement")
    p.add_argument("--no-memory", action="store_true", help="skip the subprocess memory cases")
    p.add_argument("--eval-only", action="store_true",
                   help="only the eval cases: no training speed, no training memory")
    p.add_argument("--eval-repeats", type=int, default=2,
                   help="timings of each eval case after the first, each paired with RoPE's")
    p.add_argument("--mem-cap-gb", type=float, default=8.0, help="CPU address-space cap per case")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    args.eval_lengths = [int(n) for n in args.eval_lengths.split(",") if n]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    peers = not args.no_peers
    if peers:
        try:
            import x_transformers  # noqa: F401
        except ImportError:
            print("x-transformers is not installed (pip install -e .[peers]): posbench only")
            peers = False
    names = (posbench.list_encodings() if args.encodings == "all"
             else [e for e in args.encodings.split(",") if e])
    cs = contenders(names, peers)
    info = machine()
    print(json.dumps(info))
    speed = ({} if args.no_speed or args.eval_only
             else train_speed(cs, args, torch.device(args.device)))
    mem = {} if args.no_memory else memory_cases(cs, args)
    print_table(cs, speed, mem, args)
    if args.json:
        record = {"machine": info, "args": vars(args),
                  "train_matmul_flops": speed.get("matmul_flops"), "contenders": [
            {"impl": c.impl, "encoding": c.encoding, "overrides": list(c.overrides),
             "flags": flags(c, args), "train": speed.get(c),
             "train_memory": mem.get((c, "train", args.seq_len)),
             "eval": [{"length": n, **mem[(c, "eval", n)]} for n in args.eval_lengths
                      if (c, "eval", n) in mem]} for c in cs]}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
