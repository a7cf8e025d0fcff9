"""Typed config schema: one dataclass per component, checked when Hydra composes.

Every config group is typed here, so a misspelled key or a wrong type fails at compose time with
the key's name, before any work starts. Encodings register their own dataclass (see
posbench/encodings/base.py); `check()` validates the values that types alone cannot.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from posbench import evaluations
from posbench.attention.paths import ATTN_GATES
from posbench.data import check_dataset, dataset_class, registry as dataset_registry
from posbench.core.errors import ConfigError, did_you_mean, require, require_positive
from posbench.core.registry import typed_defaults
from posbench.evaluations import EvalConfig
from posbench.evaluations.ruler_tasks import DEFAULT_TASKS as RULER_TASKS


@dataclass
class ModelConfig:
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    # which keys a query sees in every layer (a `layers` encoding may set it per layer kind):
    # global (all earlier ones), sliding (the attention_window most recent), chunked (those of
    # its own chunk of attention_window tokens); posbench/attention/span.py
    attention: str = "global"
    # the width w of sliding and chunked layers, in tokens; null: train.seq_len // 4
    attention_window: Optional[int] = None
    # softmax temperature of every layer (a `layers` encoding may set it per layer kind), a
    # factor on each query row: none, logn, ssmax (learned), llama4_floorlog, yarn, drope_beta
    # (posbench/attention/temperature.py); applied in training and evaluation alike
    temperature: str = "none"
    # RMSNorm with a learned gain on q and on k over the model width, before any encoding acts
    # (the QK-norm of DroPE's code, which lets its SmolLM recalibration run at high learning rates)
    qk_norm: bool = False
    # a sigmoid gate on each head's attention output, from the layer's input, before the output
    # projection (Qiu et al. 2025, Qwen3-Next): none, headwise (one per head) or elementwise
    # (one per channel, the paper's best and Qwen3-Next's)
    attn_gate: str = "none"
    # a learned logit per head in every softmax denominator that adds no value (gpt-oss's sinks)
    attn_sinks: bool = False
    # MLA's decoupled RoPE (DeepSeek-V2): the heads' q and k keep an unrotated content part and
    # gain a rotary part, q's per head, k's one for all heads, that the (rotary) encoding turns
    decoupled_rope: bool = False
    # that part's width per head, even; null: half the head dimension (DeepSeek-V2: 64 of 128)
    decoupled_rope_dim: Optional[int] = None


@dataclass
class TrainConfig:
    seq_len: int = 128
    # 2000 steps of 16 windows rather than 1000 of 32, the same tokens and compute: the absolute
    # encodings learn to attend by position per optimizer step, and at 1000 steps sinusoidal
    # ended 30% behind RoPE at the training length, at 2000 steps 11% (docs/results.md)
    steps: int = 2000
    batch_size: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    # learning rate of the encoding's own parameters relative to lr: Adam moves a parameter by
    # about lr per step, and a learned bias must reach several logits within the budget
    position_lr_mult: float = 10.0
    grad_clip: float = 1.0
    log_every: int = 50
    # validation loss at the training length every this many steps (0: never), on train.batch_size
    # fixed validation windows, into metrics.csv and loss_vs_step.png
    val_every: int = 250
    # a checkpoint every this many steps (0: only at the end); a killed run resumes from the last
    ckpt_every: int = 250
    # continue the run dir's checkpoint, or skip a finished run; false refuses a used run dir
    resume: bool = True
    compile: bool = False
    # fraction of training sequences replaced by passkey sequences in eval.retrieval's format,
    # drawn per (seed, step) (posbench/evaluations/retrieval.py): part of the training
    # distribution. A tiny model trained on text alone never learns to copy; at 0.5 RoPE does
    # after 2000-8000 steps of a 16000-step run, by seed (docs/results.md, "Retrieval")
    retrieval_mix: float = 0.0
    # fraction of training sequences replaced by instances of RULER's tasks as eval.ruler builds
    # them (at its default counts), a task of ruler_tasks and a depth drawn per (seed, step, row)
    # (posbench/evaluations/ruler.py); with retrieval_mix, on other rows, the two sum below 1.
    # At 0.5 the tiny model learns them between steps 2000 and 3000 (ALiBi) and 4000 and 5000
    # (RoPE) of a 6000-step run (docs/results.md, "RULER's formats in training")
    ruler_mix: float = 0.0
    # any of eval.ruler's tasks; by default all but cwe and fwe, which are asked for by name
    ruler_tasks: List[str] = field(default_factory=lambda: list(RULER_TASKS))
    # train with switch_encoding_to instead of the encoding from this fraction of train.steps on
    # (null: never): DroPE drops RoPE for nope for the last 1/8 (0.875); posbench/model/schedule.py
    switch_encoding_at: Optional[float] = None
    switch_encoding_to: str = "nope"
    # continue from another run's weights: the finished run dir whose checkpoint starts this one
    # (an extension: posbench extend, posbench/runs/extend.py); optimizer, schedule and step start
    # afresh
    init_from: Optional[str] = None
    # the length the rotary scalings count from (YaRN's original length, the dynamic scale n/L):
    # an extension keeps the first run of its lineage's; null: train.seq_len
    original_len: Optional[int] = None
    # a rotary scaling to train with, as eval.rope_scaling evaluates: none, pi, ntk, yarn or
    # llama3, with a static factor, or null (dynamic); or longrope, with longrope_factors, the
    # JSON file of LongRoPE's factors for the length training reaches, applied at every length
    rope_scaling: str = "none"
    rope_scaling_factor: Optional[float] = None
    longrope_factors: Optional[str] = None
    # PoSE (Zhu et al. 2024): each training window's positions skip so that they span this many,
    # a longer context simulated in train.seq_len tokens; null: 0 .. seq_len-1
    pose_span: Optional[int] = None
    # perplexity at eval.lengths (and retrieval when enabled) before the first step and every
    # this many steps, into eval_vs_step.csv and .png (0: only at the end, into results.json)
    eval_every: int = 0
    # what every run of a comparison spends alike (posbench/runs/budget.py): tokens (train.steps
    # steps), flops (the training FLOPs budget_reference spends in train.steps steps; each
    # encoding takes as many steps as they pay for) or wallclock (budget_seconds of training)
    budget: str = "tokens"
    budget_reference: str = "rope"
    budget_seconds: Optional[float] = None
    # a short-to-long attention window (posbench/runs/lengths.py): none, or skyladder (Zhu et al.
    # 2025): windows of min(L, length_start + floor(step / length_every)) tokens, SkyLadder's
    # reference defaults (32 tokens, one more every 8 steps: its alpha = 1/8)
    length_schedule: str = "none"
    length_start: int = 32
    length_every: int = 8
    # rows of whole documents back to back, attention and positions restarting at each
    # document's start (text corpora; posbench/data/tokens.py: TokenData.document_batch)
    pack_documents: bool = False


@dataclass
class LoggerConfig:
    name: str = "none"
    mode: str = "offline"
    project: str = "posbench"
    entity: Optional[str] = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    encoding: Any = MISSING
    # a registered dataset's own config (posbench/data/base.py), checked by check_dataset
    dataset: Any = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    # the perplexity protocol's keys and a node per section (posbench/evaluations/): schema()
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    device: str = "auto"


ROPE_SCALINGS = ("none", "pi", "ntk", "dynamic_ntk", "yarn", "llama3", "longrope", "rerope",
                 "self_extend", "shifted_rope", "dca", "streaming_llm")
ROPE_REMAPS = ROPE_SCALINGS[7:]  # of relative distances, not of frequencies
# the remaps that read eval.rope_window (streaming_llm's window is eval.lambda_window)
WINDOWED_REMAPS = ROPE_REMAPS[:-1]
# train.rope_scaling: static or dynamic, or LongRoPE's factors
TRAIN_ROPE_SCALINGS = ("none", "pi", "ntk", "yarn", "llama3", "longrope")
RANDOMIZED_POSITIONS = ("random", "plain")
BUDGETS = ("tokens", "flops", "wallclock")  # train.budget
SCHEDULES = ("none", "skyladder")  # train.length_schedule
# the temperatures that count a query's keys by its sequence index, not by its document's
INDEX_TEMPERATURES = ("ssmax", "llama4_floorlog")
DEVICES = ("auto", "cpu", "cuda")
LOGGERS = ("none", "wandb")
LOGGER_MODES = ("offline", "online", "disabled")


def schema() -> type:
    """Config with its `eval` node holding every registered section's (eval.retrieval, ...)."""
    return _schema(evaluations.eval_schema())


