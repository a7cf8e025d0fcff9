"""The encoding contract and the registry.

An encoding is an nn.Module registered under a name. The model and the attention ask it for hooks
and never branch on its name. A hook left as None does nothing:

- positions(pos) -> pos                 remap position ids (e.g. randomized positions in training)
- embed(x, pos, layer) -> x              add to the residual stream before block `layer`
- rotate(q, k, pos, layer) -> (q, k)     transform queries and keys, (B, H, T, d) each; they may
                                         come back wider than v (PoPE's are (B, H, T, 2d))
- score_mod(q, k, pos, layer) -> fn      fn(score, b, h, q_idx, kv_idx) -> score, FlexAttention's
                                         signature; `score` is already scaled by 1/sqrt(d). The same
                                         fn runs inside FlexAttention on CUDA and on broadcast
                                         index tensors in the blockwise CPU path. An encoding
                                         with reads_input also gets x=, the attention's input
- row_mod(logits, q, k, pos, layer, q_idx, kv_idx) -> logits
                                         rewrite whole masked rows of logits (needs the row, so it
                                         always takes the blockwise path); q and k are the whole
                                         (B, H, T, d) heads; with reads_input also x=
- value_mod(probs, pos, layer, q_idx, kv_idx) -> (B, H, Tq, d) added to the attention output
- mix_heads(q, k, pos, layer) -> (fn, channels)
                                         fn(logits, b, h, q_idx, kv_idx, hidden) -> logits, each
                                         (B, H, Tq, Tk): a block of query rows' scaled logits
                                         before any mask, rewritten from every head's values on
                                         the same row (DAPE's MLP and convolution); `hidden`
                                         marks the keys the query does not see, whose logits
                                         must not reach a seen key's result. `channels`: the
                                         most values fn holds per (query, key), which sizes the
                                         blocks. Always the blockwise path, in fp32 at least
- lag_rows(q, k, pos, layer) -> (q, fn) or None
                                         optional, beside an additive score_mod: the same
                                         attention for the CPU path at evaluation, where positions
                                         step by one. q comes back with the terms that read keys
                                         through their content folded in (Transformer-XL's u);
                                         fn(start, n, lags) -> (B or 1, H, n, len(lags)) is the
                                         rest of the bias of queries start..start+n-1 at each lag
                                         of the long tensor `lags` (negative lags are future keys:
                                         any finite value); None declines
                                         (posbench/attention/lag_bias.py)
- bias_factors(q, k, pos, layer) -> fn  optional, beside an additive score_mod whose bias is
                                         r_i + a_i . b_j, r constant along each row (which
                                         softmax ignores) and a, b of low rank R; with
                                         reads_input also x=. fn(o) -> (a, b), each (B or 1, H,
                                         T, R), measured from sequence index o (small near it).
                                         The CPU path at evaluation then gives each query a_i and
                                         each key b_j as R more coordinates
                                         (posbench/attention/lag_bias.py)
- lag_decay(layer) -> (H,) rates a <= 0
                                         optional: the score_mod is score * e^{a_h (pos_i - pos_j)}
                                         and nothing else; the CPU path at evaluation, where
                                         positions step by one, then scales q and k instead
                                         (posbench/attention/lag_bias.py)
- remap(q, k, pos, layer, span) -> (near_q, near_k, far_q, far_k, is_near)
                                         set only while an eval-time distance remap is (RoPE's
                                         rerope, self_extend, shifted_rope, dca, streaming_llm),
                                         with rotate None: the logit of query i and key j is
                                         near_q_i . near_k_j where is_near(b, q_idx, kv_idx),
                                         else far_q_i . far_k_j; `span` is the layer's
                                         (posbench/attention/span.py)

Beside the hooks, flops(batch, length, pairs) declares the encoding's own forward FLOPs
(train.budget=flops counts them, posbench/runs/budget.py): over every layer, for `batch`
sequences of `length` tokens of which `pairs` (query, key) pairs per sequence are scored, counted
from its formulas, a multiply-add as 2, any other arithmetic or transcendental operation on an
element as 1, and look-ups, copies, comparisons and clamps as 0. The default, 0, is for encodings
whose own work is negligible beside the model's: a table look-up added to the embeddings or to a
score.

`pos` is always a (B, T) long tensor. `q_idx`/`kv_idx` index the sequence, never positions: read
positions as pos[b, q_idx], and lags through `relative_lag(pos)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Dict, Optional, Tuple

import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from torch import nn

from posbench.core.errors import ConfigError, did_you_mean
from posbench.core.registry import Entry, Registry, typed_defaults

FAMILIES = ("none", "absolute", "rotary", "group", "bias", "contextual", "hybrid")
# the eval.* keys that evaluate() passes to set_eval_options, in its argument order
EVAL_OPTIONS = ("rope_scaling", "temperature", "rope_scaling_factor", "randomized_positions",
                "rope_window", "rope_shift", "rope_chunk", "longrope_factors")


@dataclass
class EncodingConfig:
    name: str = MISSING


@dataclass(frozen=True)
class Dims:
    """What an encoding may know about the model and the run when it is built."""

    n_layer: int
    n_head: int
    d_model: int
    train_len: int
    max_len: int
    # train.original_len: the length the rotary scalings count from, when not train_len (an
    # extension's: the first run of its lineage's)
    original_len: Optional[int] = None
    # where training's positions may reach past the sequence: PoSE's train.pose_span,
    # randomized's M; None: 0..T-1
    train_span: Optional[int] = None
    # train.rope_scaling, the rotary scaling training applied: a model trained with LongRoPE's
    # factors takes them at every length (posbench/encodings/rope.py: RoPE.frequencies)
    train_scaling: str = "none"
    # the width of each head's q and k parts the encoding acts on, when not d_model / n_head: MLA's
    # decoupled rotary part (model.decoupled_rope, posbench/attention/decoupled_rope.py)
    rotary_dim: Optional[int] = None

    @property
    def head_dim(self) -> int:
        """d, the width of each head's q and k that the encoding acts on."""
        return self.rotary_dim or self.d_model // self.n_head

    def train_positions(self, T: int) -> int:
        """Training's positions of a T-token sequence lie in [0, this): known without reading
        them, so that a training step needs no host sync for a table's size."""
        return max(T, self.train_span or 0)

    @property
    def scaling_len(self) -> int:
        """L of the rotary scalings: YaRN's original length and the dynamic scale n/L."""
        return self.original_len or self.train_len


