"""Rotary position embedding (RoPE), half-split layout as in GPT-NeoX / HF, and the eval-time
length extensions of a trained RoPE model (docs/encodings.md#eval-time-options):

- of its frequencies (PI, NTK, HF's dynamic NTK, YaRN, HF's llama3): each a function of one
  scale s (RoPE.scale), static when eval.rope_scaling_factor is set, the same s at every
  evaluated length as the PI, NTK and YaRN papers evaluate; dynamic when it is null,
  s = max(1, n/L) from each evaluated length n and the training length L; and LongRoPE's one
  factor per pair, read from eval.longrope_factors and applied past L, or at every length on a
  model trained with them (train.longrope_factors; posbench/encodings/longrope.py);
- of its relative distances (ReRoPE, Self-Extend, ShifTed RoPE, Dual Chunk Attention,
  StreamingLLM's cache positions; REMAPS): keys near the query keep RoPE's logit, the others get
  the logit of a remapped distance. The attention takes both logits from the `remap` hook
  (posbench/attention/paths.py: remapped_attention), which replaces `rotate` while a remap is set.
"""
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from posbench.attention.decoupled_rope import rotary_width
from posbench.attention.span import GLOBAL, Span, lambda_span
from posbench.core.errors import ConfigError, require
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register, relative_lag
from posbench.encodings.longrope import LongRoPE, read_factors

# YaRN's bounds in turns per training window, beta_fast and beta_slow of its released code: pairs
# that turn more than 32 times in L tokens keep RoPE, pairs that turn less than once are scaled
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0
# Llama 3.1's bands, low_freq_factor and high_freq_factor of Hugging Face's `llama3` rope type:
# wavelengths below L/4 keep RoPE, those above L are divided by s
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR = 1.0, 4.0


def rope_inv_freq(head_dim: int, base: float, device=None) -> torch.Tensor:
    """theta_p = base^(-2p/d), p = 0..d/2-1, float64."""
    return base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)


def rope_tables(pos: torch.Tensor, inv_freq: torch.Tensor, dtype, factor: float = 1.0):
    """cos and sin of pos * theta, (B, 1, T, d), times `factor` (YaRN's attention factor): built
    in float64, then cast."""
    if pos.stride(0) == 0:  # one position row shared by the batch: compute it once
        pos = pos[:1]
    angles = pos.to(torch.float64).unsqueeze(-1) * inv_freq.to(pos.device)
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