@functools.lru_cache(maxsize=None)
def _schema(eval_schema: type) -> type:  # one class per eval schema, so that typed configs merge
    return dataclasses.make_dataclass(
        "Config", [("eval", eval_schema, field(default_factory=eval_schema))], bases=(Config,))


def schema_class(name: str) -> Optional[type]:
    """The schema's dataclass called `name` (OmegaConf's messages name it), or None."""
    found, todo = [], [schema()]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += [f.default_factory for f in dataclasses.fields(cls)
                 if dataclasses.is_dataclass(f.default_factory)]
    return next((cls for cls in found if cls.__name__ == name), None)


def schema_keys(prefix: str) -> list:
    """The keys the schema types below `prefix` ("eval.retrieval"; "" for the top), or [] where
    it types none (an encoding's, a dataset's)."""
    cls = schema()
    for part in filter(None, prefix.split(".")):
        sub = {f.name: f.default_factory for f in dataclasses.fields(cls)}.get(part)
        if not dataclasses.is_dataclass(sub):
            return []
        cls = sub
    return [f.name for f in dataclasses.fields(cls)]


def register_schemas() -> None:
    # first in config.yaml's defaults: every group merged after it is checked against these types
    ConfigStore.instance().store(name="posbench_schema", node=schema())


# Hydra 1.3 deep-copies its config repository, and with it the ConfigStore and every node stored
# in it, once per composition and once per config group that `--help` lists (about 130: seconds).
# The store is one per process and a copy of it is never changed, so copies share it, as Hydra's
# later sources do by reading the live store (facebookresearch/hydra PR 2928, not in 1.3.x)
ConfigStore.__deepcopy__ = lambda self, memo: self


