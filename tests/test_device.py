"""The RNG states a checkpoint keeps (posbench/device.py), across the device it resumes on."""
import torch

from posbench.device import rng_state, set_rng_state


def test_a_cpu_checkpoint_resumes_on_cuda_with_the_seeded_cuda_generator(monkeypatch):
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *args: restored.append(args))
    saved = rng_state(torch.device("cpu"))
    assert "cuda" not in saved
    expected = torch.rand(3)
    set_rng_state(saved, torch.device("cuda"))
    assert torch.equal(torch.rand(3), expected) and restored == []
    set_rng_state({**saved, "cuda": "state"}, torch.device("cuda", 0))
    assert restored == [("state", torch.device("cuda", 0))]