def apply_rotary(x, cos, sin):
    """x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def ntk_base(base: float, s: float, head_dim: int) -> float:
    """NTK-aware base b' = b * s^(d/(d-2)): the fastest pair keeps its frequency, the slowest is
    divided by exactly s (bloc97)."""
    return base * s ** (head_dim / (head_dim - 2))


def yarn_pair_range(head_dim: int, base: float, train_len: int) -> Tuple[int, int]:
    """The pair indices (low, high) between which YaRN's ramp runs. A pair turns beta times in L
    tokens (L theta_p / 2pi = beta) at the fractional index p = d ln(L / (2 pi beta)) / (2 ln b):
    low is that index for beta_fast rounded down, high the one for beta_slow rounded up, clamped
    to [0, d-1] as the released code and HF clamp them (d, not d/2: see docs/encodings.md)."""
    def index(turns: float) -> float:
        return head_dim * math.log(train_len / (2 * math.pi * turns)) / (2 * math.log(base))

    return (max(math.floor(index(YARN_BETA_FAST)), 0),
            min(math.ceil(index(YARN_BETA_SLOW)), head_dim - 1))


def yarn_inv_freq(inv_freq: torch.Tensor, s: float, head_dim: int, base: float,
                  train_len: int) -> torch.Tensor:
    """YaRN's "NTK-by-parts" frequencies: theta' = (1 - w) theta / s + w theta, where the weight w
    of the unscaled frequency falls linearly over the pair index, from 1 at pair `low` and below
    to 0 at pair `high` and above (yarn_pair_range)."""
    low, high = yarn_pair_range(head_dim, base, train_len)
    if low == high:  # both bounds clamped to one pair: a step there instead of 0/0
        high += 0.001
    pair = torch.arange(len(inv_freq), dtype=inv_freq.dtype, device=inv_freq.device)
    keep = 1 - ((pair - low) / (high - low)).clamp(0, 1)
    return inv_freq / s * (1 - keep) + inv_freq * keep


def yarn_attention_factor(s: float) -> float:
    """YaRN's attention factor sqrt(1/t) = 0.1 ln s + 1, multiplied into cos and sin and so into
    both q and k: the logits scale by its square."""
    return 0.1 * math.log(s) + 1


def llama3_inv_freq(inv_freq: torch.Tensor, s: float, train_len: int,
                    low: float = LLAMA3_LOW_FREQ_FACTOR,
                    high: float = LLAMA3_HIGH_FREQ_FACTOR) -> torch.Tensor:
    """Llama 3.1's frequencies (HF's `llama3`, _compute_llama3_parameters), by each pair's
    wavelength lambda = 2 pi / theta: lambda < L/high keeps theta, lambda > L/low takes theta/s,
    and between them (1 - t) theta/s + t theta with t = (L/lambda - low)/(high - low), which is
    1 and 0 at the two edges. A pair at theta = 0 (an infinite wavelength) stays 0."""
    t = ((train_len * inv_freq / (2 * math.pi) - low) / (high - low)).clamp(0, 1)
    return (1 - t) * inv_freq / s + t * inv_freq


# eval.rope_scaling values that remap relative distances instead of scaling frequencies
REMAPS = ("rerope", "self_extend", "shifted_rope", "dca", "streaming_llm")
# defaults as fractions of the training length L, from each reference's own setting:
RE_ROPE_WINDOW = 1 / 8  # bojone/rerope: window 512 at training_length 4096
SELF_EXTEND_WINDOW = 1 / 4  # datamllab/LongLM: neighbour window 1024 for Llama-2 (L = 4096)
STRING_SHIFT = 1 / 3  # HKUNLP/STRING: shifted_offset S = 0.33 L
STRING_LOCAL = 1 / 16  # HKUNLP/STRING: local window W = 128, i.e. L/16 at a 2048-token L
# HKUNLP/ChunkLlama chunkllama_attn_replace.py: chunk_size = 3/4 and local_window = 1/8 of the
# pretraining length (replace_with_chunkllama); chunks of chunk_size - local_window tokens.
# eval.rope_chunk and eval.rope_window set them
DCA_CHUNK = 3 / 4
DCA_LOCAL = 1 / 8


class Remap(NamedTuple):
    """A distance remap with its values filled in for training length L (remap_for). Query i and
    key j keep RoPE's logit where near_keys says so; the others get RoPE's logit between q
    rotated at far_positions' first and k at its second."""
    name: str
    # ReRoPE's w, Self-Extend's neighbour window W, STRING's W, DCA's local window w; 0 for
    # StreamingLLM, whose window is the span's
    window: int
    shift: Optional[int]  # STRING's S; None for the others
    factor: Optional[float]  # ReRoPE's k (None: infinite), Self-Extend's G (None: dynamic)
    train_len: int
    chunk: Optional[int] = None  # DCA's chunk size s (chunks of s - w tokens); None for the others

    @property
    def near(self) -> Optional[int]:
        """Lags below it keep RoPE's logit: w, W, or STRING's S; None for DCA and StreamingLLM,
        whose near keys are not the lags below one bound."""
        if self.name in ("dca", "streaming_llm"):
            return None
        return self.shift if self.name == "shifted_rope" else self.window

    def group(self, n: int) -> int:
        """Self-Extend's G for a sequence of n tokens: the static factor, else the smallest G
        with G (L - W) + W >= n, LongLM's rule, so every remapped lag stays below L."""
        if self.factor is not None:
            return int(self.factor)
        return max(1, math.ceil((n - self.window) / (self.train_len - self.window)))

    def far_positions(self, pos: torch.Tensor, n: int,
                      span: Span = GLOBAL) -> Tuple[torch.Tensor, torch.Tensor]:
        """Float64 positions (query's, key's) whose difference is the remapped lag of a far key:
        ReRoPE w (its leaky form w + (d - w)/k: q at (p + w(k - 1))/k, k at p/k); Self-Extend
        floor(p_i/G) - floor(p_j/G) + W - W/G; STRING d - S + W; DCA q at c + min(c - 1, w), k at
        p mod c (c = s - w); StreamingLLM q at its place in the cache of `span`'s sinks and
        window, p minus the tokens evicted before it, k at p."""
        p = pos.to(torch.float64)
        if self.name == "rerope":
            if self.factor is None:
                return torch.full_like(p, float(self.window)), torch.zeros_like(p)
            k = self.factor
            return (p + self.window * (k - 1)) / k, p / k
        if self.name == "self_extend":
            g = self.group(n)
            grouped = torch.div(pos, g, rounding_mode="floor").to(torch.float64)
            return grouped + self.window - self.window / g, grouped
        if self.name == "dca":
            c = self.chunk - self.window
            # ChunkLlama's inter-chunk query sits at qc_t[c - 1] = min(2c - 1, s); a successive
            # chunk's query past the local window lands on the same clamp s
            return torch.full_like(p, float(c + min(c - 1, self.window))), p.remainder(c)
        if self.name == "streaming_llm":
            if not span.sinks:  # a window alone: the cache's places keep every lag
                return p, p
            cache = span.sinks + span.width - 1  # the query's place once the cache is full
            evicted = (torch.arange(pos.shape[-1], device=pos.device) - cache).clamp(min=0)
            return p - evicted.to(torch.float64), p
        return p - self.shift + self.window, p

    def near_keys(self, pos: torch.Tensor, span: Span = GLOBAL) -> Callable:
        """is_near(b, q_idx, kv_idx): where the pair keeps RoPE's logit. DCA: key in the
        query's chunk of c = s - w positions, or in the chunk before while the query is at most
        w into its own (ChunkLlama's successive-chunk position t + c is then the true lag);
        StreamingLLM: key in the span's window (sinks past it are far; a span without sinks
        keeps every lag)."""
        if self.name == "streaming_llm":
            if not span.sinks:
                return lambda b, q_idx, kv_idx: q_idx >= kv_idx
            return lambda b, q_idx, kv_idx: q_idx - kv_idx < span.width
        if self.name == "dca":
            c, w = self.chunk - self.window, self.window
            at = ((lambda b, idx: pos[0][idx]) if pos.stride(0) == 0 else
                  (lambda b, idx: pos[b, idx]))

            def is_near(b, q_idx, kv_idx):
                p_i, p_j = at(b, q_idx), at(b, kv_idx)
                step = (torch.div(p_i, c, rounding_mode="floor")
                        - torch.div(p_j, c, rounding_mode="floor"))
                return (step == 0) | ((step == 1) & (p_i.remainder(c) <= w))
            return is_near
        lag, near = relative_lag(pos), self.near
        return lambda b, q_idx, kv_idx: lag(b, q_idx, kv_idx) < near


