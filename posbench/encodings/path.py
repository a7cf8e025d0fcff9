"""PaTH attention (Yang et al. 2025): the key is carried to the query through a product of
data-dependent reflections, one per token on the path (docs/encodings.md#contextual-family).

Token t sets H_t = I - β_t w_t w_t^T, with β_t = 2σ(u·x_t + b) in (0, 2) and w_t read from the
attention's input x through a low-rank projection, a short causal convolution, SiLU and an L2
normalization. The logit of query i and key j <= i is

    q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(d)

(the key's own H_j and everything after the query are left out; j = i gives q_i.k_i). Each H_t
has eigenvalue 1 - β_t|w_t|^2 along w_t and 1 elsewhere, so the products are contractions
that do not commute and do not come from a one-parameter group. `path_fox` adds FoX's forget
gate: the running sum c_i - c_j of log σ(g·x + b) joins the logit before the 1/sqrt(d) scaling,
as the reference kernel scales it.

How it is computed (a row_mod, exact): the sequence is cut in chunks of CHUNK tokens. Within a
chunk the reflections after token j act on k_j as k_j - Σ_s U[s, j] w_s, where U solves the unit
lower triangular system (I + diag(β) strict_lower(W W^T)) U = diag(β) strict_lower(W K^T) (the
UT transform of Householder products), and so do the whole chunk's product M = I - W^T Z and
the query's share q̂_i = q_i - Σ_{s<=i} (q_i.w_s) Z_s, Z solving the same system for diag(β)W.
A block of query rows then sweeps the earlier chunks from near to far, carrying its queries
through one M per chunk: O(T^2 d + T^2 d^2 / CHUNK) work and, per block of rows, memory for
that block's logits only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from posbench.core.errors import require
from posbench.encodings.base import EncodingConfig, PositionalEncoding, register
from posbench.encodings.fox import FoX, FoxConfig

# tokens per chunk of the UT transform (the reference's chunk size): the sweep over earlier
# chunks is one Python step per CHUNK keys
CHUNK = 64
# inside the L2 normalization of w, as the reference's l2_norm: |w| = |y| / sqrt(|y|^2 + eps)
W_NORM_EPS = 1e-6


@dataclass
class PaTHConfig(EncodingConfig):
    # fla-org/flash-linear-attention PaTHAttention: w_proj Linear(D, 32) then Linear(32, H d)
    # (use_low_rank_w), a depthwise causal ShortConvolution of size 3 with SiLU
    # (use_w_shortconv), every weight N(0, 0.02^2) and every bias 0 (initializer_range);
    # forget_gate is use_forget_gate, PaTH-FoX
    w_rank: int = 32
    conv_size: int = 3
    init_std: float = 0.02
    forget_gate: bool = False


@register("path", "PaTH: keys carried to the query through a product of data-dependent "
                  "reflections I - β_t w_t w_tᵀ, one per token between them")
@register("path_fox", "PaTH-FoX: PaTH's reflections and FoX's forget gate",
          config=PaTHConfig(forget_gate=True))
class PaTH(PositionalEncoding):
    family = "contextual"
    relative = True
    reads_input = True
    past_train_len = ("no positions: the product of reflections along the path is defined at "
                      "any length, but far keys pass through more of them than in training")
    reference = ("PaTH Attention: Position Encoding via Accumulating Householder Transformations "
                 "(Yang et al. 2025)")
    Config = PaTHConfig

    @classmethod
    def check(cls, cfg, run_cfg):
        require(cfg.w_rank >= 1, "encoding.w_rank", cfg.w_rank, "an integer >= 1")
        require(cfg.conv_size >= 1, "encoding.conv_size", cfg.conv_size, "an integer >= 1")
        require(cfg.init_std >= 0, "encoding.init_std", cfg.init_std, "a number >= 0")
        require(not run_cfg.train.get("pack_documents", False), "train.pack_documents", True,
                f"false for encoding={cfg.name}: its short convolution reads the tokens before "
                "each one, across a document's start")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        n, H, D, HD = dims.n_layer, dims.n_head, dims.d_model, dims.n_head * dims.head_dim

        def weight(*shape):
            return nn.Parameter(torch.randn(n, *shape) * cfg.init_std)

        self.w_down, self.w_up = weight(cfg.w_rank, D), weight(HD, cfg.w_rank)
        self.w_conv = weight(HD, cfg.conv_size)
        self.beta_weight, self.beta_bias = weight(H, D), nn.Parameter(torch.zeros(n, H))
        # FoX's gate, with its init (N(0, 0.02^2), bias 0), the reference's g_proj's too
        self.forget = FoX(FoxConfig(), dims) if cfg.forget_gate else None

    def reflections(self, x: torch.Tensor, layer: int):
        """w (B, H, T, d) and β (B, H, T) of every token, fp32 at least."""
        B, T, _ = x.shape
        H, d, K = self.dims.n_head, self.dims.head_dim, self.cfg.conv_size
        dtype = torch.promote_types(x.dtype, torch.float32)
        x = x.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            y = x @ self.w_down[layer].to(dtype).T @ self.w_up[layer].to(dtype).T  # (B, T, H d)
            # depthwise and causal: token t mixes tokens t-K+1..t, zeros before the sequence
            y = F.conv1d(F.pad(y.transpose(1, 2), (K - 1, 0)),
                         self.w_conv[layer].to(dtype).unsqueeze(1), groups=H * d)
            y = F.silu(y).view(B, H, d, T).transpose(-2, -1)
            w = y * torch.rsqrt(y.square().sum(-1, keepdim=True) + W_NORM_EPS)
            beta = 2 * torch.sigmoid(x @ self.beta_weight[layer].to(dtype).T
                                     + self.beta_bias[layer].to(dtype))
        return w, beta.transpose(1, 2)

    def row_mod(self, logits, q, k, pos, layer, q_idx, kv_idx, *, x):
        rows, end = q_idx.flatten(), kv_idx.shape[-1]
        w, beta = self.reflections(x[:, :end], layer)
        dtype = w.dtype
        with torch.autocast(x.device.type, enabled=False):
            path = path_logits(q[:, :, :end].to(dtype), k[:, :, :end].to(dtype), w, beta, rows)
            if self.forget is not None:
                clock = self.forget.log_forget(x[:, :end], layer).cumsum(-1)  # c_t, (B, H, T)
                path = path + clock[:, :, rows, None] - clock[:, :, None, :]
        return path / math.sqrt(q.shape[-1])

    def flops(self, batch, length, pairs):
        """w's low-rank projection, convolution, SiLU and norm, and β, per token; the UT transform
        of each chunk of CHUNK tokens (path_logits), per token; each query carried through the
        earlier chunks, per pair whose key lies in one; the scaling of every logit; and with
        forget_gate FoX's."""
        H, d, D, C = self.dims.n_head, self.dims.head_dim, self.dims.d_model, CHUNK
        r, K = self.cfg.w_rank, self.cfg.conv_size
        reflections = 2 * (D * r + r * H * d + D * H) + H * (2 * K * d + 3 * d + 5)
        # W W^T, W K^T, U^T W, Q W^T, (Q W^T) Z, Q K^T (each 2Cd), W^T Z (2d^2), (Q W^T) U (2C^2),
        # the unit triangular solve for d + C columns, and 4C + 4d + d^2/C elementwise
        transform = H * (12 * C * d + 3 * d * d + 2 * C * C + (C - 1) * (d + C) + 4 * C
                         + 4 * d + d * d / C)
        earlier = max(0.0, pairs - length * C / 2)  # pairs whose key is in an earlier chunk
        per_pair = H * (2 * d + 2 * d * d / C)
        own = batch * (length * (reflections + transform) + earlier * per_pair + H * pairs)
        gate = self.forget.flops(batch, length, pairs) if self.forget is not None else 0.0
        return self.dims.n_layer * own + gate