# Hydra merges conf/encoding/NAME.yaml into the ConfigStore schema called encoding/NAME (see
# register_target_schema), and warns in four lines that this matching is deprecated (Hydra 1.3
# still does it, and nothing else types a config file without a defaults list in it)
warnings.filterwarnings("ignore", category=UserWarning,
                        message=r"\s*'encoding/\S+' is validated against ConfigStore schema")


def register_target_schema(cfg: DictConfig) -> bool:
    """An encoding config file with `_target_` (the user's own class) is typed by its class's
    Config: stored as the ConfigStore schema of the file's name, which Hydra merges the file into,
    so that `encoding.KEY=VALUE` overrides a field the file does not set, and a class that
    registers itself under the file's name (whose schema has no `_target_`) no longer clashes with
    it. `cfg`: a composed config with its hydra node, which names the file chosen; Hydra sees the
    schema from the next composition on. Returns whether it stored one."""
    from posbench.encodings.base import encoding_class

    target = cfg.encoding.get("_target_")
    if target is None:
        return False
    typed = OmegaConf.structured(encoding_class(cfg.encoding).Config)  # imports the class
    with open_dict(typed):
        typed._target_ = target
    ConfigStore.instance().store(group="encoding", name=cfg.hydra.runtime.choices.encoding,
                                 node=typed)
    return True


def _no_extra_keys(node: DictConfig, schema: type, prefix: str = "") -> None:
    """Keys added with `+key=...` bypass the schema's struct mode; refuse them here."""
    known = [f.name for f in dataclasses.fields(schema)]
    for key in node:
        if key == "hydra":
            continue
        if key not in known:
            raise ConfigError(f"{prefix}{key} is not a config key; expected one of: "
                              + ", ".join(known))
        sub = getattr(schema, "__dataclass_fields__")[key].default_factory
        if dataclasses.is_dataclass(sub) and isinstance(node[key], DictConfig):
            _no_extra_keys(node[key], sub, f"{prefix}{key}.")


