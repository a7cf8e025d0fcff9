"""NoPE: no positional signal; order information comes only from the causal mask."""
from dataclasses import dataclass

from posbench.encodings.base import EncodingConfig, PositionalEncoding, register


@register("nope", "no positional signal; order comes from the causal mask alone")
class NoPE(PositionalEncoding):
    family = "none"
    relative = True
    past_train_len = "no position parameters; failures come from attention dilution"
    reference = "Kazemnejad et al. 2023; Haviv et al. 2022"

    @dataclass
    class Config(EncodingConfig):
        pass
