"""Every encoding under bf16 autocast against fp32 on the same weights: the one check of the GPU's
numerics (CUDA trains and evaluates under torch.autocast(bfloat16)) that a CPU allows. CPU
autocast rounds the same ops to bf16: linear layers, matmuls and scaled_dot_product_attention.
It checks where the encodings cast, not CUDA's kernels (score_mods run in FlexAttention there).

The models run 512 tokens at positions 7680..8191, 8x their training length of 64. The error is
the relative RMS of the logits. bf16 alone sets its floor, NoPE's error on the same weights; each
family may exceed that floor by what its formula adds to the rounding (FACTOR), and no more.
"""
import copy
import math

import pytest
import torch
from omegaconf import OmegaConf

import posbench
from posbench.encodings import Dims, registry

from test_enc_group import generator

T, END, TRAIN_LEN = 512, 8192, 64

# The most each family's error may reach, as a multiple of NoPE's; measured over four seeds of
# weights and tokens after the fix (and before it, where a cast lost what the formula needs):
FACTOR = {
    # positions join the fp32 residual stream before anything is rounded (randomized: its RoPE
    # base's rounding): <= 1.03
    "absolute": 1.5,
    # q and k are rounded to bf16 once more after the rotation, as HF's RoPE does: <= 1.03
    "rotary": 1.5,
    # the bias joins bf16 scores; Shaw's q.w_K is one more bf16 matmul: <= 1.30
    "bias": 2.0,
    # the shear's terms, εΔ up to 8 here, scale the rounding of q and k themselves: <= 1.41
    # (q and k rounded to bf16 after the shear: >= 5.2)
    "group": 2.0,
    # a CoPE count adds up to 63 in gates, each moved by its logit's rounding: <= 3.1 (counted
    # in bf16: >= 7.8)
    "contextual": 5.0,
    # layer patterns of the above: the registered ones mix rotary and NoPE layers
    "hybrid": 1.5,
}


@pytest.fixture(scope="module")
def run_cfg():
    return posbench.compose(["encoding=nope", "model.n_layer=1", "model.d_model=64",
                             "model.n_head=2", f"train.seq_len={TRAIN_LEN}",
                             f"eval.lengths=[{END}]"])


@pytest.fixture(scope="module")
def nope(run_cfg):
    torch.manual_seed(0)
    model = posbench.build_model(run_cfg, vocab_size=64).eval()
    with torch.no_grad():  # sharper attention, so that positions move the logits
        for block in model.blocks:
            block.attn.qkv.weight[:2 * 64] *= 8
    return model


def logits(model, autocast: bool) -> torch.Tensor:
    idx = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return model(idx, pos=torch.arange(END - T, END)).float()


def relative_error(model):
    """(relative RMS error of the autocast logits, the fp32 logits)."""
    exact = logits(model, autocast=False)
    return ((logits(model, autocast=True) - exact).norm() / exact.norm()).item(), exact


@pytest.fixture(scope="module")
def nope_run(nope):
    """NoPE's (error, fp32 logits): its error is bf16's floor."""
    return relative_error(nope)


def test_nope_error_is_the_bf16_floor(nope_run):
    # 8-bit mantissas round by up to 2^-9 = 2e-3, a few roundings deep; 0 would mean no autocast
    assert 1e-3 < nope_run[0] < 1e-2


@pytest.mark.parametrize("name", [name for name, entry in registry().items()
                                  if entry.cls.family != "none"])
