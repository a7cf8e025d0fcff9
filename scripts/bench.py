"""Speed and memory of posbench's encodings, side by side with peers.

    python scripts/bench.py --device cpu --encodings rope,alibi,t5 --json out.json

Per encoding: training tokens/s and median step time (AdamW step included), peak training memory,
eval time and peak memory per length (one window of each length, batch 1); on CUDA also MFU
against the device's dense bf16 peak. With x-transformers installed (`pip install -e .[peers]`),
the same measurements run for its equivalent model and for a minimal nanoGPT-style baseline
written below (with no positional encoding, and with RoPE, ALiBi and T5 bias written in the
obvious way), at the same shape (layers, heads, width, vocabulary, tied embeddings), batch,
sequence, dtype and threads, and the table prints posbench's ratios to them.

Training speed is measured in this process, contenders interleaved step block by step block, so
that a shared machine's load hits all of them alike; the median over repeats is reported. Memory
is measured in a fresh subprocess per case (peak RSS on CPU, peak allocated on CUDA); on CPU a
case runs under an address-space cap (--mem-cap-gb), and a case that exceeds it is recorded as
"oom", as posbench's evaluate() records such points.
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
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

import posbench
from posbench.encodings.alibi import alibi_slopes
from posbench.encodings.t5 import T5Bias, t5_bucket
from posbench.evaluations.base import is_oom
from posbench.train import make_optimizer

VOCAB = 256  # posbench's byte-level default
# dense bf16 peak FLOP/s by device name; the first substring that matches wins
BF16_PEAK = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12),
             ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10G", 125e12)]
# encodings with an x-transformers equivalent, and the Decoder flag that selects it
XT_FLAGS = {"rope": "rotary_pos_emb", "alibi": "alibi_pos_bias", "t5": "rel_pos_bias"}


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

    @property
    def label(self) -> str:
        return f"{self.impl}:{self.encoding}"


def contenders(encodings: List[str], peers: bool) -> List[Contender]:
    out = [Contender("posbench", e) for e in encodings]
    if peers:
        out += [Contender("x-transformers", e) for e in encodings if e in XT_FLAGS]
        out += [Contender("baseline", e) for e in BASELINE_ENCODINGS
                if e in encodings or e == "nope"]
    return out


def shape(args):
    """(n_layer, n_head, d_model) of the posbench model preset."""
    m = posbench.compose([f"model={args.model}"]).model
    return m.n_layer, m.n_head, m.d_model


def build(c: Contender, args, max_len: int) -> nn.Module:
    n_layer, n_head, d_model = shape(args)
    if c.impl == "posbench":
        cfg = posbench.compose([f"model={args.model}", f"encoding={c.encoding}",
                                f"train.seq_len={args.seq_len}", f"eval.lengths=[{max_len}]"])
        return posbench.build_model(cfg, VOCAB)
    if c.impl == "baseline":
        return BaselineGPT(n_layer, n_head, d_model, c.encoding)
    from x_transformers import Decoder, TransformerWrapper

    head_dim = d_model // n_head  # rotary on the whole head, as posbench (x-transformers: half)
    layers = Decoder(dim=d_model, depth=n_layer, heads=n_head, attn_dim_head=head_dim,
                     rotary_emb_dim=head_dim, ff_no_bias=True, **{XT_FLAGS[c.encoding]: True})
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=max_len, attn_layers=layers,
                              use_abs_pos_emb=False, tie_embedding=True)


def token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, through each model's own loss path."""
    if hasattr(model, "token_losses"):  # posbench: chunked, fp32 logits, as train.py calls it
        return model.token_losses(x, y).mean()
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------ training speed (in process)
class Trainer:
    """One contender's model, optimizer and compiled-or-not loss, as posbench's train.py runs it."""

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
    for t in trainers.values():  # warm-up: allocator, thread pools, compilation
        for _ in range(args.warmup):
            t.step(x, y)
    times = {c: [] for c in cs}
    for _ in range(args.repeats):
        for c, t in trainers.items():
            sync(device)
            start = time.perf_counter()
            for _ in range(args.steps):
                t.step(x, y)
            sync(device)
            times[c].append((time.perf_counter() - start) / args.steps)
    peak = bf16_peak(device)
    out = {}
    for c, t in trainers.items():
        step = statistics.median(times[c])
        row = {"params": sum(p.numel() for p in t.model.parameters()), "step_s": step,
               "step_s_all": times[c], "tokens_per_s": args.batch_size * args.seq_len / step}
        if peak:
            row["mfu"] = flops_per_token(t.model, args) * row["tokens_per_s"] / peak
        out[c] = row
    return out


def bf16_peak(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK if key in name), None)


def flops_per_token(model: nn.Module, args) -> float:
    """nanoGPT's estimate (PaLM appendix B): 6N for the weights plus 12 * layers * width * T for
    the attention scores, forward and backward."""
    n_layer, _, d_model = shape(args)
    n = sum(p.numel() for p in model.parameters())
    return 6 * n + 12 * n_layer * d_model * args.seq_len