def _check_rope_scaling_factor(node, prefix: str = "eval") -> None:
    factor = node.get("rope_scaling_factor")  # absent from runs saved before it existed
    if factor is None:
        return
    require(node.get("rope_scaling", "none") != "none", f"{prefix}.rope_scaling_factor", factor,
            f"null with {prefix}.rope_scaling=none (nothing is scaled)")
    require(math.isfinite(factor) and factor > 1, f"{prefix}.rope_scaling_factor", factor,
            "a finite number > 1 (the static scale s; dynamic_ntk's alpha), or null (dynamic)")


def _check_training_extension(cfg) -> None:
    """The train.* keys of continued training at a longer length (posbench/runs/extend.py); whether
    train.init_from holds a finished run is checked when the run starts (posbench/runs/run.py)."""
    from posbench.encodings.base import encoding_class

    t = cfg.train
    scaling = t.get("rope_scaling", "none")  # absent from runs saved before they existed
    require(scaling in TRAIN_ROPE_SCALINGS, "train.rope_scaling", scaling,
            f"one of: {', '.join(TRAIN_ROPE_SCALINGS)}{did_you_mean(scaling, TRAIN_ROPE_SCALINGS)}")
    require(scaling == "none" or encoding_class(cfg.encoding).rotary, "train.rope_scaling",
            scaling, f"'none' for encoding={cfg.encoding.get('name')}, which does not rotate q "
            "and k")
    _check_rope_scaling_factor(t, "train")
    for key in ("original_len", "pose_span"):
        if t.get(key) is not None:
            require_positive(f"train.{key}", t[key])
    require(t.get("pose_span") is None or t.pose_span > t.seq_len, "train.pose_span",
            t.get("pose_span"), f"a span above train.seq_len={t.seq_len}, or null")
    require(t.get("eval_every", 0) >= 0, "train.eval_every", t.get("eval_every"),
            "an integer >= 0 (0: no evaluation during training)")
    factors = _check_longrope(cfg, "train")
    if factors is not None:  # LongRoPE fine-tunes at the length its factors were searched for
        target = t.get("pose_span") or t.seq_len
        require(factors.length == target, "train.longrope_factors", t.longrope_factors,
                f"a file whose `length` is the length training reaches, {target} "
                f"(train.pose_span, else train.seq_len): LongRoPE fine-tunes at the length its "
                f"factors were searched for; the file holds {factors.length}")


def _check_rope_remap(cfg) -> None:
    """The remap keys' types and which rope_scaling they belong to; their ranges against the
    training length are the encoding's check (posbench/encodings/rope.py: check_remap)."""
    scaling = cfg.eval.rope_scaling
    window, shift = cfg.eval.get("rope_window"), cfg.eval.get("rope_shift")  # older runs lack them
    if window is not None:
        require(scaling in WINDOWED_REMAPS, "eval.rope_window", window,
                f"null unless eval.rope_scaling is one of {WINDOWED_REMAPS}")
        require_positive("eval.rope_window", window)
    if shift is not None:
        require(scaling == "shifted_rope", "eval.rope_shift", shift,
                "null unless eval.rope_scaling=shifted_rope")
        require(isinstance(shift, int) and shift >= 2, "eval.rope_shift", shift,
                "an integer >= 2 (STRING's S)")
    chunk = cfg.eval.get("rope_chunk")  # absent from runs saved before it existed
    if chunk is not None:
        require(scaling == "dca", "eval.rope_chunk", chunk, "null unless eval.rope_scaling=dca")
        require_positive("eval.rope_chunk", chunk)
    from posbench.encodings.base import encoding_class, registry

    if scaling in ROPE_REMAPS and not encoding_class(cfg.encoding).rope_remaps:
        remappable = [name for name, entry in registry().items() if entry.cls.rope_remaps]
        require(False, "eval.rope_scaling", scaling,
                "none, pi, ntk, dynamic_ntk, yarn or llama3 for encoding="
                f"{cfg.encoding.get('name')}; "
                f"the remaps apply to the encodings that rotate by RoPE alone: "
                + ", ".join(remappable))