def test_autocast_logits_match_fp32_within_the_family_tolerance(name, run_cfg, nope, nope_run):
    cfg = copy.deepcopy(run_cfg)
    cfg.encoding = OmegaConf.structured(registry()[name].config)
    torch.manual_seed(0)  # the encoding's own initial weights, whatever ran before this test
    model = posbench.build_model(cfg, vocab_size=64).eval()
    model.load_state_dict(nope.state_dict(), strict=False)  # NoPE's weights, its own encoding's
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off their init: T5's bias and CoPE's table start at zero
        for p in model.encoding.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    err, exact = relative_error(model)
    floor, nope_exact = nope_run
    # not vacuous: the encoding moves the fp32 logits away from NoPE's by more than bf16's own
    # rounding (FIRE, whose bias reads position over position, moves them by about 1% this far)
    assert (exact - nope_exact).norm() / nope_exact.norm() > 2 * floor
    factor = FACTOR[model.encoding.family]
    assert err <= factor * floor, f"{err:.2e} > {factor} x NoPE's {floor:.2e}"


@pytest.mark.parametrize("position", [2048, 8192])
def test_group_shear_logits_under_autocast_match_float64(position):
    """jordan_rope at the default shape (head dim 32, L = 128): q.k/sqrt(d) of the 256 queries
    that end at `position` against their keys, from the q and k that rotate returns under
    autocast, against q_i^T exp((i - j) X) k_j / sqrt(d) from the dense generator's matrix
    exponential in float64, on the same bf16 inputs. With q and k rounded to bf16 after the shear
    the error was 0.21 at 2048 and 1.03 at 8192 (RoPE's, rounded the same way: 0.021, 0.023); in
    fp32 it is about 2^-24 εt Σ|q_p k_p| / sqrt(d), 2e-5 at 8192."""
    d, L, n = 32, 128, 256
    entry = registry()["jordan_rope"]
    enc = entry.cls(entry.config, Dims(n_layer=1, n_head=1, d_model=d, train_len=L,
                                       max_len=position + 1))
    # bf16, as autocast's qkv layer hands them to rotate
    q, k = torch.randn(2, 1, 1, n, d, generator=torch.Generator().manual_seed(0)).bfloat16()
    pos = torch.arange(position - n + 1, position + 1).view(1, n)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q_rot, k_rot = enc.rotate(q, k, pos, 0)
    got = q_rot[0, 0].double() @ k_rot[0, 0].double().T / math.sqrt(d)
    X = generator(2, enc.frequencies()[0].tolist(), enc.shears()[0].tolist())
    q, k = q[0, 0].double(), k[0, 0].double()
    worst = 0.0
    for lag in range(n):  # the diagonal i - j = lag
        expected = ((q[lag:] @ torch.linalg.matrix_exp(lag * X)) * k[:n - lag]).sum(-1)
        worst = max(worst, (got.diagonal(-lag) - expected / math.sqrt(d)).abs().max().item())
    assert worst < 2e-4, worst


@pytest.mark.parametrize("name", ["transformer_xl", "shaw"])
def test_tables_kept_in_fp32_stay_fp32_under_autocast(name, monkeypatch):
    """Transformer-XL's lag terms and Shaw's q.w_K are built in fp32 at least, which CUDA's
    autocast would round to bf16 (CPU autocast rounds the same matmuls): the score_mod gives the
    same bias with autocast on as off, Transformer-XL's in its CUDA form (one whole table)."""
    from posbench.encodings import transformer_xl

    monkeypatch.setattr(transformer_xl, "whole_table", lambda q: True)
    cfg = posbench.compose([f"encoding={name}", "model.n_layer=1", "model.d_model=64",
                            "model.n_head=2", f"train.seq_len={TRAIN_LEN}"])
    enc = posbench.build_model(cfg, 64).encoding.eval()
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 2, 48, 32, generator=g) for _ in range(2))
    pos = torch.arange(48).expand(2, 48)
    b, h = torch.arange(2).view(2, 1, 1, 1), torch.arange(2).view(1, 2, 1, 1)
    grid = torch.arange(48).view(1, 1, 48, 1), torch.arange(48).view(1, 1, 1, 48)

    def bias():
        return enc.score_mod(q, k, pos, 0)(torch.zeros(()), b, h, *grid)

    with torch.no_grad():
        exact = bias()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rounded = bias()
    assert rounded.dtype == torch.float32
    torch.testing.assert_close(rounded, exact, rtol=1e-6, atol=1e-6)