# ------------------------------------------------------------------ memory cases (subprocesses)
def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated on CUDA; on CPU the process's peak RSS, VmHWM (ru_maxrss would do, but
    Linux carries it over from the parent through fork and exec)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib / 1024


def run_case(c: Contender, mode: str, length: int, args) -> dict:
    """In a fresh process: one training step at the training length (mode "train") or one
    scored window of `length` tokens (mode "eval"), after a warm-up call; peak memory and the
    seconds of the timed call."""
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cpu":
        cap = int(args.mem_cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    start_mb = peak_memory_mb(device)  # the interpreter, torch and the libraries
    try:
        if mode == "train":
            trainer = Trainer(c, args, device)
            data = torch.randint(0, VOCAB, (args.batch_size, args.seq_len + 1), device=device)
            call = lambda n: trainer.step(data[:, :-1], data[:, 1:])  # noqa: E731
        else:
            model = build(c, args, length).to(device).eval()
            data = torch.randint(0, VOCAB, (1, length + 1), device=device)

            @torch.no_grad()
            def call(n):
                with autocast(device):
                    token_loss(model, data[:, :n], data[:, 1:n + 1])
        # warm-up: CUDA compiles FlexAttention for each shape, so it warms up at the timed
        # length; the CPU only needs its allocator and threads, so a short window will do
        call(length if device.type == "cuda" else min(length, args.seq_len))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        start = time.perf_counter()
        call(length)
        sync(device)
        return {"status": "ok", "seconds": time.perf_counter() - start,
                "peak_mb": peak_memory_mb(device), "start_mb": start_mb}
    except Exception as err:  # noqa: BLE001 - only out-of-memory is recorded, as evaluate does
        if not is_oom(err):
            raise
        return {"status": "oom"}


def memory_cases(cs: List[Contender], args) -> dict:
    """{(contender, mode, length): result}, one subprocess per case, run one after another."""
    cases = [(c, "train", args.seq_len) for c in cs]
    cases += [(c, "eval", n) for c in cs for n in args.eval_lengths]
    ctx = multiprocessing.get_context("spawn")
    out = {}
    for case in cases:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
            try:
                out[case] = pool.submit(run_case, *case, args).result()
            except concurrent.futures.process.BrokenProcessPool:  # killed, e.g. by the OOM killer
                out[case] = {"status": "killed"}
        print(f"  {case[0].label:24s} {case[1]:5s} {case[2]:6d}: {fmt_case(out[case])}", flush=True)
    return out


def fmt_case(r: dict) -> str:
    if r["status"] != "ok":
        return r["status"]
    return f"{r['seconds']:.2f} s, {r['peak_mb']:.0f} MiB"


# ------------------------------------------------------------------ report
def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def print_table(cs: List[Contender], speed: dict, mem: dict, args) -> None:
    if speed:
        print_speed(cs, speed, mem, args)
    if mem:
        print("\neval (batch 1, one window per length): seconds, peak MiB")
        print(f"{'contender':24s}" + "".join(f"{n:>22d}" for n in args.eval_lengths))
        for c in cs:
            cells = [fmt_case(mem[(c, "eval", n)]) for n in args.eval_lengths]
            print(f"{c.label:24s}" + "".join(f"{cell:>22s}" for cell in cells))


def print_speed(cs: List[Contender], speed: dict, mem: dict, args) -> None:
    print(f"\ntraining: model={args.model} batch={args.batch_size} seq_len={args.seq_len} "
          f"device={args.device} threads={torch.get_num_threads()} (median of {args.repeats})")
    head = f"{'contender':24s} {'params':>9s} {'tok/s':>9s} {'step ms':>8s} {'peak MiB':>9s}"
    print(head + ("    MFU" if args.device == "cuda" else "")
          + "  vs x-transformers  vs baseline (same)  vs baseline:nope")
    for c in cs:
        s, m = speed[c], mem.get((c, "train", args.seq_len), {"status": "-"})
        peak = f"{m['peak_mb']:.0f}" if m["status"] == "ok" else m["status"]
        line = (f"{c.label:24s} {s['params']:9d} {s['tokens_per_s']:9.0f} "
                f"{1e3 * s['step_s']:8.1f} {peak:>9s}")
        if args.device == "cuda":
            line += f"  {100 * s['mfu']:4.1f}%" if "mfu" in s else "      -"
        if c.impl == "posbench":
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
    p.add_argument("--encodings", default="rope,alibi,t5")
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
    cs = contenders([e for e in args.encodings.split(",") if e], peers)
    info = machine()
    print(json.dumps(info))
    speed = {} if args.no_speed else train_speed(cs, args, torch.device(args.device))
    mem = {} if args.no_memory else memory_cases(cs, args)
    print_table(cs, speed, mem, args)
    if args.json:
        record = {"machine": info, "args": vars(args), "contenders": [
            {"impl": c.impl, "encoding": c.encoding, "train": speed.get(c),
             "train_memory": mem.get((c, "train", args.seq_len)),
             "eval": [{"length": n, **mem[(c, "eval", n)]} for n in args.eval_lengths
                      if (c, "eval", n) in mem]} for c in cs]}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