def _check_longrope(cfg, prefix: str):
    """eval.longrope_factors (prefix "eval") or train.longrope_factors (prefix "train"), which
    that node's rope_scaling=longrope needs and nothing else reads; the file's values against the
    rotary head and the training length are read now, so that a bad file is refused before any
    work (posbench/encodings/longrope.py). The factors read, or None without longrope."""
    from posbench.encodings.longrope import HOW, run_factors

    node, key = cfg[prefix], f"{prefix}.longrope_factors"
    path = node.get("longrope_factors")  # absent from runs saved before it existed
    if node.get("rope_scaling", "none") != "longrope":
        require(path is None, key, path, f"null unless {prefix}.rope_scaling=longrope")
        return None
    require(path is not None, key, path, f"the path of a JSON file of LongRoPE factors with "
            f"{prefix}.rope_scaling=longrope {HOW}")
    factor = node.get("rope_scaling_factor")
    require(factor is None, f"{prefix}.rope_scaling_factor", factor,
            "null for longrope (its file holds a factor per pair and the length they fit)")
    return run_factors(cfg, prefix)


def _check_attention(m) -> None:
    from posbench.attention.span import ATTENTIONS

    # runs saved before these keys existed take their defaults
    attention = m.get("attention", ModelConfig.attention)
    require(attention in ATTENTIONS, "model.attention", attention,
            f"one of {ATTENTIONS}{did_you_mean(attention, ATTENTIONS)}")
    window = m.get("attention_window")
    if window is not None:
        require_positive("model.attention_window", window)
    gate = m.get("attn_gate", ModelConfig.attn_gate)
    require(gate in ATTN_GATES, "model.attn_gate", gate,
            f"one of {ATTN_GATES}{did_you_mean(gate, ATTN_GATES)}")


def _check_decoupled_rope(cfg) -> None:
    """model.decoupled_rope needs an encoding that rotates q and k (its rotary parts are what it
    rotates) and an even width; RoPE's distance remaps, which rotate the whole q and k, are
    refused with it."""
    from posbench.attention.decoupled_rope import rotary_width
    from posbench.encodings.base import encoding_class, registry

    m = cfg.model
    width = m.get("decoupled_rope_dim")  # absent from runs saved before it existed
    if not m.get("decoupled_rope", False):
        require(width is None, "model.decoupled_rope_dim", width,
                "null unless model.decoupled_rope=true")
        return
    name = cfg.encoding.get("name")
    rotary = [n for n, entry in registry().items() if entry.cls.rotary]
    require(encoding_class(cfg.encoding).rotary, "model.decoupled_rope", True,
            f"false for encoding={name}, which does not rotate q and k (those that do: "
            + ", ".join(rotary) + ")")
    width = rotary_width(m)
    key = "model.decoupled_rope_dim" if m.get("decoupled_rope_dim") is not None else (
        "model.decoupled_rope_dim (null: half of model.d_model/model.n_head)")
    require(width >= 2 and width % 2 == 0, key, width, "an even width >= 2")
    require(cfg.eval.rope_scaling not in ROPE_REMAPS, "eval.rope_scaling", cfg.eval.rope_scaling,
            "a scaling of the frequencies with model.decoupled_rope=true (a distance remap "
            "rotates the whole q and k)")


def _check_eval_attention(cfg) -> None:
    """eval.attention and its keys: a lambda mask replaces global layers' causal one, so a model
    needs one; the keys are read by lambda alone."""
    from posbench.attention.span import EVAL_ATTENTIONS

    attention = cfg.eval.get("attention", "global")  # absent from runs saved before it existed
    require(attention in EVAL_ATTENTIONS, "eval.attention", attention,
            f"one of {EVAL_ATTENTIONS}{did_you_mean(attention, EVAL_ATTENTIONS)}")
    sinks, window = cfg.eval.get("lambda_sinks"), cfg.eval.get("lambda_window")
    for key, value in (("lambda_sinks", sinks), ("lambda_window", window)):
        require(value is None or attention == "lambda", f"eval.{key}", value,
                "null unless eval.attention=lambda")
    require(sinks is None or sinks >= 0, "eval.lambda_sinks", sinks,
            "an integer >= 0 (0: the window alone), or null (4)")
    if window is not None:
        require_positive("eval.lambda_window", window)
    # a `layers` pattern's own spans, else the model's
    spans = list(cfg.encoding.get("attention") or []) or [cfg.model.get("attention", "global")]
    require(attention != "lambda" or "global" in spans, "eval.attention", attention,
            f"'global' for a model whose layers attend {'/'.join(dict.fromkeys(spans))} only: "
            "the lambda mask replaces a global layer's")


