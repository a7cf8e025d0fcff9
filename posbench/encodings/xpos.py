"""xPos: RoPE whose pair p also decays the logit by zeta_p^((i-j)/B) (Sun et al. 2023).

q~_i = zeta^((i-c)/B) * RoPE(q_i, i) and k~_j = zeta^(-(j-c)/B) * RoPE(k_j, j), per pair, so that
the pair's share of q~_i . k~_j carries zeta_p^((i-j)/B) for any centre c. c is the midpoint of
the sequence's own positions: the factors stay within zeta_min^(+-T/2B) whatever the position
offset (65536 included), and shifting every position moves c along, so logits are unchanged.
Finite in fp32/bf16 while T/2B * ln(1/zeta_min) < 88, i.e. T up to about 72k tokens for the
defaults; scores of masked future keys, zeta^(-(j-i)/B), stay finite up to T of about 36k.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch

from posbench.core.errors import ConfigError
from posbench.encodings.base import register
from posbench.encodings.rope import RoPE


def xpos_zeta(head_dim: int, gamma: float) -> torch.Tensor:
    """zeta_p = (2p/d + gamma) / (1 + gamma), p = 0..d/2-1, float64 (torchscale's XPOS `scale`)."""
    p = torch.arange(head_dim // 2, dtype=torch.float64)
    return (2 * p / head_dim + gamma) / (1 + gamma)


@register("xpos", "RoPE with a per-pair exponential decay zeta^((i-j)/B) of the logit")
class XPos(RoPE):
    family = "rotary"
    relative = True
    rotary = True
    rope_remaps = False  # its decay also reads positions: a remapped lag has no one rotation
    past_train_len = "far keys are damped by zeta^(lag/B); optional blockwise causal attention"
    reference = "A Length-Extrapolatable Transformer (Sun et al. 2023)"

    @dataclass
    class Config(RoPE.Config):
        gamma: float = 0.4
        scale_base: float = 512.0
        # blockwise causal attention (the paper's inference setting): a query sees its own block
        # of this many tokens and the previous block; None attends to the whole prefix
        block_window: Optional[int] = None

    @classmethod
    def check(cls, cfg, run_cfg):
        super().check(cfg, run_cfg)
        if not cfg.gamma > 0:
            raise ConfigError(f"encoding.gamma={cfg.gamma} is not accepted; expected a number > 0")
        if not cfg.scale_base > 0:
            raise ConfigError(f"encoding.scale_base={cfg.scale_base} is not accepted; "
                              "expected a number > 0")
        if cfg.block_window is not None and cfg.block_window < 1:
            raise ConfigError(f"encoding.block_window={cfg.block_window} is not accepted; "
                              "expected a positive integer or null")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        log_zeta = xpos_zeta(dims.head_dim, cfg.gamma).log()
        self.register_buffer("log_zeta", torch.cat((log_zeta, log_zeta)), persistent=False)
        if cfg.block_window is not None:
            self.score_mod = self._blockwise_causal

    def decay(self, pos: torch.Tensor, dtype):
        """zeta^((t-c)/B) for queries and its inverse for keys, (B, 1, T, d)."""
        pos = pos.to(torch.float64)
        centre = (pos.amin(-1, keepdim=True) + pos.amax(-1, keepdim=True)) / 2
        power = ((pos - centre) / self.cfg.scale_base).unsqueeze(-1) * self.log_zeta
        return power.exp().unsqueeze(1).to(dtype), (-power).exp().unsqueeze(1).to(dtype)

    def rotate(self, q, k, pos, layer):
        q, k = super().rotate(q, k, pos, layer)
        up, down = self.decay(pos, q.dtype)
        return q * up, k * down

    def _blockwise_causal(self, q, k, pos, layer):
        window = self.cfg.block_window

        def mask(score, b, h, q_idx, kv_idx):
            return torch.where(q_idx // window - kv_idx // window > 1, -math.inf, score)

        return mask
