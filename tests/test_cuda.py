"""What only a GPU can check: CUDA's kernels (FlexAttention, flash SDPA, cuBLAS) against the CPU
on the same weights, bf16 autocast on CUDA, and a real run's evaluation at long lengths. Marked
cuda: skipped where torch sees no GPU (tests/conftest.py)."""
import copy
import math

import numpy as np
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

import posbench
import posbench.attention.paths as attention
from posbench.encodings import registry

from helpers import posbench_cli, results, tiny_model
from test_autocast import END, FACTOR, T, TRAIN_LEN
from test_length_schedule import PIECES, packs, positions_of, segments_of

pytestmark = pytest.mark.cuda

LENGTHS = (64, 256)  # the training length and 4x it
GiB = 2 ** 30


@pytest.fixture(autouse=True)
def exact_fp32(monkeypatch):
    """fp32 matmuls and convolutions (DAPE's) in fp32, not TF32 (cuDNN's default), and
    FlexAttention compiled afresh for each test: dynamo compiles one function at most 8 times,
    fewer than the encodings' score_mods."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch._dynamo.reset()
    for cache in (attention._compiled_flex, attention._compiled_block_mask, attention._block_mask):
        cache.cache_clear()


def relative_error(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def sharpen(model):
    """Sharper attention, so that positions move the logits."""
    d = model.blocks[0].attn.qkv.weight.shape[1]
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[:2 * d] *= 8  # q and k
    return model


def off_init(model):
    """The encoding's parameters moved off their init (T5's bias and CoPE's table start at
    zero)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.encoding.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def logits_and_grads(model, idx):
    """Training mode, grad enabled: the logits and every parameter's gradient of the loss, on
    the CPU."""
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(idx)
    F.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten()).backward()
    return logits, {name: None if p.grad is None else p.grad.cpu()
                    for name, p in model.named_parameters()}


def assert_gradients_close(got, expected):
    """Parameter name -> gradient (None where none flowed): the same ones flow, each within 1e-4
    relative; a gradient that is ~0 in exact arithmetic (FIRE's output bias: softmax ignores a
    shift of every score) is held to 1e-4 of a thousandth of the whole gradient's norm, not of
    its own rounding noise."""
    floor = 1e-3 * torch.cat([g.flatten() for g in expected.values() if g is not None]).norm()
    for key, grad in expected.items():
        assert (grad is None) == (got[key] is None), key
        if grad is not None:
            error = (got[key] - grad).norm() / torch.maximum(grad.norm(), floor)
            assert error < 1e-4, (key, error.item())


def eval_logits(model, idx):
    model.eval()
    with torch.no_grad():
        return model(idx)


@pytest.mark.parametrize("name", posbench.list_encodings())
def test_flex_attention_logits_and_gradients_match_the_cpu_in_fp32(name, monkeypatch):
    cpu = off_init(sharpen(tiny_model("train.seq_len=64",
                                      f"eval.lengths=[{','.join(map(str, LENGTHS))}]", name=name)))
    gpu = copy.deepcopy(cpu).cuda()
    flex_calls = []
    real = attention.flex_attention
    monkeypatch.setattr(attention, "flex_attention",
                        lambda *args, **kwargs: flex_calls.append(1) or real(*args, **kwargs))
    idx = {n: torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(n))
           for n in LENGTHS}
    # CUDA first: an encoding without a FlexAttention path on CUDA is not this test's
    train_gpu = logits_and_grads(gpu, idx[64].cuda())
    eval_gpu = {n: eval_logits(gpu, idx[n].cuda()) for n in LENGTHS}
    if not flex_calls:
        pytest.skip(f"{name} takes no FlexAttention path on CUDA")
    logits, grads = logits_and_grads(cpu, idx[64])
    assert relative_error(train_gpu[0], logits) < 1e-4
    assert_gradients_close(train_gpu[1], grads)
    for n in LENGTHS:
        assert relative_error(eval_gpu[n], eval_logits(cpu, idx[n])) < 1e-4, n


def autocast_error(model, idx, pos):
    """The relative error of the logits under bf16 autocast on CUDA against fp32 on CUDA."""
    with torch.no_grad():
        exact = model(idx, pos=pos)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            rounded = model(idx, pos=pos).float()
    return relative_error(rounded, exact)


@pytest.mark.parametrize("name", [name for name, entry in registry().items()
                                  if entry.cls.family != "none"])
def test_autocast_logits_on_cuda_within_the_family_factor_of_nopes_error(name):
    """tests/test_autocast.py on CUDA: 512 tokens at positions 7680..8191, 8x the training
    length, NoPE's weights in both models."""
    base = ["model.n_layer=1", "model.d_model=64", "model.n_head=2",
            f"train.seq_len={TRAIN_LEN}", f"eval.lengths=[{END}]"]
    torch.manual_seed(0)
    nope = sharpen(posbench.build_model(posbench.compose(["encoding=nope", *base]), 64))
    model = posbench.build_model(posbench.compose([f"encoding={name}", *base]), 64)
    model.load_state_dict(nope.state_dict(), strict=False)  # NoPE's weights, its own encoding's
    off_init(model)
    idx = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(0)).cuda()
    pos = torch.arange(END - T, END, device="cuda")
    floor = autocast_error(nope.cuda().eval(), idx, pos)
    assert 1e-3 < floor < 1e-2  # bf16's rounding; 0 would mean no autocast
    err = autocast_error(model.cuda().eval(), idx, pos)
    factor = FACTOR[model.encoding.family]
    assert err <= factor * floor, f"{err:.2e} > {factor} x NoPE's {floor:.2e}"