def _check_temperature(cfg) -> None:
    from posbench.attention.temperature import LEARNED, TEMPERATURES

    kind = cfg.model.get("temperature", ModelConfig.temperature)  # absent from older runs
    require(kind in TEMPERATURES, "model.temperature", kind,
            f"one of {TEMPERATURES}{did_you_mean(kind, TEMPERATURES)}")
    fixed = [t for t in TEMPERATURES if t not in LEARNED]
    at_eval = cfg.eval.get("temperature")
    if at_eval is not None:
        require(at_eval in fixed, "eval.temperature", at_eval,
                f"null or one of {tuple(fixed)}{did_you_mean(at_eval, fixed)} (a learned "
                "temperature is trained: model.temperature)")
    require("logn" not in (kind, at_eval) or cfg.train.seq_len > 1, "train.seq_len",
            cfg.train.seq_len, "more than 1 token with temperature logn (it divides by ln L)")


def _check_budget(t) -> None:
    from posbench.encodings.base import registry

    budget = t.get("budget", "tokens")  # absent from runs saved before it existed
    require(budget in BUDGETS, "train.budget", budget,
            f"one of {BUDGETS}{did_you_mean(budget, BUDGETS)}")
    seconds = t.get("budget_seconds")
    if budget == "wallclock":
        require(seconds is not None and math.isfinite(seconds) and seconds > 0,
                "train.budget_seconds", seconds,
                "a number of seconds > 0 with train.budget=wallclock (how long to train)")
    else:
        require(seconds is None, "train.budget_seconds", seconds,
                f"null with train.budget={budget} (only wallclock trains by the clock)")
    entries = registry()
    reference = t.get("budget_reference", TrainConfig.budget_reference)
    require(reference in entries, "train.budget_reference", reference,
            f"a registered encoding{did_you_mean(reference, entries)}, whose train.steps steps "
            "set train.budget=flops's FLOPs")
    require(budget == "tokens" or t.get("switch_encoding_at") is None, "train.switch_encoding_at",
            t.get("switch_encoding_at"), f"null with train.budget={budget} (the switch is a "
            "fraction of train.steps)")


def _check_lengths(cfg) -> None:
    """train.length_schedule and train.pack_documents (posbench/runs/lengths.py); an encoding
    that cannot read packed documents refuses them in its own check."""
    t = cfg.train
    schedule = t.get("length_schedule", "none")  # absent from runs saved before it existed
    require(schedule in SCHEDULES, "train.length_schedule", schedule,
            f"one of {SCHEDULES}{did_you_mean(schedule, SCHEDULES)}")
    if schedule != "none":
        require(isinstance(t.length_start, int) and 1 <= t.length_start <= t.seq_len,
                "train.length_start", t.length_start,
                f"a first window of 1 to train.seq_len={t.seq_len} tokens")
        require(t.length_every >= 1, "train.length_every", t.length_every,
                "an integer >= 1 (steps per token the window grows)")
    if not t.get("pack_documents", False):
        return
    require(dataset_class(cfg.dataset).text, "train.pack_documents", True,
            f"false with dataset={cfg.dataset.name}: a task's instances are not documents")
    for key in ("pose_span", "retrieval_mix", "ruler_mix"):
        require(not t.get(key), f"train.{key}", t.get(key),
                f"{'null' if key == 'pose_span' else 0} with train.pack_documents=true (it sets "
                f"{'the positions' if key == 'pose_span' else 'whole rows'} itself)")
    # a `layers` pattern's own spans and temperatures, and the model's
    for node, prefix in ((cfg.encoding, "encoding"), (cfg.model, "model")):
        spans, temperatures = node.get("attention") or [], node.get("temperature") or []
        spans, temperatures = (v if isinstance(v, str) else list(v) for v in (spans, temperatures))
        require("chunked" not in spans, f"{prefix}.attention", spans,
                "global or sliding with train.pack_documents=true: chunks count from the row's "
                "start, not from each document's")
        for kind in INDEX_TEMPERATURES:
            require(kind not in temperatures, f"{prefix}.temperature", temperatures,
                    "none, logn, yarn or drope_beta with train.pack_documents=true: "
                    f"{kind} counts a query's keys by its index in the row, not in its document")


