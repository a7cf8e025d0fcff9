"""FoX, the Forgetting Transformer (Lin et al. 2025): softmax attention with a forget gate and no
positional embedding (docs/encodings.md#contextual-family).

Layer l, head h has the gate f_t = σ(w·x_t + b) on the attention's input x_t (after the block's
LayerNorm), and the logit of query i and key j ≤ i gains

    D_ij = Σ_{l=j+1..i} log f_l = c_i - c_j,   c_t = Σ_{l<=t} log f_l,

a decay that the tokens set one step at a time. Position ids are never read: order enters only
through the running sum over the sequence. As GRAPE-A (docs/encodings.md#group-family) it is the
unipotent action with the data-dependent clock ω_t = log f_t.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from posbench.core.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register


@dataclass
class FoxConfig(EncodingConfig):
    # the gate's nn.Linear(hidden_size, num_heads) starts N(0, initializer_range^2) with a zero
    # bias (zhixuan-lin/forgetting-transformer, ForgettingAttentionLayer, fgate_type "full")
    gate_init_std: float = 0.02
    gate_bias_init: float = 0.0


@register("fox", "adds the running sum of log forget gates σ(w·x_t + b) between key and query")
class FoX(PositionalEncoding):
    family = "contextual"
    relative = True
    additive_score_mod = True
    reads_input = True
    past_train_len = ("no positions: a per-token decay defined at every length; attention stays "
                      "as local as the gates make it")
    reference = "Forgetting Transformer: Softmax Attention with a Forget Gate (Lin et al. 2025)"
    Config = FoxConfig

    @classmethod
    def check(cls, cfg, run_cfg):
        if not cfg.gate_init_std >= 0:
            raise ConfigError(f"encoding.gate_init_std={cfg.gate_init_std} is not accepted; "
                              "expected a number >= 0")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        # one gate per layer and head, read from the layer's input
        self.gate_weight = nn.Parameter(
            torch.randn(dims.n_layer, dims.n_head, dims.d_model) * cfg.gate_init_std)
        self.gate_bias = nn.Parameter(torch.full((dims.n_layer, dims.n_head), cfg.gate_bias_init))

    def log_forget(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """log f_t, (B, H, T), in fp32 at least: the running sum adds up every rounding."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            logit = F.linear(x.to(dtype), self.gate_weight[layer].to(dtype),
                             self.gate_bias[layer].to(dtype))
        return F.logsigmoid(logit).transpose(1, 2)

    def bias_factors(self, q, k, pos, layer, *, x):
        """a_i = 1, b_j = c_o - c_j: the bias c_i - c_j less the row term c_i - c_o."""
        clock = self.log_forget(x, layer).cumsum(-1).unsqueeze(-1)
        ones = torch.ones_like(clock)
        return lambda origin: (ones, clock[:, :, origin:origin + 1] - clock)

    def score_mod(self, q, k, pos, layer, *, x):
        clock = self.log_forget(x, layer).cumsum(-1)  # c_t

        def forget(score, b, h, q_idx, kv_idx):
            # future keys get c_i - c_j >= 0, finite; the mask removes them afterwards
            return score + (clock[b, h, q_idx] - clock[b, h, kv_idx])

        return forget

    def flops(self, batch, length, pairs):
        # per token: the gate's logits (D -> H), log σ and the running sum; per score c_i - c_j
        # and its addition
        H, D = self.dims.n_head, self.dims.d_model
        return self.dims.n_layer * batch * (length * H * (2 * D + 2) + 2 * H * pairs)
