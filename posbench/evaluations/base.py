"""The evaluation contract and the registry: what a trained model is scored on.

An evaluation is a class registered under a name (`@register(name, description)`), with a typed
config and a `check(cfg, run_cfg)` that refuses, in one line, a value it cannot use. It runs in
two steps: `cls(cfg, run_cfg, data)` plans it before training, building every window or
sequence it will score, so that a length the data cannot hold is refused before any work; then
`run(model, device)` scores the trained model and returns what results.json keeps.

Two kinds:
- a perplexity protocol (posbench/evaluations/perplexity.py: Protocol) says which validation
  windows are scored at each length: `eval.protocol=<name>` picks one; its config is the `eval`
  node (EvalConfig), its result the curve (results.json eval.curve).
- a section (Section) has keys of its own under `eval.<name>` (a dataclass deriving from
  SectionConfig, whose `enabled` turns it on) and its result at results.json eval.<name> (null
  when it did not run): passkey retrieval (posbench/evaluations/retrieval.py) is one.
Nothing outside this package branches on an evaluation's name.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from posbench.attention.span import lambda_span
from posbench.core.device import autocast
from posbench.encodings.base import EVAL_OPTIONS
from posbench.core.errors import ConfigError
from posbench.core.registry import Entry, Registry, typed_defaults


@dataclass
class EvalConfig:
    """The `eval` node: the perplexity protocols' keys and the encoding's eval-time options,
    which every evaluation runs with; eval_schema adds a node per section."""
    lengths: List[int] = field(default_factory=lambda: [128, 256, 512, 1024, 2048])
    tokens: int = 32768
    protocol: str = "nonoverlapping"
    # tokens scored at the end of each window: sliding needs it; growing_context scores the
    # last `stride` tokens (default min(lengths)) with every context length; nonoverlapping
    # scores every token and ignores it
    stride: Optional[int] = None
    batch_tokens: int = 16384
    # options applied at evaluation only, without retraining (docs/encodings.md, "Eval-time
    # options"). rope_scaling (rotary encodings): none, pi, ntk, yarn, llama3 (HF's),
    # dynamic_ntk (HF's) or longrope (longrope_factors); or a remap of relative distances
    # (RoPE-rotated encodings): rerope, self_extend, shifted_rope, dca (Dual Chunk Attention),
    # streaming_llm (StreamingLLM's positions in its cache of the lambda mask's sinks and
    # window; with attention=lambda).
    # rope_scaling_factor: null is dynamic, s = max(1, n/L) recomputed for each evaluated length
    # n (L = train.seq_len); a number > 1 is a static s, as the papers evaluate: the same
    # frequencies at every length, also at n <= L. For dynamic_ntk it is HF's `factor` alpha
    # (null: 1), s = max(1, alpha*n/L - (alpha-1)) per length. For rerope it is the leaky
    # form's k (null: pure ReRoPE), for self_extend the group size G (null: the smallest that
    # fits each length), for shifted_rope, dca, streaming_llm and longrope null.
    rope_scaling: str = "none"
    rope_scaling_factor: Optional[float] = None
    # the remaps' window (null: the method's default at L): rerope's w (L/8), self_extend's
    # neighbour window W (L/4), shifted_rope's local window W (L/16), dca's local window w
    # (L/8); lags below it, or below shifted_rope's shift S, keep RoPE's positions
    rope_window: Optional[int] = None
    # shifted_rope's S (null: L/3): lags d >= S are shifted to d - S + W
    rope_shift: Optional[int] = None
    # dca's chunk size s (null: 3L/4, ChunkLlama's), above its local window and at most L: chunks
    # of s - w tokens, and no lag beyond s
    rope_chunk: Optional[int] = None
    # with rope_scaling=longrope: the JSON file of LongRoPE's factors, one per rotary pair, and
    # the length they were chosen for (`posbench longrope RUN_DIR --length N` writes one;
    # posbench/encodings/longrope.py); results.json records the values
    longrope_factors: Optional[str] = None
    # the softmax temperature at evaluation, in place of every layer's fixed one (a learned one,
    # ssmax, stays): logn, llama4_floorlog, yarn, drope_beta or none; null: the model's
    temperature: Optional[str] = None
    # how encoding=randomized is evaluated (every other encoding reads 0..n-1): `random` draws
    # sorted positions below encoding.max_len as in training, as its reference does, each window
    # from its own fixed seed; `plain` feeds 0..n-1 (posbench/encodings/randomized.py)
    randomized_positions: str = "random"
    # the mask of every global layer (a local one keeps its span): global, or lambda, each query
    # seeing the first lambda_sinks keys (null: 4) and the lambda_window most recent (null:
    # L - lambda_sinks), StreamingLLM's sinks and window, LM-Infinite's Lambda-shaped mask
    # (posbench/attention/span.py); positions stay those of the sequence (LM-Infinite's distance
    # cap on RoPE: eval.rope_scaling=rerope with eval.rope_window=L)
    attention: str = "global"
    lambda_sinks: Optional[int] = None
    lambda_window: Optional[int] = None
    # effective context by perplexity: the largest length up to which ppl stays within
    # (1 + ppl_tolerance) of its value at the training length
    ppl_tolerance: float = 0.1


@dataclass
class SectionConfig:
    """The keys every section has under `eval.<name>` (a section's own Config adds more)."""
    enabled: bool = False


def eval_config(eval_cfg):
    """The `eval` node's own keys (not the sections') as a typed config: a key that a partial
    or older config lacks takes its default."""
    names = {f.name for f in dataclasses.fields(EvalConfig)}
    # resolved in place: an interpolation may read the rest of the run's config
    node = eval_cfg if isinstance(eval_cfg, DictConfig) else OmegaConf.create(eval_cfg)
    return OmegaConf.merge(typed_defaults(EvalConfig),
                           {k: v for k, v in OmegaConf.to_container(node, resolve=True).items()
                            if k in names})


class Evaluation:
    name: ClassVar[str] = ""  # set by register
    description: ClassVar[str] = ""
    key: ClassVar[str] = ""  # where results.json's eval keeps its result
    load_trained = None  # set by plan(): the loader of another finished run's model

    @classmethod
    def config(cls, run_cfg):
        """Its typed config, from the run's config."""
        raise NotImplementedError

    @classmethod
    def selected(cls, run_cfg) -> bool:
        """Whether the run's config asks for it."""
        raise NotImplementedError

    @classmethod
    def check(cls, cfg, run_cfg) -> None:
        """Raise ConfigError for values it cannot use. `cfg` is its typed config, `run_cfg` the
        whole composed config (model, dataset, train, eval)."""

    def __init__(self, cfg, run_cfg, data):
        self.cfg, self.run_cfg, self.data = cfg, run_cfg, data

    def run(self, model, device: torch.device) -> Any:
        raise NotImplementedError


class Section(Evaluation):
    Config: ClassVar[type] = SectionConfig
    # its result holds an `effective_length` (tokens), which results.json repeats under
    # eval.effective_length.<name>
    has_effective_length: ClassVar[bool] = False

    @classmethod
    def config(cls, run_cfg):
        return cls.typed(run_cfg.eval)

    @classmethod
    def typed(cls, eval_cfg):
        """eval.<name> of an eval node as its dataclass (a DictConfig's `keys` would be its
        method); a key that a run saved before it existed lacks takes its default."""
        try:
            typed = OmegaConf.merge(typed_defaults(cls.Config),
                                    eval_cfg.get(cls.name) or {})
        except Exception as err:  # omegaconf's message names the key and the type
            raise ConfigError(f"eval.{cls.name}: {str(err).splitlines()[0]}") from None
        return OmegaConf.to_object(typed)

    @classmethod
    def selected(cls, run_cfg) -> bool:
        return cls.config(run_cfg).enabled

    @classmethod
    def write(cls, result, train_len: int, run_dir, stem: str, title: str) -> None:
        """Its files beside results.json, from its result (`stem`: "" for the run's own,
        ".eval-<change>" for a re-score's)."""

    @classmethod
    def report_lines(cls, runs: List[dict], labels: Dict[int, str]) -> List[str]:
        """summary.md's lines on the runs' results (results.json records, which hold it under
        eval.<name> when it ran; labels: index -> group label); a run's printed summary shows
        the same for the run alone."""
        return []

    @classmethod
    def length_metrics(cls, result) -> Dict[int, Dict[str, Any]]:
        """Per eval length, the scalars that join that length's wandb row (eval/<key>)."""
        return {}

    @classmethod
    def summary_metrics(cls, result) -> Dict[str, Any]:
        """The scalars that join the run's wandb summary besides eval.effective_length's (which
        every run logs as effective_length/<key>)."""
        return {}


_REGISTRY = Registry(Evaluation)


def register(name: str, description: str):
    """Class decorator: make `cls` available as eval.protocol=<name> (a Protocol) or as
    eval.<name> (a Section); `posbench list` shows the description."""

    def wrap(cls):
        assert not cls.__dict__.get("name"), cls
        cls.name, cls.description = name, description
        if issubclass(cls, Section):
            cls.key = name
        return _REGISTRY.add(cls, name, description)

    return wrap


def registry() -> Dict[str, Entry]:
    return _REGISTRY.by_name()


def sections() -> List[type]:
    return [e.cls for e in registry().values() if issubclass(e.cls, Section)]


def eval_schema() -> type:
    """EvalConfig with a node for every section: the `eval` of the whole schema
    (posbench/config.py). One class per set of sections, so that configs typed by it merge."""
    return _eval_schema(tuple(sections()))


@functools.lru_cache(maxsize=None)
def _eval_schema(with_sections: tuple) -> type:
    return dataclasses.make_dataclass(
        "EvalConfig", [(s.name, s.Config, field(default_factory=s.Config)) for s in with_sections],
        bases=(EvalConfig,))


def plan(run_cfg, data, load_trained=None) -> List[Evaluation]:
    """The evaluations the run's config asks for, planned on its data (protocol first).
    load_trained(run_dir, device): the runs layer's loader of a finished run's model, for an
    evaluation that scores with another run (an evaluator); this package sits below it."""
    chosen = sorted((e.cls for e in registry().values() if e.cls.selected(run_cfg)),
                    key=lambda cls: issubclass(cls, Section))
    planned = [cls(cls.config(run_cfg), run_cfg, data) for cls in chosen]
    for evaluation in planned:
        evaluation.load_trained = load_trained
    return planned


def run(evaluations: List[Evaluation], model, device: torch.device) -> Dict[str, Any]:
    """Each evaluation's result under its key (the protocol's: "curve")."""
    return {e.key: e.run(model, device) for e in evaluations}


def with_train_length(eval_cfg, train_len: int):
    """eval_cfg with the training length among its lengths: every run records its perplexity
    there, the reference of its extrapolation ratio and of the parity check
    (posbench/core/parity.py)."""
    if train_len in eval_cfg.lengths:
        return eval_cfg
    cfg = OmegaConf.create(OmegaConf.to_container(eval_cfg, resolve=True))
    cfg.lengths = sorted({*eval_cfg.lengths, train_len})
    return cfg


def eval_options(eval_cfg) -> dict:
    """The eval node's eval-time options, every key that set_eval_options reads from it
    (defaults for the keys it lacks)."""
    typed = eval_config(eval_cfg)
    return {key: typed[key] for key in (*EVAL_OPTIONS, "attention", "lambda_sinks",
                                        "lambda_window")}


def set_eval_options(model, eval_cfg) -> None:
    """The encoding's eval-time options and the layers' eval.attention from the eval node
    (defaults for the keys it lacks)."""
    options = eval_options(eval_cfg)
    model.encoding.set_eval_options(*(options[key] for key in EVAL_OPTIONS))
    span = (lambda_span(model.encoding.dims.train_len, options["lambda_sinks"],
                        options["lambda_window"]) if options["attention"] == "lambda" else None)
    for block in model.blocks:
        block.attn.set_eval_span(span)


def is_oom(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's failure (a RuntimeError that says "can't
    allocate memory")."""
    if isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text
                                              or "can't allocate memory" in text)


def scored_within_memory(device: torch.device, score: Callable[[], dict], **keys) -> dict:
    """score() under the device's autocast; `keys` with status "oom" when it runs out of memory
    (CUDA's cache emptied for what comes next). Any other error is raised: only out-of-memory
    is recorded, not hidden."""
    try:
        with autocast(device):
            return score()
    except Exception as err:  # noqa: BLE001 - re-raised unless out of memory
        if not is_oom(err):
            raise
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {**keys, "status": "oom"}


def plant_share(rows: np.ndarray, mix: float, seed: int, step: int, stream: int, make,
                taken=()) -> List[int]:
    """A training mix's planting (train.retrieval_mix, train.ruler_mix): replaces a share `mix`
    of the batch's rows, in place, by make(rng, row, length) (length+1 tokens): floor(mix * B)
    rows, one more with probability of the remainder, chosen among the rows not in `taken` (an
    earlier mix's), from the generator of (seed, step, stream). The rows it replaced."""
    rng = np.random.default_rng([seed, step, stream])
    batch, length = rows.shape[0], rows.shape[1] - 1
    count = int(mix * batch) + int(rng.random() < mix * batch - int(mix * batch))
    free = np.setdiff1d(np.arange(batch), np.asarray(taken, dtype=np.int64))
    chosen = [int(row) for row in rng.choice(free, size=min(count, len(free)), replace=False)]
    for row in chosen:
        rows[row] = make(rng, row, length)
    return chosen


def planting(*plants) -> Optional[Callable]:
    """train_batch's `plant` for the training mixes that are on (None when none is): each
    replaces its share of the rows, in this order, among the rows the ones before it left."""
    plants = [p for p in plants if p is not None]
    if len(plants) <= 1:
        return plants[0] if plants else None

    def plant(rows: np.ndarray, seed: int, step: int, taken=()) -> List[int]:
        taken = list(taken)
        for one in plants:
            taken += one(rows, seed, step, taken)
        return taken
    return plant


def effective_length(points, threshold: float) -> Optional[int]:
    """The largest length such that the score is >= threshold at it and at every shorter
    evaluated length; None when the shortest already falls below (or was not scored)."""
    best = None
    for length, value in sorted(points):
        if value is None or not value >= threshold:
            break
        best = length
    return best


def by_length(grid: List[dict], scores=("exact_match", "bits_saved")) -> List[dict]:
    """A retrieval grid's cells (length, depth, scores) per length: the mean over depths of each
    of `scores`, none where a cell ran out of memory."""
    out = []
    for length in sorted({c["length"] for c in grid}):
        cells = [c for c in grid if c["length"] == length]
        point = {"length": length}
        if all("bits_saved" in c for c in cells):
            for key in scores:
                point[key] = float(np.mean([c[key] for c in cells]))
        out.append(point)
    return out


# NoLiMa's relative rule (Modarressi et al. 2025): a length counts while the score keeps this
# share of the model's own score at its shortest length
RELATIVE_SHARE = 0.85


def relative_effective_length(points) -> Optional[int]:
    """The largest length up to which the score stays >= RELATIVE_SHARE times its value at the
    shortest evaluated length (at it and at every shorter length): an effective length that a
    small model, whose best score is far from any absolute threshold, can have too. None when
    that base score is missing or not positive."""
    points = sorted(points)
    if not points or points[0][1] is None or not points[0][1] > 0:
        return None
    return effective_length(points, RELATIVE_SHARE * points[0][1])


def per_seed(lengths: list) -> str:
    """Effective lengths of a group's seeds for a table: one value, or each seed's where they
    differ; `none` where no length qualified, `—` where nothing was scored."""
    words = list(dict.fromkeys("none" if x is None else str(x) for x in lengths))
    return ", ".join(words) if words else "—"


def effective_lengths(points: List[dict], threshold: float, metric: str = "bits_saved") -> dict:
    """A section's scores by length (`by_length`) with both effective lengths of `metric`:
    the absolute rule at `threshold` (RULER's) and the relative one (NoLiMa's)."""
    scores = [(p["length"], p.get(metric)) for p in points]
    return {"by_length": points, "effective_length": effective_length(scores, threshold),
            "relative_effective_length": relative_effective_length(scores)}