def remap_for(rope_scaling: str, train_len: int, window: Optional[int] = None,
              shift: Optional[int] = None, factor: Optional[float] = None,
              chunk: Optional[int] = None) -> Remap:
    """The remap `rope_scaling` (one of REMAPS) with eval.rope_window, eval.rope_shift,
    eval.rope_scaling_factor and eval.rope_chunk, each null taking its default at training length
    train_len. StreamingLLM reads its sinks and window from the attention's span when it is
    applied."""
    def default(fraction: float, at_least: int = 1) -> int:
        return max(at_least, round(fraction * train_len))

    if rope_scaling == "rerope":
        return Remap("rerope", window or default(RE_ROPE_WINDOW), None, factor, train_len)
    if rope_scaling == "self_extend":
        return Remap("self_extend", window or default(SELF_EXTEND_WINDOW), None, factor,
                     train_len)
    if rope_scaling == "dca":
        return Remap("dca", window or default(DCA_LOCAL), None, None, train_len,
                     chunk=chunk or default(DCA_CHUNK, 2))
    if rope_scaling == "streaming_llm":
        return Remap("streaming_llm", 0, None, None, train_len)
    return Remap("shifted_rope", window or default(STRING_LOCAL), shift or default(STRING_SHIFT, 2),
                 None, train_len)


