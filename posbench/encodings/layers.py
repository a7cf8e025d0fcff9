"""Layer patterns (docs/encodings.md#hybrid-family): a registered encoding per layer, from a
pattern repeated to the model's depth, e.g. `encoding=layers encoding.pattern=[rope,rope,rope,nope]`.

Each distinct name of the pattern is built once, with its registered default config, for the
layers of its kind only: its `Dims.n_layer` is how many layers it serves, and its hooks receive
the layer's index among them (0 for the first layer of its kind). A per-layer table (Shaw's)
therefore has a row set for each layer it acts in and no unused ones, and an input encoding
(`learned`, `sinusoidal`) adds its embedding before the first layer of its kind. The model asks
`at_layer(i)` for the encoding of layer i and calls its hooks; it never sees the pattern.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List

from torch import nn

from posbench.encodings.base import EncodingConfig, PositionalEncoding, register, registry
from posbench.core.errors import ConfigError, did_you_mean
from posbench.attention.span import ATTENTIONS
from posbench.attention.temperature import TEMPERATURES


@dataclass
class LayersConfig(EncodingConfig):
    # the encoding of each layer, by registered name (with its default config), repeated to
    # model.n_layer: layer i takes pattern[i % len(pattern)]
    pattern: List[str] = field(default_factory=lambda: ["rope"])
    # per pattern entry, repeated with it: the attention span of that kind of layer (global,
    # sliding, chunked; posbench/attention/span.py) of width model.attention_window; empty:
    # model.attention
    attention: List[str] = field(default_factory=list)
    # per pattern entry: that kind of layer's softmax temperature
    # (posbench/attention/temperature.py); empty: model.temperature
    temperature: List[str] = field(default_factory=list)


# the recipes at posbench's scale, every fourth layer a global NoPE layer (docs/encodings.md says
# why the local span defaults to L/4)
IROPE = LayersConfig(pattern=["rope", "rope", "rope", "nope"],
                     attention=["chunked", "chunked", "chunked", "global"],
                     temperature=["none", "none", "none", "llama4_floorlog"])
RNOPE_SWA = LayersConfig(pattern=["rope", "rope", "rope", "nope"],
                         attention=["sliding", "sliding", "sliding", "global"])


@register("layers", "a pattern of registered encodings, one per layer, repeated to the depth",
          LayersConfig())
@register("irope", "Llama 4's iRoPE: RoPE layers with chunked local attention, every 4th layer "
          "global NoPE", IROPE)
@register("rnope_swa", "RNoPE-SWA: 3 sliding-window RoPE layers to 1 global NoPE layer", RNOPE_SWA)
class Layers(PositionalEncoding):
    family = "hybrid"
    relative = True  # an instance takes the conjunction of its kinds'
    rotary = True  # eval.rope_scaling reaches the rotary kinds; check refuses a pattern without
    past_train_len = "each layer behaves as its own encoding does; see the entries of the pattern"
    reference = "Llama 4's iRoPE (Meta 2025); RNoPE-SWA (Yang et al. 2025)"
    Config = LayersConfig

    @classmethod
    def check(cls, cfg, run_cfg):
        entries = registry()
        if not cfg.pattern:
            raise ConfigError("encoding.pattern=[] is not accepted; expected a non-empty list of "
                              "encodings, one per layer (repeated to model.n_layer)")
        for name in cfg.pattern:
            if name not in entries:
                raise ConfigError(f"encoding.pattern entry {name!r} is not accepted"
                                  f"{did_you_mean(name, entries)}; expected one of: "
                                  + ", ".join(entries))
            entry = entries[name]
            if entry.cls.family == "hybrid" or entry.cls.positions is not None:
                raise ConfigError(f"encoding.pattern entry {name!r} is not accepted; expected an "
                                  "encoding that acts within a layer (not a pattern itself, and "
                                  "without a positions hook: positions are shared by all layers)")
        for key in ("attention", "temperature"):
            values = list(getattr(cfg, key))
            if values and len(values) != len(cfg.pattern):
                raise ConfigError(f"encoding.{key}={values} is not accepted; expected one value "
                                  f"per entry of encoding.pattern={list(cfg.pattern)}, or [] (the "
                                  f"model's)")
        for key, accepted in (("attention", ATTENTIONS), ("temperature", TEMPERATURES)):
            for value in getattr(cfg, key):
                if value not in accepted:
                    raise ConfigError(f"encoding.{key} entry {value!r} is not accepted"
                                      f"{did_you_mean(value, accepted)}; expected one of {accepted}")
        if "logn" in cfg.temperature and run_cfg.train.seq_len < 2:
            raise ConfigError(f"train.seq_len={run_cfg.train.seq_len} is not accepted; expected "
                              "more than 1 token with temperature logn (it divides by ln L)")
        kinds = [entries[name] for name in dict.fromkeys(cfg.pattern)]
        if run_cfg.eval.rope_scaling != "none" and not any(e.cls.rotary for e in kinds):
            raise ConfigError(f"eval.rope_scaling={run_cfg.eval.rope_scaling!r} is not accepted; "
                              f"expected 'none' for encoding.pattern={list(cfg.pattern)}, which "
                              "holds no rotary encoding")
        for entry in kinds:
            entry.cls.check(entry.config, run_cfg)

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        names = [cfg.pattern[i % len(cfg.pattern)] for i in range(dims.n_layer)]
        entries = registry()
        # in order of first use, so that a pattern of one name builds exactly that encoding
        self.kinds = nn.ModuleDict({
            name: entries[name].cls(entries[name].config,
                                    dataclasses.replace(dims, n_layer=names.count(name)))
            for name in dict.fromkeys(names)})
        # layer i -> (its encoding, its index among the layers of that encoding)
        self.layer_map = [(self.kinds[name], names[:i].count(name))
                          for i, name in enumerate(names)]
        self.relative = all(kind.relative for kind in self.kinds.values())
        self.prefix_consistent = all(kind.prefix_consistent for kind in self.kinds.values())

    def at_layer(self, layer):
        return self.layer_map[layer]

    def flops(self, batch, length, pairs):
        return sum(kind.flops(batch, length, pairs) for kind in self.kinds.values())

    def attention_options(self, layer):
        entry = layer % len(self.cfg.pattern)
        return {key: getattr(self.cfg, key)[entry] for key in ("attention", "temperature")
                if getattr(self.cfg, key)}

    def set_eval_options(self, rope_scaling="none", *args, **kwargs):
        super().set_eval_options(rope_scaling, *args, **kwargs)
        for kind in self.kinds.values():
            kind.set_eval_options(rope_scaling if kind.rotary else "none", *args, **kwargs)

    def notes(self):
        return [note for kind in self.kinds.values() for note in kind.notes()]
