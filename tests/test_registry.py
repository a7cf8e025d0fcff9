"""Registry-wide properties: every encoding is checked the moment it is registered."""
import math

import pytest
import torch

import posbench
from posbench.encodings import registry
from posbench.runs.run import train
from helpers import composed

NAMES = sorted(registry())
SMALL = ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "train.seq_len=64"]


def build(name, length=None):
    """The encoding's small model, evaluated up to `length` (the model's widest position):
    one composition per encoding serves every test here, the length set after it."""
    cfg = composed(f"encoding={name}", *SMALL)
    if length is not None:
        cfg.eval.lengths = [length]
    torch.manual_seed(0)
    model = posbench.build_model(cfg).eval()
    with torch.no_grad():  # move zero-initialized position parameters off their init
        for p in model.encoding.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name", NAMES)
def test_shift_leaves_relative_logits_unchanged_and_moves_absolute_ones(name):
    model = build(name, 1100)
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(idx, pos=torch.arange(64))
        for c in (1, 17, 1000):
            shifted = model(idx, pos=torch.arange(64) + c)
            err = ((shifted - base).abs() / base.abs().clamp(min=1)).max().item()
            if model.encoding.relative:
                assert err <= 1e-5, f"{name} logits moved by {err:.2e} under a shift of {c}"
            else:
                assert err > 1e-4, f"{name} is absolute but a shift of {c} left its logits alone"


@pytest.mark.parametrize("name", NAMES)
def test_causal_future_tokens_change_nothing_before_them(name):
    model = build(name)
    idx = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(2))
    changed = idx.clone()
    changed[0, 30] = (idx[0, 30] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :30], b[:, :30], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[:, 30:], b[:, 30:])


@pytest.mark.parametrize("name", NAMES)
def test_prefix_consistency_or_its_expected_violation(name):
    model = build(name)
    idx = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        short, full = model(idx[:, :40]), model(idx)[:, :40]
    same = torch.allclose(short, full, atol=1e-5, rtol=1e-5)
    assert same == model.encoding.prefix_consistent


@pytest.mark.parametrize("name", NAMES)
def test_finite_at_position_offset_64k(name):
    model = build(name, 65664)
    idx = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = model(idx, pos=torch.arange(128) + 65536)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", NAMES)
def test_trains_and_evaluates_at_8x_the_training_length(name, tmp_path):
    cfg = posbench.compose([f"encoding={name}", "model.n_layer=1", "model.d_model=32",
                            "model.n_head=2", "train.steps=4", "train.batch_size=2",
                            "train.seq_len=32", "train.warmup_steps=1", "eval.lengths=[32,256]",
                            "eval.tokens=512", "device=cpu"])
    record = train(cfg, tmp_path, group="test", name=name)
    assert record["status"] == "ok" and record["encoding"] == name
    assert [p["length"] for p in record["eval"]["curve"]] == [32, 256]
    assert all(math.isfinite(p["loss"]) for p in record["eval"]["curve"])
    assert math.isfinite(record["train"]["final_loss"])


def test_every_encoding_has_family_description_and_docs_fields():
    for name, entry in registry().items():
        assert entry.description and entry.cls.past_train_len and entry.cls.reference, name