@pytest.mark.parametrize("name", ["alibi", "t5"])  # FlexAttention in training; in eval only
def test_a_cuda_run_scores_nine_lengths_to_16384_without_recompiles_or_dense_scores(name,
                                                                                  tmp_path):
    lengths = [64 * 2 ** i for i in range(9)]  # 64 .. 16384
    proc = posbench_cli("train", f"encoding={name}", "device=cuda", "model.n_layer=2",
                        "model.d_model=64", "model.n_head=4", "train.seq_len=64",
                        "train.batch_size=8", "train.steps=20", "train.warmup_steps=2",
                        "train.val_every=10", f"eval.lengths=[{','.join(map(str, lengths))}]",
                        "eval.tokens=16384", "hydra.run.dir=run", cwd=tmp_path, timeout=300)
    curve = results(tmp_path / "run")["eval"]["curve"]
    assert [p["length"] for p in curve] == lengths
    assert all(math.isfinite(p.get("loss", math.nan)) for p in curve), curve  # none "oom"
    assert "recompile_limit" not in proc.stderr
    assert "materializes the full scores" not in proc.stderr


@pytest.mark.parametrize("name", ["rope", "alibi"])  # flash SDPA; FlexAttention
def test_gpt2_small_scores_65536_tokens_in_under_16_gib(name):
    cfg = posbench.compose(["model=gpt2-small", f"encoding={name}", "eval.lengths=[65536]"])
    model = posbench.build_model(cfg, vocab_size=50257).cuda().eval()
    idx = torch.randint(0, 50257, (1, 65537), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        losses = model(idx[:, :-1], targets=idx[:, 1:])
    assert losses.shape == (1, 65536) and torch.isfinite(losses).all()
    assert torch.cuda.max_memory_allocated() < 16 * GiB, torch.cuda.max_memory_allocated() / GiB


@pytest.mark.parametrize("name", posbench.list_encodings())
def test_packed_documents_on_cuda_are_each_document_alone(name):
    """train.pack_documents on CUDA (FlexAttention with a block mask of each row's documents, or
    the path the encoding takes there), fp32 in training mode: the packed rows' logits and the
    gradients of a fixed weighting of them against each document run alone on the same device
    (the CPU's float64 test of the same definition: tests/test_length_schedule.py)."""
    if not packs(name):
        pytest.skip(f"{name} refuses train.pack_documents")
    cfg = posbench.compose([f"encoding={name}", "model.n_layer=2", "model.d_model=32",
                            "model.n_head=2", "train.seq_len=32"])
    torch.manual_seed(0)
    model = off_init(posbench.build_model(cfg, 64)).cuda().train()
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 64, (2, 40), generator=gen).cuda()
    weights = torch.randn(2, 40, 64, generator=gen).cuda()
    pos, segments = positions_of(PIECES).cuda(), segments_of(PIECES).cuda()

    def weighted_logits_and_grads(forward):
        model.zero_grad(set_to_none=True)
        logits = forward()
        (logits * weights).sum().backward()
        return logits, {n: p.grad for n, p in model.named_parameters()}

    def alone():
        return torch.cat([torch.cat([model(idx[b:b + 1, a:a + n]) for a, n in
                                     zip(np.cumsum([0, *row[:-1]]), row)], 1)
                          for b, row in enumerate(PIECES)])

    packed, packed_grads = weighted_logits_and_grads(
        lambda: model(idx, pos=pos, segments=segments))
    logits, grads = weighted_logits_and_grads(alone)
    assert relative_error(packed, logits) < 1e-4
    assert_gradients_close(packed_grads, grads)


@pytest.mark.parametrize("name", ["alibi", "t5"])  # a fixed and a learned lag bias
def test_a_compiled_cuda_run_trains_and_scores(name, tmp_path):
    """train.compile=true on CUDA: the compiled graph's lag paths (a fixed table through
    FlexAttention, a learned one through biased_attention's custom ops), then evaluation."""
    proc = posbench_cli("train", f"encoding={name}", "device=cuda", "train.compile=true",
                        "model.n_layer=2", "model.d_model=64", "model.n_head=4",
                        "train.seq_len=64", "train.batch_size=8", "train.steps=20",
                        "train.warmup_steps=2", "train.val_every=10", "eval.lengths=[64,256]",
                        "eval.tokens=4096", "hydra.run.dir=run", cwd=tmp_path, timeout=300)
    run = results(tmp_path / "run")
    assert run["train"]["steps"] == 20, proc.stderr[-2000:]
    assert all(math.isfinite(p.get("loss", math.nan)) for p in run["eval"]["curve"])
    assert "recompile_limit" not in proc.stderr