def path_logits(q, k, w, beta, rows):
    """q_i^T H_i ... H_{j+1} k_j for the query rows `rows` (consecutive sequence indices) and every
    key j < T, (B, H, len(rows), T); entries j > i are finite and meaningless (masked later).
    q, k, w (B, H, T, d), beta (B, H, T)."""
    B, H, T, d = q.shape
    C = CHUNK
    pad = -T % C
    q, k, w = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, w))
    beta = F.pad(beta, (0, pad))  # β = 0 past the end: H = I
    n = (T + pad) // C
    Q, K, W = (t.view(B, H, n, C, d) for t in (q, k, w))
    bet = beta.view(B, H, n, C, 1)
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    # (I + diag(β) strict_lower(W W^T)) Z = diag(β) W and the same for U[s, j], per chunk; one
    # solve for both right-hand sides (CPU's batched triangular solve is slow for a narrow one)
    system = eye + bet * (W @ W.transpose(-2, -1)).masked_fill(~strict, 0.0)
    rhs = torch.cat((W, (W @ K.transpose(-2, -1)).masked_fill(~strict, 0.0)), dim=-1) * bet
    Z, U = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
        (d, C), dim=-1)  # Z (n, C, d), U (n, C, C)
    carried = K - U.transpose(-2, -1) @ W  # keys carried to the end of their chunk
    chunk_map = torch.eye(d, dtype=q.dtype, device=q.device) - W.transpose(-2, -1) @ Z  # (n, d, d)
    qw = (Q @ W.transpose(-2, -1)).tril()  # q_i.w_s for s <= i
    q_start = Q - qw @ Z  # queries carried back to the start of their chunk
    within = (Q @ K.transpose(-2, -1)).tril() - qw @ U  # (n, C, C), j <= i in the same chunk

    chunk_of = rows // C  # (R,)
    q_rows = q_start.view(B, H, n * C, d)[:, :, rows]
    carry = q_rows.new_zeros(q_rows.shape)
    blocks = [None] * n
    # earlier chunks, near to far, from the last: the row_mod's rows end at T - 1 (the block's
    # keys end with its queries), and rows that end sooner carry zeros until their own chunk,
    # so no row index is read on the host
    for J in range(n - 2, -1, -1):
        carry = torch.where((chunk_of == J + 1).view(1, 1, -1, 1), q_rows, carry)
        blocks[J] = carry @ carried[:, :, J].transpose(-2, -1)
        carry = carry @ chunk_map[:, :, J]
    zeros = q_rows.new_zeros(B, H, len(rows), C)
    out = torch.cat([b if b is not None else zeros for b in blocks], dim=-1)  # (B, H, R, n C)
    own = within.view(B, H, n * C, C)[:, :, rows]  # each row's keys in its own chunk
    cols = (chunk_of * C).view(-1, 1) + torch.arange(C, device=q.device)
    out = out.scatter(-1, cols.expand(B, H, -1, -1), own)
    return out[..., :T]