def _check_switch(cfg) -> None:
    from posbench.encodings.base import registry

    fraction = cfg.train.get("switch_encoding_at")  # absent from runs saved before it existed
    if fraction is None:
        return
    require(0 < fraction < 1, "train.switch_encoding_at", fraction,
            "a fraction of train.steps in (0, 1), or null (no switch)")
    entries = registry()
    target = cfg.train.switch_encoding_to
    require(target in entries, "train.switch_encoding_to", target,
            f"a registered encoding{did_you_mean(target, entries)}: " + ", ".join(entries))
    entry = entries[target]
    require(cfg.eval.rope_scaling == "none" or entry.cls.rotary, "eval.rope_scaling",
            cfg.eval.rope_scaling, f"'none' for train.switch_encoding_to={target}, which the "
            "model is evaluated with and does not rotate q and k")
    entry.cls.check(entry.config, cfg)


def rename_saved_keys(cfg: DictConfig) -> None:
    """A run saved before eval.temperature existed holds eval.logn_scaling, which it replaced:
    true is eval.temperature=logn. Renamed in place, so that its saved config still checks and
    evaluates as it did."""
    if "eval" in cfg and "logn_scaling" in cfg.eval:
        with open_dict(cfg):
            if cfg.eval.pop("logn_scaling") and cfg.eval.get("temperature") is None:
                cfg.eval.temperature = "logn"


# the groups whose every key the schema types with its default (an encoding's and a dataset's
# own keys default in their own Config classes)
TYPED_GROUPS = ("model", "train", "eval", "logger")


def _merged(defaults: dict, saved: dict) -> dict:
    return {**defaults, **{key: _merged(defaults[key], value)
                           if isinstance(value, dict) and isinstance(defaults.get(key), dict)
                           else value for key, value in saved.items()}}


@functools.lru_cache(maxsize=None)
def _schema_defaults(cls: type) -> dict:
    """The schema's defaults as a plain tree (built once: a report reads hundreds of runs). From
    the dataclasses themselves: in the process that ends a Hydra multirun under the joblib
    launcher, OmegaConf.structured(schema()) fails to read the string annotations of its fields."""
    return dataclasses.asdict(cls())


def with_defaults(saved) -> DictConfig:
    """A saved run's config as the current schema reads it: renamed keys renamed, and every key
    added to model, train, eval, logger, its dataset or its encoding since the run was saved at
    its default (the registered preset's value), which is what the run did. So a run saved by an
    older posbench is still skipped or resumed by the same command, and re-scored or extended
    with overrides of the new keys."""
    cfg = OmegaConf.create(saved if isinstance(saved, dict) else to_container(saved))
    rename_saved_keys(cfg)
    defaults = _schema_defaults(schema())
    tree = to_container(cfg)
    for group in TYPED_GROUPS:
        if isinstance(tree.get(group), dict):
            tree[group] = _merged(defaults[group], tree[group])
    from posbench.encodings import registry as encoding_registry

    for group, registered in (("dataset", dataset_registry()), ("encoding", encoding_registry())):
        node = tree.get(group)
        if isinstance(node, dict) and "_target_" not in node and node.get("name") in registered:
            preset = dataclasses.asdict(registered[node["name"]].config)
            tree[group] = _merged(preset, node)
    return OmegaConf.create(tree)