class PositionalEncoding(nn.Module):
    family: ClassVar[str] = "none"
    # logits unchanged when every position is shifted by a constant
    relative: ClassVar[bool] = True
    # accepts eval.rope_scaling
    rotary: ClassVar[bool] = False
    # accepts its distance remaps too (rerope, self_extend, ...): the rotation is RoPE's
    # at the position, so that a remapped lag has a rotation
    rope_remaps: ClassVar[bool] = False
    # logits at positions < m do not change when the sequence grows past m
    prefix_consistent: ClassVar[bool] = True
    # behaviour past the training length, one line (docs/encodings.md is built from it)
    past_train_len: ClassVar[str] = ""
    reference: ClassVar[str] = ""
    # score_mod(score, ...) is score + a bias that does not read `score`: the CPU path then
    # evaluates the bias on zeros and runs fused SDPA with it as a float mask
    additive_score_mod: ClassVar[bool] = False
    # ...and that bias is a function of the head and the lag pos_i - pos_j alone (ALiBi, T5,
    # KERPLE, Sandwich): the CPU path then reads every block's mask from one table of lags
    # (posbench/attention/lag_bias.py) instead of building it
    lag_only_bias: ClassVar[bool] = False
    # score_mod(q, k, pos, layer, x=x) and row_mod(..., x=x) also receive the attention's input
    # x (B, T, D), after the block's LayerNorm: for terms computed from the tokens themselves
    # (FoX's forget gate)
    reads_input: ClassVar[bool] = False

    positions: Optional[Callable] = None
    embed: Optional[Callable] = None
    rotate: Optional[Callable] = None
    score_mod: Optional[Callable] = None
    row_mod: Optional[Callable] = None
    value_mod: Optional[Callable] = None
    mix_heads: Optional[Callable] = None
    lag_rows: Optional[Callable] = None
    lag_decay: Optional[Callable] = None
    bias_factors: Optional[Callable] = None
    remap: Optional[Callable] = None

    # what an encoding that wraps another (randomized, a training-time switch) takes from it
    HOOKS: ClassVar[Tuple[str, ...]] = ("positions", "embed", "rotate", "score_mod", "row_mod",
                                        "value_mod", "mix_heads", "lag_rows", "lag_decay",
                                        "bias_factors", "remap")
    FLAGS: ClassVar[Tuple[str, ...]] = ("relative", "prefix_consistent", "rotary",
                                        "additive_score_mod", "lag_only_bias", "reads_input")

    def __init__(self, cfg, dims: Dims):
        super().__init__()
        self.cfg = cfg
        self.dims = dims

    # eval-time options (the eval.* keys of EVAL_OPTIONS, docs/encodings.md), set by evaluate()
    # through set_eval_options; training never sets them, so a freshly built encoding has none.
    # Rotary encodings read the rope_scaling pair in rotate() (RoPE's distance remaps also
    # rope_window and rope_shift), the attention reads temperature, `randomized` reads
    # randomized_positions.
    rope_scaling: str = "none"
    rope_scaling_factor: Optional[float] = None
    temperature: Optional[str] = None
    randomized_positions: str = "plain"
    rope_window: Optional[int] = None
    rope_shift: Optional[int] = None

    def set_eval_options(self, rope_scaling: str = "none", temperature: Optional[str] = None,
                         rope_scaling_factor: Optional[float] = None,
                         randomized_positions: str = "plain", rope_window: Optional[int] = None,
                         rope_shift: Optional[int] = None, rope_chunk: Optional[int] = None,
                         longrope_factors=None) -> None:
        """Change the encoding at evaluation without retraining (config.check validates first).
        rope_chunk (DCA's chunk size) and longrope_factors (eval.longrope_factors, a file's path)
        are read by a rotary encoding."""
        if rope_scaling != "none" and not self.rotary:
            raise ValueError(f"rope_scaling={rope_scaling!r} needs a rotary encoding, "
                             f"not {type(self).__name__}")
        self.rope_scaling = rope_scaling
        self.rope_scaling_factor = rope_scaling_factor
        self.temperature = temperature
        self.randomized_positions = randomized_positions
        self.rope_window, self.rope_shift = rope_window, rope_shift

    def notes(self) -> list:
        """Caveats worth recording in results.json (e.g. untrained table rows)."""
        return []

    @classmethod
    def check(cls, cfg, run_cfg: DictConfig) -> None:
        """Raise ConfigError for values this encoding cannot use. `cfg` is the typed encoding
        config, `run_cfg` the whole composed config (model, train, eval)."""

    def longest_lag(self, pos: torch.Tensor) -> int:
        """The largest lag within a sequence of pos (B, T), or a bound of it: a table indexed by
        lag holds this plus one. In training it comes from Python ints (dims.train_positions), so
        that a step has no host sync and no graph break under train.compile. At evaluation a
        caller may pass any positions (offset, strided), so they are read, within each sequence
        only, never across two."""
        if self.in_training_step():
            return self.dims.train_positions(pos.shape[1]) - 1
        return int((pos.amax(1) - pos.amin(1)).max())

    def in_training_step(self) -> bool:
        """A training step's forward: the module in training mode and a gradient taken. Its
        positions are the run's own (dims.train_positions bounds them); any other forward may
        be handed any positions (a model left in training mode, scored under no_grad)."""
        return self.training and torch.is_grad_enabled()

    def at_layer(self, layer: int) -> Tuple["PositionalEncoding", int]:
        """The encoding whose hooks act at model layer `layer`, and the layer index they receive:
        itself and `layer`, but for a composition (`layers`) that gives each layer its own."""
        return self, layer

    def at_step(self, step: int) -> None:
        """Called by training before every step: an encoding that changes with the step (the
        switch of train.switch_encoding_at, posbench/model/schedule.py) takes its state for
        `step`."""

    def flops(self, batch: int, length: int, pairs: int) -> float:
        """Forward FLOPs of this encoding's own work over every layer (the contract's counting
        rules, above): `batch` sequences of `length` tokens, `pairs` scored (query, key) pairs
        per sequence. Work on one position row is counted once, as the batch shares it."""
        return 0.0

    def attention_options(self, layer: int) -> Dict[str, str]:
        """What this encoding sets of model layer `layer`'s attention, over the model's keys:
        {"attention": ..., "temperature": ...} or part of it; {} keeps model.attention and
        model.temperature (read once, when the model is built)."""
        return {}


