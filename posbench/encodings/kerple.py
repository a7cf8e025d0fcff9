"""KERPLE: a learned conditionally-positive-definite kernel of the lag as a per-head bias.

log:   b_h = -r1_h * log(1 + r2_h * |i - j|)
power: b_h = -r1_h * |i - j|^r2_h,   0 < r2 <= 2

r1 and r2 are per head and shared by all layers (chijames/KERPLE). The reference clamps them into
range after every optimizer step; here a global optimizer step post-hook does that, so that the
training loop needs no KERPLE branch (see Kerple.__init__), and the bias reads clamped values.
"""
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from posbench.core.errors import ConfigError
from posbench.encodings.base import EncodingConfig, PositionalEncoding, relative_lag, register

R_MIN = 0.01  # both parameters stay >= R_MIN (chijames/KERPLE eps)
POWER_R2_MAX = 2.0  # conditional positive definiteness of -|x|^p needs p <= 2
KERNELS = ("log", "power")


@dataclass
class KerpleConfig(EncodingConfig):
    kernel: str = "log"


def kerple_bias(lag: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, kernel: str) -> torch.Tensor:
    """The kernel's bias at lag >= 0: 0 at lag 0 and non-increasing in the lag."""
    if kernel == "log":
        return -r1 * torch.log1p(r2 * lag)
    return -r1 * lag ** r2


def _clamp_after_step(module_ref):
    def hook(optimizer, args, kwargs):
        module = module_ref()
        if module is not None:
            module.clamp_()

    return hook


class Kerple(PositionalEncoding):
    family = "bias"
    additive_score_mod = True
    lag_only_bias = True
    relative = True
    past_train_len = "a learned decay defined at every lag (log: slow, power: polynomial)"
    reference = ("KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation "
                 "(Chi et al. 2022)")

    Config = KerpleConfig

    @classmethod
    def check(cls, cfg, run_cfg):
        if cfg.kernel not in KERNELS:
            raise ConfigError(f"encoding.kernel={cfg.kernel!r} is not accepted; "
                              f"expected one of {KERNELS}")

    def __init__(self, cfg, dims):
        super().__init__(cfg, dims)
        # chijames/KERPLE init: log r1 ~ U(0,2), r2 ~ U(0,1); power r1 ~ U(0,1), r2 ~ U(0,2)
        r1_scale, r2_scale = (2.0, 1.0) if cfg.kernel == "log" else (1.0, 2.0)
        self.r1 = nn.Parameter(torch.rand(dims.n_head) * r1_scale)
        self.r2 = nn.Parameter(torch.rand(dims.n_head) * r2_scale)
        self.clamp_()
        # Projected descent, as in the reference: after every optimizer step the parameters are
        # clamped back, so the next step starts from the bound (a clamp inside forward would
        # zero the gradient of a parameter below the bound and freeze that head for good). The
        # hook is global, so it needs no training-loop change; it holds the module weakly and
        # goes away with it.
        handle = register_optimizer_step_post_hook(_clamp_after_step(weakref.ref(self)))
        weakref.finalize(self, handle.remove)

    def bounded(self):
        """(r1, r2) clamped into the kernel's range, differentiable inside it."""
        r2_max = POWER_R2_MAX if self.cfg.kernel == "power" else None
        return self.r1.clamp(min=R_MIN), self.r2.clamp(min=R_MIN, max=r2_max)

    @torch.no_grad()
    def clamp_(self) -> None:
        r1, r2 = self.bounded()
        self.r1.copy_(r1)
        self.r2.copy_(r2)

    def score_mod(self, q, k, pos, layer):
        # The hook keeps the stored values in range during training; clamping here as well keeps
        # the kernel defined for values set any other way (log1p(r2 * lag) is NaN for r2 < 0).
        # Inside the range, the only place training visits, this clamp passes gradients unchanged.
        (r1, r2), kernel = self.bounded(), self.cfg.kernel
        lag_of = relative_lag(pos)

        def kerple(score, b, h, q_idx, kv_idx):
            # future keys (negative lag) are masked afterwards; clamp keeps the bias finite
            lag = lag_of(b, q_idx, kv_idx).clamp(min=0).to(r1.dtype)
            return score + kerple_bias(lag, r1[h], r2[h], kernel)

        return kerple

    def flops(self, batch, length, pairs):
        # the lag of the shared position row; per head log: r2 x, log1p, -r1 x (power: x^r2,
        # -r1 x); added to each score
        H = self.dims.n_head
        per_head = 3 if self.cfg.kernel == "log" else 2
        return self.dims.n_layer * pairs * (1 + per_head * H + batch * H)


register("kerple_log", "learned per-head bias -r1*log(1 + r2*lag), shared by all layers",
         KerpleConfig(kernel="log"))(Kerple)
register("kerple_power", "learned per-head bias -r1*lag^r2 (0 < r2 <= 2), shared by all layers",
         KerpleConfig(kernel="power"))(Kerple)
