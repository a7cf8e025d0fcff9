"""GRAPE-AP, GRAPE's path-integral additive form (Zhang et al. 2026): the bias between key j and
query t is a sum over the path of edges j+1..t, each edge weighed by the query
(docs/encodings.md#group-family).

Layer l, head h reads a probe p_t = W x_t (pd = 8 coordinates) from the attention's input x_t,
and its RMS-normalized copy p̂_t turned by a fixed rotation of speed 1 per position,
r_t = R(-t) p̂_t (every coordinate pair (c, c + pd/2) turned by -t radians). Edge ℓ as seen from
query t weighs

    ψ(t, ℓ) = α_h log σ(p_t · r_ℓ / pd) <= 0,

and the logit of query t and key j <= t gains b(t, j) = Σ_{ℓ=j+1..t} ψ(t, ℓ), α_h being ALiBi's
slopes. In the lift of GRAPE-A each edge is the unipotent I - ψ(t, ℓ)E (E^2 = 0), so their
product along the path collapses to I - b(t, j)E: the rows compose as a group does, but the
factors depend on the endpoint t, so there is no one-parameter group. ψ depends on t, so the sum
needs the whole row: it is a row_mod. r_ℓ turns by the position ℓ itself, not by a lag, so a
shift of every position changes the bias: the encoding is absolute (model-architectures/GRAPE
llama-mha-grape-ap-v1.py, and the paper's R_ℓ = exp(ℓJ)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from posbench.core.errors import require
from posbench.encodings.alibi import alibi_slopes
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register


def path_sum(edges: torch.Tensor) -> torch.Tensor:
    """b[..., j] = Σ_{ℓ > j} edges[..., ℓ] along the last dim. Summed from the far end of the row,
    so the keys next to the query are sums of a few terms, not differences of long sums."""
    return edges.flip(-1).cumsum(-1).flip(-1) - edges


@dataclass
class GrapeAPConfig(EncodingConfig):
    # llama-mha-grape-ap-v1.py with train_llama_mha_grape_ap_v1_pdim8_*.py: p_head_dim 8, an
    # untied probe projection (p_tie_mode none) initialized N(0, (0.5/sqrt(D))^2), the
    # reference's hidden_init_std_factor
    probe_dim: int = 8
    probe_init_factor: float = 0.5


@register("grape_ap", "GRAPE-AP: a sum over the path j+1..i of ALiBi-scaled log σ of query-"
                      "weighed probes turned by their position (no positional embedding)")
class GrapeAP(PositionalEncoding):
    family = "group"
    relative = False
    reads_input = True
    past_train_len = ("a content-weighed decay summed over the path, defined at every length; "
                      "probes turn by absolute positions, which past L take unseen angles mod 2π")
    reference = ("GRAPE: Group Representational Position Encoding (Zhang et al. 2026), "
                 "GRAPE-AP")
    Config = GrapeAPConfig

    @classmethod
    def check(cls, cfg, run_cfg):
        require(cfg.probe_dim >= 2 and cfg.probe_dim % 2 == 0, "encoding.probe_dim",
                cfg.probe_dim, "an even integer >= 2 (the probe turns in coordinate pairs)")
        require(cfg.probe_init_factor > 0, "encoding.probe_init_factor", cfg.probe_init_factor,
                "a number > 0")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        D, H = dims.d_model, dims.n_head
        std = cfg.probe_init_factor / math.sqrt(D)
        self.probe = nn.Parameter(torch.randn(dims.n_layer, H, cfg.probe_dim, D) * std)
        self.register_buffer("slopes", torch.tensor(alibi_slopes(H), dtype=torch.float64),
                             persistent=False)

    def probes(self, x: torch.Tensor, pos: torch.Tensor, layer: int):
        """p (B, H, T, pd) and r = R(-t) rms(p) (B, H, T, pd), fp32 at least."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            p = torch.einsum("btc,hpc->bhtp", x.to(dtype), self.probe[layer].to(dtype))
        u, v = F.rms_norm(p, (p.shape[-1],)).chunk(2, dim=-1)
        angle = pos.double()[:, None, :, None]  # speed 1 on every pair (rotary base 1)
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        return p, torch.cat((u * cos + v * sin, v * cos - u * sin), dim=-1)

    def row_mod(self, logits, q, k, pos, layer, q_idx, kv_idx, *, x):
        p, r = self.probes(x, pos, layer)
        rows, end = q_idx.flatten(), kv_idx.shape[-1]
        with torch.autocast(x.device.type, enabled=False):
            weight = p[:, :, rows] @ r[:, :, :end].transpose(-2, -1) / p.shape[-1]
        edges = self.slopes.to(p.dtype).view(-1, 1, 1) * F.logsigmoid(weight)
        edges = edges.masked_fill(kv_idx > q_idx, 0.0)  # the path stops at the query
        return logits.to(p.dtype) + path_sum(edges)

    def flops(self, batch, length, pairs):
        # per token and head: the probe (D -> pd), its RMS norm and turn; per score p_t . r_l
        # (2 pd), its scale, log σ, slope, the path sum (running sum, difference) and addition
        H, D, pd = self.dims.n_head, self.dims.d_model, self.cfg.probe_dim
        per_token = H * (2 * D * pd + 5 * pd + 2)
        return self.dims.n_layer * batch * (length * per_token + H * (2 * pd + 6) * pairs)
