"""Defaults that train every encoding fairly: the optimizer treatment of position parameters and
each encoding's initialization as its reference gives it (docs/encodings.md, "Training
defaults")."""
import argparse
import math

import pytest
import torch

import posbench
from posbench.encodings import registry
from posbench.runs.train import make_optimizer
from helpers import composed, registered_encoding

SMALL = ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "train.seq_len=64"]
WITH_PARAMETERS = [name for name in sorted(registry())
                   if any(True for _ in registered_encoding(name).parameters())]


def build(*overrides):
    torch.manual_seed(0)
    return posbench.build_model(composed(*SMALL, *overrides))


@pytest.mark.parametrize("name", WITH_PARAMETERS)
def test_position_parameters_get_no_weight_decay_and_weight_matrices_do(name):
    model = build(f"encoding={name}")
    optimizer = make_optimizer(model, argparse.Namespace(lr=1e-3, weight_decay=0.1,
                                                          position_lr_mult=10.0),
                               torch.device("cpu"))
    decay_of = {id(p): group["weight_decay"] for group in optimizer.param_groups
                for p in group["params"]}
    assert len(decay_of) == len(list(model.parameters()))  # every parameter exactly once
    for p in model.encoding.parameters():
        assert decay_of[id(p)] == 0.0
    for block in model.blocks:
        assert decay_of[id(block.attn.qkv.weight)] == 0.1
        assert decay_of[id(block.ln_1.weight)] == 0.0


def test_position_parameters_keep_their_values_under_a_decayed_step_with_zero_gradient():
    # AdamW with zero gradients moves a parameter only through weight decay
    model = build("encoding=t5")
    optimizer = make_optimizer(model, argparse.Namespace(lr=1.0, weight_decay=0.5,
                                                          position_lr_mult=1.0),
                               torch.device("cpu"))
    before = model.encoding.bias.detach().clone()
    token_before = model.tok_emb.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    torch.testing.assert_close(model.encoding.bias, before, rtol=0, atol=0)
    torch.testing.assert_close(model.tok_emb.weight, token_before * 0.5, rtol=0, atol=0)


def test_position_parameters_learn_at_position_lr_mult_times_the_rate(tmp_path, toy, monkeypatch,
                                                                      capsys):
    # Adam's first step moves every parameter with a non-negligible gradient by lr in size
    from helpers import run_in_process
    from posbench.runs.checkpoint import load_checkpoint

    overrides = [*toy, "encoding=t5", "train.steps=1", "train.warmup_steps=1", "train.lr=1e-3",
                 "train.position_lr_mult=7", "train.grad_clip=1e9", "eval.lengths=[32]"]
    cfg = posbench.compose(overrides)
    torch.manual_seed(cfg.seed)
    initial = posbench.build_model(cfg).state_dict()
    proc = run_in_process(["train", *overrides, f"hydra.run.dir={tmp_path}"], monkeypatch, capsys)
    assert proc.returncode == 0, proc.stderr
    trained = load_checkpoint(tmp_path / "checkpoint.pt")["model"]
    step = {key: (trained[key] - initial[key]).abs().max().item() for key in initial}
    assert step["encoding.bias"] == pytest.approx(7e-3, rel=1e-3)
    assert step["blocks.0.attn.qkv.weight"] == pytest.approx(1e-3, rel=1e-2)


def test_t5_bias_starts_as_the_reference_initializes_it():
    # Hugging Face's T5: relative_attention_bias ~ N(0, d_model^-1/2); 4096 draws
    model = build("encoding=t5", "encoding.num_buckets=512",
                  "encoding.max_distance=1024", "model.n_head=8")
    bias = model.encoding.bias.detach().double()
    assert bias.shape == (512, 8)
    std = 64 ** -0.5
    assert abs(bias.mean()) < 4 * std / math.sqrt(bias.numel())
    assert bias.std() == pytest.approx(std, rel=0.05)


def test_sinusoidal_adds_unit_sinusoids_to_sqrt_d_scaled_tokens_as_fairseq():
    # the Transformer's and fairseq's input: sqrt(D) * E[token] + PE(t), PE(t)[2i] = sin(t w_i),
    # PE(t)[2i+1] = cos(t w_i), w_i = 10000^(-2i/D); re-derived here in float64
    model = build("encoding=sinusoidal", "model.d_model=32", "model.n_head=2")
    idx = torch.tensor([[3, 1, 4, 1, 5, 9]])
    t = torch.arange(6, dtype=torch.float64)[:, None]
    w = 10000.0 ** (-torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    pe = torch.zeros(6, 32, dtype=torch.float64)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(t * w), torch.cos(t * w)
    tokens = model.tok_emb(idx).detach().double()
    got = model.encoding.embed(model.tok_emb(idx), torch.arange(6)[None], 0).detach().double()
    torch.testing.assert_close(got, math.sqrt(32) * tokens + pe, rtol=1e-6, atol=1e-6)