def check(cfg: DictConfig) -> None:
    """Checks types (also of configs that did not come through the schema, such as a saved run's),
    ranges, choices, and the encoding's own values."""
    from posbench.encodings.base import encoding_class, encoding_config

    rename_saved_keys(cfg)
    # a config Hydra composed is typed by the schema already (config.yaml's first default), and
    # holds no value of another type; merging it again would cost a fifth of a composition
    if OmegaConf.get_type(cfg) is not schema():
        try:
            # as plain data: a config pickled into a joblib worker comes back typed with the
            # base Config class, which does not merge into the schema's per-evaluation subclass
            OmegaConf.merge(typed_defaults(schema()), OmegaConf.to_container(cfg))
        except Exception as err:  # omegaconf names the key and the expected type
            raise ConfigError(str(err).splitlines()[0]) from None
    _no_extra_keys(cfg, schema())

    m = cfg.model
    for key in ("n_layer", "n_head", "d_model", "mlp_ratio"):
        require_positive(f"model.{key}", m[key])
    require(m.d_model % m.n_head == 0, "model.d_model", m.d_model,
             f"a multiple of model.n_head={m.n_head}")
    _check_attention(m)
    for key in ("seq_len", "steps", "batch_size", "log_every"):
        require_positive(f"train.{key}", cfg.train[key])
    require(cfg.train.ckpt_every >= 0, "train.ckpt_every", cfg.train.ckpt_every,
             "an integer >= 0 (0: a checkpoint only at the end)")
    val_every = cfg.train.get("val_every", 0)  # absent from runs saved before it existed
    require(val_every >= 0, "train.val_every", val_every,
             "an integer >= 0 (0: no validation during training)")
    require(cfg.train.lr > 0, "train.lr", cfg.train.lr, "a positive number")
    require(cfg.train.position_lr_mult > 0, "train.position_lr_mult",
             cfg.train.position_lr_mult, "a positive number")
    require(0 <= cfg.train.warmup_steps, "train.warmup_steps", cfg.train.warmup_steps,
             "an integer >= 0")
    evaluations.check(cfg)  # the protocol's keys and every section's
    # first: `posbench extend` evaluates with train.rope_scaling unless told otherwise, and a
    # refusal names the key the user set
    _check_training_extension(cfg)
    scaling = cfg.eval.rope_scaling
    require(scaling in ROPE_SCALINGS, "eval.rope_scaling", scaling,
            f"one of: {', '.join(ROPE_SCALINGS)}{did_you_mean(scaling, ROPE_SCALINGS)}")
    require(cfg.eval.rope_scaling == "none" or encoding_class(cfg.encoding).rotary,
             "eval.rope_scaling", cfg.eval.rope_scaling,
             f"'none' for encoding={cfg.encoding.get('name')}, which does not rotate q and k")
    _check_rope_scaling_factor(cfg.eval)
    _check_longrope(cfg, "eval")
    _check_rope_remap(cfg)
    _check_decoupled_rope(cfg)
    positions = cfg.eval.get("randomized_positions", EvalConfig.randomized_positions)
    require(positions in RANDOMIZED_POSITIONS, "eval.randomized_positions", positions,
             f"one of {RANDOMIZED_POSITIONS}")
    _check_eval_attention(cfg)
    _check_temperature(cfg)
    _check_switch(cfg)
    _check_budget(cfg.train)
    _check_lengths(cfg)
    require(cfg.device in DEVICES, "device", cfg.device, f"one of {DEVICES}")
    require(cfg.logger.name in LOGGERS, "logger.name", cfg.logger.name, f"one of {LOGGERS}")
    require(cfg.logger.mode in LOGGER_MODES, "logger.mode", cfg.logger.mode, f"one of {LOGGER_MODES}")
    check_dataset(cfg)  # the dataset's own keys and ranges
    encoding_config(cfg)  # validates the encoding's own keys and ranges


def eval_lengths_warning(cfg: DictConfig) -> Optional[str]:
    """A line when no evaluation length lies past the training length: the run then measures no
    extrapolation, its headline. A warning, not a refusal: scoring at the training length alone
    is a study of its own (Haviv et al. 2022's, in posbench reproduce)."""
    if max(cfg.eval.lengths) > cfg.train.seq_len:
        return None
    return (f"eval.lengths={list(cfg.eval.lengths)} has no length past "
            f"train.seq_len={cfg.train.seq_len}: the run measures no extrapolation (its log-ppl "
            f"growth past L is '—' in reports); a length above {cfg.train.seq_len} measures it")


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: configs compared key by key."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
