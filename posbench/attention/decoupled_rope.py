"""MLA's decoupled RoPE (DeepSeek-V2, arXiv 2405.04434, §2.1.3), `model.decoupled_rope`.

Each head's query and key keep their content parts q^C, k^C (the layer's projections, d wide),
which no encoding touches, and gain a rotary part: q^R per head and one k^R shared by every head,
both projected from the layer's input, d^R wide, and rotated by the encoding. The attention sees
q = [q^C; q^R] and k = [k^C; k^R], so a logit is (q^C.k^C + RoPE(q^R).RoPE(k^R)) / sqrt(d + d^R),
and v keeps d. The rotary encoding is built for the width d^R (Dims.head_dim), as DeepSeek-V2's
rotary embedding is for qk_rope_head_dim. MLA's low-rank compression of the keys and values is
left out: it changes the cache, not what positions do.
"""
from typing import Optional

import torch
from torch import nn

# DeepSeek-V2's d_h^R = 64 beside d_h = 128: the rotary part is half as wide as a head
ROTARY_FRACTION = 0.5


def rotary_width(model_cfg) -> Optional[int]:
    """d^R under model.decoupled_rope (model.decoupled_rope_dim; null: half the head dimension),
    else None. Runs saved before the keys existed have neither."""
    if not model_cfg.get("decoupled_rope", False):
        return None
    width = model_cfg.get("decoupled_rope_dim")
    return width if width is not None else int(ROTARY_FRACTION * model_cfg.d_model
                                               // model_cfg.n_head)


class DecoupledRoPE(nn.Module):
    """The rotary parts of one layer: one projection gives q^R for every head and the shared k^R
    (its weight is initialized with the model's other projections, GPT._init)."""

    def __init__(self, d_model: int, n_head: int, width: int):
        super().__init__()
        self.n_head, self.width = n_head, width
        self.proj = nn.Linear(d_model, (n_head + 1) * width, bias=False)

    def forward(self, x, q, k, pos, encoding, layer):
        """[q^C; q^R] and [k^C; k^R] (B, H, T, d + d^R) from the content parts q, k (B, H, T, d)
        and the layer's input x (B, T, D), the rotary parts turned by `encoding` at `layer`."""
        B, T, _ = x.shape
        parts = self.proj(x).view(B, T, self.n_head + 1, self.width).transpose(1, 2)
        q_rot, k_rot = parts[:, :-1], parts[:, -1:].expand(-1, self.n_head, -1, -1)
        if encoding.rotate is not None:  # a layer pattern's position-free layers have none
            q_rot, k_rot = encoding.rotate(q_rot, k_rot, pos, layer)
        return torch.cat((q, q_rot), dim=-1), torch.cat((k, k_rot), dim=-1)
