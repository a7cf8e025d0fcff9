"""Every encoding's evaluation paths give its training path's logits on the same weights.
Evaluation (no gradient) takes faster exact paths of its own (posbench/attention/lag_bias.py: lag
tables, rows of lags, decays, a bias's low-rank factors); a slip in one of them scores a model other
than the one trained, on one device and not the other. Both forwards here run in eval mode in
float64, so the paths are all that differs."""
import pytest
import torch

import posbench

from helpers import off_init, tiny_model

TRAIN_LEN, LENGTH = 32, 96  # scored past the training length, where the lag tables reach
# grape_a's gates take another bias_factors branch each; p_rope's and clipped_rope's variants
# another spectrum
CASES = [(name, ()) for name in posbench.list_encodings()] + [
    ("grape_a", (f"encoding.gate={gate}",)) for gate in ("query", "key", "none")] + [
    ("p_rope", ("encoding.p=0.5", f"encoding.variant={v}")) for v in ("reversed", "partial")] + [
    ("clipped_rope", ("encoding.variant=hard",))]
# model.attn_gate and model.attn_sinks on an encoding of each evaluation path: sinks take the
# blockwise path in place of the lag tables, a gate alone keeps them
KNOBS = ["nope", "rope", "alibi", "t5", "fire", "transformer_xl", "decay", "fox",
         "stick_breaking", "shaw"]
CASES += [(name, ("model.attn_gate=elementwise", "model.attn_sinks=true")) for name in KNOBS] + [
    (name, ("model.attn_gate=headwise",)) for name in KNOBS]


@pytest.mark.parametrize("name, extra", CASES, ids=[" ".join((n, *e)) for n, e in CASES])
def test_evaluation_paths_give_the_training_paths_logits(name, extra):
    model = off_init(tiny_model(f"train.seq_len={TRAIN_LEN}", f"eval.lengths=[{LENGTH}]",
                                *extra, name=name).double())
    idx = torch.randint(0, 64, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        evaluated = model(idx)
    with torch.enable_grad():
        trained = model(idx)
    torch.testing.assert_close(evaluated, trained.detach(), rtol=1e-9, atol=1e-9)
