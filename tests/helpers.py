"""Checks shared by the per-encoding tests (imported as `from helpers import ...`)."""
import torch


def assert_matches_reference(out, ref, inputs, rtol=1e-5, atol=1e-5, grad_rtol=1e-4,
                             grad_atol=1e-5):
    """A fast path is only right if its output and its gradients both match the dense reference."""
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    grads = torch.autograd.grad(out.square().sum(), inputs)
    ref_grads = torch.autograd.grad(ref.square().sum(), inputs)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r.to(g.dtype), rtol=grad_rtol, atol=grad_atol)
    return grads


def assert_shift_invariant(model, idx, offsets=(1, 17, 1000)):
    """A relative encoding must give the same logits when every position moves by the same c."""
    with torch.no_grad():
        base = model(idx)
        for c in offsets:
            shifted = model(idx, pos=torch.arange(idx.shape[1]) + c)
            assert ((shifted - base).abs() <= 1e-5 * base.abs().clamp(min=1)).all(), c
    return base