def eval_remap(eval_cfg, train_len: int) -> Remap:
    """remap_for with the eval config's rope_scaling and its remap keys (absent from runs saved
    before them: their defaults)."""
    return remap_for(eval_cfg.rope_scaling, train_len, eval_cfg.get("rope_window"),
                     eval_cfg.get("rope_shift"), eval_cfg.get("rope_scaling_factor"),
                     eval_cfg.get("rope_chunk"))


def remap_record(eval_cfg, train_len: int) -> Optional[dict]:
    """The remap in effect for results.json, defaults filled in: near (lags below it keep RoPE's
    logit; StreamingLLM's: the lambda window, whose keys keep it), window, shift and factor
    (null: ReRoPE's infinite k, Self-Extend's dynamic G), and DCA's chunk size; None without a
    remap."""
    if eval_cfg.rope_scaling not in REMAPS:
        return None
    remap = eval_remap(eval_cfg, train_len)
    record = {"near": remap.near, "window": remap.window, "shift": remap.shift,
              "factor": remap.factor}
    if remap.name == "dca":
        record["chunk"] = remap.chunk
    if remap.name == "streaming_llm":
        span = lambda_span(train_len, eval_cfg.get("lambda_sinks"), eval_cfg.get("lambda_window"))
        record.update(near=span.width, window=None)
    return record


def check_remap(eval_cfg, train_len: int) -> None:
    """Refuses, in one line, remap values that do not fit the training length L (the encoding's
    check: it knows L)."""
    remap = eval_remap(eval_cfg, train_len)
    key = "eval.rope_window"
    if remap.name == "rerope":
        require(remap.window <= train_len, key, remap.window,
                f"a window of at most train.seq_len={train_len} for rerope (lags below it keep "
                "RoPE's positions, which training saw only below L)")
    elif remap.name == "self_extend":
        require(remap.window < train_len, key, remap.window,
                f"a neighbour window below train.seq_len={train_len} for self_extend")
        factor = remap.factor
        require(factor is None or float(factor).is_integer(), "eval.rope_scaling_factor", factor,
                "an integer group size G >= 2 for self_extend, or null (the smallest G that fits "
                "each length)")
    elif remap.name in ("dca", "streaming_llm"):
        factor = eval_cfg.get("rope_scaling_factor")
        require(factor is None, "eval.rope_scaling_factor", factor,
                f"null for {remap.name} (it moves positions, it does not scale them)")
        if remap.name == "dca":
            require(remap.chunk <= train_len, "eval.rope_chunk", remap.chunk,
                    f"a chunk size of at most train.seq_len={train_len} for dca (its largest lag "
                    "is the chunk size)")
            # its chunks hold s - w tokens; the refusal names the value the command set (the
            # defaults always fit)
            if eval_cfg.get("rope_window") is None:
                named, value, want = "eval.rope_chunk", remap.chunk, (
                    f"a chunk size above DCA's local window {remap.window} (eval.rope_window, "
                    f"null: 1/8 of train.seq_len={train_len})")
            else:
                named, value, want = key, remap.window, (
                    f"a local window below DCA's chunk size {remap.chunk} (eval.rope_chunk, "
                    f"null: 3/4 of train.seq_len={train_len})")
            require(remap.window < remap.chunk, named, value, want)
        else:
            require(eval_cfg.get("attention", "global") == "lambda", "eval.rope_scaling",
                    "streaming_llm", "it with eval.attention=lambda (it gives the lambda mask's "
                    "keys their places in StreamingLLM's cache of sinks and window)")
            require(eval_cfg.get("lambda_sinks") != 0, "eval.lambda_sinks", 0,
                    "at least 1 with eval.rope_scaling=streaming_llm (a window alone keeps every "
                    "lag: plain RoPE)")
    else:
        require(eval_cfg.get("rope_scaling_factor") is None, "eval.rope_scaling_factor",
                eval_cfg.get("rope_scaling_factor"), "null for shifted_rope (it shifts lags, it "
                "does not scale them)")
        require(remap.shift <= train_len, "eval.rope_shift", remap.shift,
                f"a shift S of at most train.seq_len={train_len}")
        require(remap.window < remap.shift, key, remap.window,
                f"a local window W below the shift S={remap.shift} for shifted_rope (far lags "
                "d >= S land on d - S + W)")


