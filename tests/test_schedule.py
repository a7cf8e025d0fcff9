"""Switching the encoding during training (posbench/model/schedule.py, DroPE) and model.qk_norm
(docs/encodings.md#dropping-the-encoding-during-training)."""
import math
import re

import pytest
import torch

import posbench
import posbench.runs.train
from posbench.core.errors import ConfigError
from posbench.runs.run import RunFailed, train, trained_model

TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "train.seq_len=32"]
RUN = ["encoding=rope", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
       "train.seq_len=32", "train.batch_size=2", "train.steps=6", "train.warmup_steps=1",
       "train.log_every=2", "train.ckpt_every=2", "train.val_every=0",
       "train.switch_encoding_at=0.5", "model.qk_norm=true", "eval.lengths=[32]",
       "eval.tokens=128", "device=cpu"]


def build(*overrides):
    cfg = posbench.compose([*TINY, *overrides])
    posbench.config.check(cfg)
    torch.manual_seed(0)
    return posbench.build_model(cfg, 64).eval()


def same_weights(model, *overrides):
    """A model of another config with `model`'s weights (the encodings hold none here)."""
    other = build(*overrides)
    other.load_state_dict({k: v for k, v in model.state_dict().items()
                           if not k.startswith("encoding.")})
    return other


def test_the_dropped_schedule_is_rope_before_the_switch_and_nope_from_it():
    model = build("encoding=rope", "train.steps=16", "train.switch_encoding_at=0.875")
    with torch.no_grad():  # attention that positions move
        for block in model.blocks:
            block.attn.qkv.weight[:64] *= 8
    rope, nope = same_weights(model, "encoding=rope"), same_weights(model, "encoding=nope")
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for step, reference in ((0, rope), (13, rope), (14, nope), (15, nope)):
            model.encoding.at_step(step)  # 14 = round(0.875 * 16), DroPE's 14K of 16K
            assert torch.equal(model(idx), reference(idx)), step
        assert not torch.allclose(rope(idx), nope(idx), atol=1e-3)


def test_the_phase_is_saved_with_the_weights():
    model = build("train.steps=10", "train.switch_encoding_at=0.3")
    model.encoding.at_step(3)
    other = build("train.steps=10", "train.switch_encoding_at=0.3")
    assert not other.encoding.switched
    other.load_state_dict(model.state_dict())
    assert other.encoding.switched and other.encoding.rotate is None


def test_qk_norm_is_rmsnorm_over_the_model_width_with_a_learned_gain():
    model = build("encoding=nope", "model.qk_norm=true")
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 2)
        attn.k_norm.weight.uniform_(0.5, 2)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    attn = attn.double()
    q, k, v = attn.heads(x, torch.arange(9).expand(2, 9), model.encoding)
    lin = x @ attn.qkv.weight.T
    want = []
    for part, norm in ((lin[..., :32], attn.q_norm), (lin[..., 32:64], attn.k_norm)):
        rms = (part.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
        want.append((part / rms * norm.weight).view(2, 9, 2, 16).transpose(1, 2))
    torch.testing.assert_close(q, want[0])
    torch.testing.assert_close(k, want[1])
    torch.testing.assert_close(v, lin[..., 64:].view(2, 9, 2, 16).transpose(1, 2))
    trained = build("encoding=nope", "model.qk_norm=true").train()
    trained(torch.zeros(1, 8, dtype=torch.long), targets=torch.ones(1, 8, dtype=torch.long)) \
        .sum().backward()
    assert all(block.attn.q_norm.weight.grad.abs().sum() > 0 for block in trained.blocks)


def run(tmp_path, name, fail_at=None, monkeypatch=None):
    cfg = posbench.compose(RUN)
    if fail_at is not None:  # a kill at step fail_at, after the checkpoint before it
        real, calls = posbench.runs.train.train_step, []

        def dies(*args, **kwargs):
            calls.append(1)
            if len(calls) == fail_at + 1:
                raise RuntimeError("killed")
            return real(*args, **kwargs)

        monkeypatch.setattr(posbench.runs.train, "train_step", dies)
        with pytest.raises(RunFailed):
            train(cfg, tmp_path / name, group="test", name=name)
        monkeypatch.setattr(posbench.runs.train, "train_step", real)
    return train(cfg, tmp_path / name, group="test", name=name)


def test_a_run_killed_across_the_switch_resumes_bit_for_bit(tmp_path, monkeypatch):
    """Switch at step 3 of 6, checkpoints every 2 steps: killed in step 3, the first without
    RoPE, the run resumes from its checkpoint after step 2 and trains through the switch again,
    ending where the uninterrupted run ends, bit for bit."""
    whole = run(tmp_path, "whole")
    resumed = run(tmp_path, "resumed", fail_at=3, monkeypatch=monkeypatch)
    assert resumed["train"]["resumed_from_step"] == 2  # the last checkpoint before the kill
    assert resumed["eval"]["curve"] == whole["eval"]["curve"]
    assert resumed["train"]["final_loss"] == whole["train"]["final_loss"]
    a, b = (trained_model(tmp_path / name).model for name in ("whole", "resumed"))
    assert a.encoding.switched and b.encoding.switched
    for (key, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert x == y if key.endswith("_extra_state") else torch.equal(x, y), key
    assert math.isfinite(whole["train"]["final_loss"])


@pytest.mark.parametrize("overrides, message", [
    (["train.switch_encoding_at=1.5"], "train.switch_encoding_at=1.5 is not accepted"),
    (["train.switch_encoding_at=0.5", "train.switch_encoding_to=nop"], "(did you mean 'nope'?)"),
    (["train.switch_encoding_at=0.5", "eval.rope_scaling=yarn"],
     "'none' for train.switch_encoding_to=nope"),
])
def test_bad_switches_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        posbench.config.check(posbench.compose(["encoding=rope", *overrides]))