_REGISTRY = Registry(PositionalEncoding, group="encoding")


def register(name: str, description: str, config: Optional[EncodingConfig] = None):
    """Class decorator: make `cls` available as `encoding=<name>` with default `config`
    (cls.Config() when omitted). One class may be registered under several names (presets)."""

    def wrap(cls):
        assert cls.family in FAMILIES, (name, cls.family)
        return _REGISTRY.add(cls, name, description, config)

    return wrap


def registry() -> Dict[str, Entry]:
    return _REGISTRY.by_name()


def encoding_class(enc_cfg: DictConfig) -> type:

    if "_target_" in enc_cfg:  # a user's own encoding from outside the package
        from hydra.utils import get_class

        cls = get_class(enc_cfg._target_)
        if not (isinstance(cls, type) and issubclass(cls, PositionalEncoding)):
            raise ConfigError(f"encoding._target_={enc_cfg._target_!r} is not accepted; "
                              "expected a subclass of posbench.encodings.PositionalEncoding")
        return cls
    name = enc_cfg.get("name")
    if name not in _REGISTRY:
        raise ConfigError(f"encoding={name!r} is not accepted{did_you_mean(name, _REGISTRY)}; "
                          "expected one of: "
                          + ", ".join(sorted(_REGISTRY)))
    return _REGISTRY[name].cls


