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


def assert_shift_invariant(model, idx, offsets=(1, 17, 1000), per_sequence=False):
    """A relative encoding must give the same logits when every position moves by the same c.
    per_sequence: also when each sequence has its own offset, 10^6 apart (lag tables must span
    one sequence, not the gap between them)."""
    B, T = idx.shape
    shifts = [torch.arange(T) + c for c in offsets]
    if per_sequence:
        shifts.append(torch.arange(T) + 10**6 * torch.arange(B).view(B, 1))
    with torch.no_grad():
        base = model(idx)
        for pos in shifts:
            shifted = model(idx, pos=pos)
            assert ((shifted - base).abs() <= 1e-5 * base.abs().clamp(min=1)).all(), pos[..., 0]
    return base