@register("rope", "rotates each query/key pair by position times a geometric frequency")
class RoPE(PositionalEncoding):
    family = "rotary"
    relative = True
    rotary = True
    rope_remaps = True
    past_train_len = "unseen rotation angles on the slow pairs; perplexity usually climbs past L"
    reference = "RoFormer (Su et al. 2021)"

    remapping: Optional[Remap] = None  # the distance remap in effect, set with eval.rope_scaling
    longrope: Optional[LongRoPE] = None  # LongRoPE's factors, with eval.rope_scaling=longrope

    @dataclass
    class Config(EncodingConfig):
        base: float = 10000.0

    @classmethod
    def check(cls, cfg, run_cfg):
        if not cfg.base > 1:
            raise ConfigError(f"encoding.base={cfg.base} is not accepted; expected a number > 1")
        width = rotary_width(run_cfg.model)  # MLA's rotary part (model.decoupled_rope), if any
        key = "model.decoupled_rope_dim" if width else "model.d_model/model.n_head"
        head_dim = width or run_cfg.model.d_model // run_cfg.model.n_head
        if head_dim % 2:
            raise ConfigError(f"{key}={head_dim} is not accepted; rotary "
                              "encodings need an even head dimension")
        scalings = (run_cfg.eval.rope_scaling, run_cfg.train.get("rope_scaling", "none"))
        if any(s in ("ntk", "dynamic_ntk") for s in scalings) and head_dim < 4:
            raise ConfigError(f"{key}={head_dim} is not accepted with "
                              "NTK scaling; expected a head dimension >= 4 (b' uses d/(d-2))")
        if run_cfg.eval.rope_scaling in REMAPS:
            check_remap(run_cfg.eval, run_cfg.train.seq_len)

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        self.register_buffer("inv_freq", self.inv_freq_for(cfg.base), persistent=False)

    def inv_freq_for(self, base: float) -> torch.Tensor:
        """The frequencies at `base` (float64); NTK scaling asks again with its larger base."""
        return rope_inv_freq(self.dims.head_dim, base)

    def scale(self, n: int) -> float:
        """The scale s for a sequence of n tokens: eval.rope_scaling_factor when set (static),
        else max(1, n/L); dynamic_ntk reads the factor as HF's alpha (1 when null),
        s = max(1, alpha*n/L - (alpha-1)), which is n/L at alpha = 1."""
        ratio, factor = n / self.dims.scaling_len, self.rope_scaling_factor
        if self.rope_scaling == "dynamic_ntk":
            alpha = 1.0 if factor is None else factor
            return max(1.0, alpha * ratio - (alpha - 1))
        return max(1.0, ratio) if factor is None else factor

    def frequencies(self, n: int) -> Tuple[torch.Tensor, float]:
        """(theta, table factor) for a sequence of n tokens under eval.rope_scaling at scale
        self.scale(n); s = 1 leaves RoPE unchanged. LongRoPE's factors apply past L, or at every
        length once training applied them (train.rope_scaling=longrope), as its reference's
        rotary embedding does (posbench/encodings/longrope.py)."""
        if self.rope_scaling == "longrope":
            if n > self.dims.scaling_len or self.dims.train_scaling == "longrope":
                return self.longrope.inv_freq(self.inv_freq), self.longrope.attention_factor
            return self.inv_freq, 1.0
        s = 1.0 if self.rope_scaling in ("none", *REMAPS) else self.scale(n)
        if s == 1:
            return self.inv_freq, 1.0
        if self.rope_scaling == "pi":
            return self.inv_freq / s, 1.0
        if self.rope_scaling in ("ntk", "dynamic_ntk"):
            base = ntk_base(self.cfg.base, s, self.dims.head_dim)
            return self.inv_freq_for(base).to(self.inv_freq.device), 1.0
        if self.rope_scaling == "yarn":
            return (yarn_inv_freq(self.inv_freq, s, self.dims.head_dim, self.cfg.base,
                                  self.dims.scaling_len), yarn_attention_factor(s))
        if self.rope_scaling == "llama3":
            return llama3_inv_freq(self.inv_freq, s, self.dims.scaling_len), 1.0
        raise ValueError(f"rope_scaling={self.rope_scaling!r} is not implemented")

    def rotate(self, q, k, pos, layer):
        inv_freq, factor = self.frequencies(q.shape[2])
        cos, sin = rope_tables(pos, inv_freq, q.dtype, factor)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def flops(self, batch, length, pairs):
        # q and k rotated (x cos + rotate_half(x) sin: 3.5 per element), and the position row's
        # cos and sin (its angles, cos, sin and their factor: 4.5 per head coordinate)
        dims = self.dims
        rotated = dims.n_head * dims.head_dim  # per token: the heads' rotary parts under MLA
        return dims.n_layer * (7 * batch * length * rotated + 4.5 * length * dims.head_dim)

    def set_eval_options(self, rope_scaling="none", temperature=None, rope_scaling_factor=None,
                         randomized_positions="plain", rope_window=None, rope_shift=None,
                         rope_chunk=None, longrope_factors=None):
        """longrope_factors: a factors file's path, or the factors themselves (LongRoPE: the
        search's candidates)."""
        if rope_scaling in REMAPS and not self.rope_remaps:
            raise ValueError(f"rope_scaling={rope_scaling!r} needs RoPE's rotation alone, not "
                             f"{type(self).__name__}'s")
        super().set_eval_options(rope_scaling, temperature, rope_scaling_factor,
                                 randomized_positions, rope_window, rope_shift)
        self.longrope = None
        if rope_scaling == "longrope":
            self.longrope = (longrope_factors if isinstance(longrope_factors, LongRoPE) else
                             read_factors(longrope_factors, len(self.inv_freq),
                                          self.dims.scaling_len))
        # a remap needs two logits per (query, key): its hook rotates q and k itself, in place of
        # `rotate`, and the attention takes the remapped path (posbench/attention/paths.py)
        self.__dict__.pop("rotate", None)
        self.__dict__.pop("remap", None)
        self.remapping = None
        if rope_scaling in REMAPS:
            self.remapping = remap_for(rope_scaling, self.dims.train_len, rope_window, rope_shift,
                                       rope_scaling_factor, rope_chunk)
            self.rotate, self.remap = None, self.remapped_heads

    def remapped_heads(self, q, k, pos, layer, span: Span = GLOBAL):
        """The `remap` hook: (near_q, near_k, far_q, far_k, is_near) under the layer's `span`.
        Near keys (Remap.near_keys) see RoPE's rotations at their positions; far ones the
        rotations at Remap.far_positions, whose difference is the remapped lag."""
        n, remap = q.shape[2], self.remapping
        inv_freq, _ = self.frequencies(n)
        rows = pos[:1] if pos.stride(0) == 0 else pos
        near_q, near_k = (apply_rotary(x, *rope_tables(rows, inv_freq, q.dtype)) for x in (q, k))
        q_pos, k_pos = remap.far_positions(rows, n, span)
        far_q = apply_rotary(q, *rope_tables(q_pos, inv_freq, q.dtype))
        far_k = apply_rotary(k, *rope_tables(k_pos, inv_freq, k.dtype))
        # reads the batch-shared row once, as the tables above do
        return near_q, near_k, far_q, far_k, remap.near_keys(pos, span)