def encoding_config(run_cfg: DictConfig):
    """The typed config object of the run's encoding, checked against its dataclass and ranges."""

    enc_cfg = run_cfg.encoding
    cls = encoding_class(enc_cfg)
    values = {k: v for k, v in OmegaConf.to_container(enc_cfg, resolve=True).items() if k != "_target_"}
    schema = cls.Config if "_target_" in enc_cfg else type(_REGISTRY[enc_cfg.name].config)
    try:
        typed = OmegaConf.merge(typed_defaults(schema), values)
    except Exception as err:  # omegaconf's message names the key and the type
        name = enc_cfg.get("_target_") or enc_cfg.get("name")
        key = getattr(err, "full_key", None)
        raise ConfigError(f"encoding={name}: " + (f"encoding.{key}: " if key else "")
                          + str(err).splitlines()[0]) from None
    obj = OmegaConf.to_object(typed)
    cls.check(obj, run_cfg)
    return obj


def build_encoding(run_cfg: DictConfig, dims: Dims) -> PositionalEncoding:
    return encoding_class(run_cfg.encoding)(encoding_config(run_cfg), dims)


def positions_for(idx: torch.Tensor, pos: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, T) long positions from the optional (T,) or (B, T) `pos` of the public API."""
    B, T = idx.shape
    if pos is None:
        pos = torch.arange(T, device=idx.device)
    pos = pos.to(device=idx.device, dtype=torch.long)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    return pos.expand(B, T)


def relative_lag(pos: torch.Tensor) -> Callable:
    """A score_mod's (b, q_idx, kv_idx) -> pos_i - pos_j. A position row shared by the batch (the
    model's expanded arange, stride 0) is read once, so that the CPU path builds a bias at
    (1, H, Tq, Tk) rather than (B, H, Tq, Tk)."""
    if pos.stride(0) == 0:
        row = pos[0]
        return lambda b, q_idx, kv_idx: row[q_idx] - row[kv_idx]
    return lambda b, q_idx, kv_idx: pos[b, q_idx] - pos[b, kv_idx]
