"""Switching the positional encoding during training (train.switch_encoding_at, train.switch_encoding_to;
docs/encodings.md#dropping-the-encoding-during-training).

DroPE (Gelberg et al. 2025) trains with RoPE, then drops the positional encoding from every layer
for the last part of training: train.switch_encoding_at=0.875 (its 14K of 16K steps) with the
default train.switch_encoding_to=nope. Step k trains with the second encoding when
k >= round(f * train.steps), so the switch is a function of the step alone: a run resumed from any
checkpoint, before or after the switch, trains exactly as an uninterrupted one. Both encodings are
built with the model (the same RNG draws in every process) and both sit in the optimizer from the
start; a parameter without a gradient is left alone by AdamW, so neither moves while unused.
"""
from __future__ import annotations

from posbench.encodings.base import PositionalEncoding, registry

def switch_step(fraction: float, steps: int) -> int:
    """The first step that trains with the second encoding."""
    return round(fraction * steps)


class SwitchedEncoding(PositionalEncoding):
    """`first` up to step `at`, `then` from it on. The phase is part of the state dict (extra
    state), so a trained model loads in the phase it finished in."""

    def __init__(self, first: PositionalEncoding, then: PositionalEncoding, at: int):
        super().__init__(first.cfg, first.dims)
        self.first, self.then, self.at = first, then, at
        self.switched = False

    @property
    def active(self) -> PositionalEncoding:
        return self.then if self.switched else self.first

    def at_step(self, step: int) -> None:
        self.switched = step >= self.at

    def at_layer(self, layer):
        return self.active.at_layer(layer)

    def flops(self, batch, length, pairs):
        # the first encoding's, as an estimate plans it (train.budget=flops refuses a switch)
        return self.first.flops(batch, length, pairs)

    def attention_options(self, layer):
        return self.first.attention_options(layer)  # spans and temperatures stay with the model

    def set_eval_options(self, rope_scaling="none", *args, **kwargs):
        super().set_eval_options("none", *args, **kwargs)
        for enc in (self.first, self.then):
            enc.set_eval_options(rope_scaling if enc.rotary else "none", *args, **kwargs)

    def notes(self):
        return self.active.notes()

    def get_extra_state(self):
        return {"switched": self.switched}

    def set_extra_state(self, state):
        self.switched = bool(state["switched"])


for _name in PositionalEncoding.HOOKS + PositionalEncoding.FLAGS:  # the active encoding's
    setattr(SwitchedEncoding, _name, property(lambda self, name=_name: getattr(self.active, name)))


def switched_encoding(encoding: PositionalEncoding, train_cfg, dims) -> PositionalEncoding:
    """`encoding` switched to train.switch_encoding_to (its registered defaults) at
    train.switch_encoding_at of the steps; `encoding` itself when no switch is set."""
    fraction = train_cfg.get("switch_encoding_at")  # absent from runs saved before it existed
    if fraction is None:
        return encoding
    entry = registry()[train_cfg.switch_encoding_to]
    then = entry.cls(entry.config, dims)
    return SwitchedEncoding(encoding, then, switch_step(fraction, train_cfg.steps))
