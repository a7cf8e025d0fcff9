"""train.compile: every encoding's training step is one graph that reads no tensor on the host.

A host read (.item(), int(tensor), a data-dependent shape) is a sync per step on CUDA, and a graph
break under train.compile on the torch of the GPU runs (2.11); newer torch traces some of them as
a value known only at run time (an unbacked symbol), still a sync. The backend below runs the
graph as backend="eager" does, after failing on any such value, and fullgraph=True makes a graph
break an error. The step is posbench.runs.train.train_step, given the compiled model as
runs/train.py gives it under train.compile.
"""
import copy

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

import posbench
import posbench.attention.paths as paths
from posbench.runs.extend import pose_positions
from posbench.runs.train import make_optimizer, train_step
from helpers import composed

SHAPE = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "train.seq_len=32"]
VOCAB = 64
# randomized's base sizes its lag tables for the draws below M
CASES = [[f"encoding={name}"] for name in posbench.list_encodings()] + [
    ["encoding=randomized", "encoding.base=transformer_xl", "encoding.max_len=256"]]


def no_host_reads(gm, example_inputs):
    """A dynamo backend: backend="eager" once no node's value depends on a tensor's contents."""
    for node in gm.graph.nodes:
        if free_unbacked_symbols(node.meta.get("example_value")):
            frames = node.meta.get("stack_trace", "").strip().splitlines()[-2:]
            pytest.fail(f"host read of a tensor in the training step: {node.format_node()}\n"
                        + "\n".join(frames))
    return gm.forward


def build(overrides):
    cfg = composed(*overrides, *SHAPE)
    torch.manual_seed(0)
    return cfg, posbench.build_model(cfg, VOCAB)


def batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (2, 32), generator=g) for _ in range(2))


def step(cfg, model, step_fn, x, y, pos=None):
    """train_step's loss (the model is updated)."""
    torch.manual_seed(2)  # randomized draws its positions in the forward
    return train_step(model, step_fn, make_optimizer(model, cfg.train, x.device), x, y, lr=1e-3,
                      grad_clip=1.0, pos=pos)


def compiled(model):
    torch._dynamo.reset()  # 40 models of one GPT.forward would pass dynamo's recompile limit
    return torch.compile(model, fullgraph=True, backend=no_host_reads)


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: "-".join(s.split("=")[1] for s in o))
def test_training_step_compiles_to_one_graph_without_host_reads(overrides):
    cfg, model = build(overrides)
    twin = copy.deepcopy(model)
    x, y = batch()
    loss = step(cfg, model, compiled(model), x, y)
    # eager reads the positions to take its shortcuts; the graph takes those it knows it may
    torch.testing.assert_close(loss, step(cfg, twin, twin, x, y), rtol=1e-6, atol=0)
    # the backward ran through the graph: the same gradients (clipped) as eager's
    for (key, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), key
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", ["alibi", "sandwich"])
def test_a_fixed_lag_bias_compiles_to_its_table_where_positions_are_the_index(name,
                                                                               monkeypatch):
    """The model's own positions (pos=None) are known to step by one: the graph takes the lag
    table's fused path, as eager does (about NoPE's step, where the blockwise masks cost ALiBi
    14%: docs/benchmarks.md); positions passed in are not, and take the blockwise path."""
    traced = []
    real = paths.lag_bias_attention
    monkeypatch.setattr(paths, "lag_bias_attention", lambda *a: traced.append(1) or real(*a))
    cfg, model = build([f"encoding={name}"])
    twin = copy.deepcopy(model)
    x, y = batch()
    loss = step(cfg, model, compiled(model), x, y)
    assert len(traced) == cfg.model.n_layer  # each layer's call, traced once
    torch.testing.assert_close(loss, step(cfg, twin, twin, x, y), rtol=1e-6, atol=0)
    traced.clear()
    step(cfg, model, compiled(model), x, y, pos=torch.arange(32))
    assert traced == []


@pytest.mark.parametrize("name", ["t5", "kerple_log"])
def test_a_learned_lag_bias_is_one_call_in_the_graph(name):
    """A learned bias's blocks are the biased_attention custom op in the compiled graph, its
    backward the eager chunked one, not their slices traced into it: one call per layer."""
    targets = []

    def recording(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes)
        return no_host_reads(gm, example_inputs)

    cfg, model = build([f"encoding={name}"])
    torch._dynamo.reset()
    x, y = batch()
    step(cfg, model, torch.compile(model, fullgraph=True, backend=recording), x, y)
    assert targets.count(torch.ops.posbench.biased_attention.default) == cfg.model.n_layer


@pytest.mark.parametrize("name", ["sandwich", "fire", "transformer_xl", "learned"])
def test_bounds_from_the_config_cover_pose_positions(name):
    """In training, lag tables and learned's check are sized from max(T, train.pose_span), not
    read from the positions: PoSE's, up to pose_span - 1, give the loss that the same weights give
    at evaluation, where the bound is read from the positions."""
    pos = pose_positions(0, 0, 2, 32, 200)
    assert int(pos.max()) > 64  # lags far past the sequence length: not vacuous
    x, y = batch()
    cfg, model = build([f"encoding={name}", "train.pose_span=200"])
    _, reference = build([f"encoding={name}", "train.pose_span=200"])
    expected = reference.eval()(x, pos=pos, targets=y).mean()
    torch.testing.assert_close(step(cfg, model, compiled(model), x, y, pos), expected,
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", posbench.list_encodings())
def test_whether_a_score_mod_learns_is_decided_without_reading_a_tensor(name):
    """On CUDA, attend asks whether a gradient flows into the score_mod's tensors before it
    picks FlexAttention; the CPU never asks. Asked with 0-d indices, T5's and FIRE's score_mods
    read them on the host: a graph break under train.compile that torch 2.11 on an H100 turned
    into a crash (2026-11-27). Here the question is traced with fullgraph on the CPU."""
    cfg, model = build([f"encoding={name}"])
    q = torch.randn(2, 2, 32, 16, requires_grad=True)
    x = torch.randn(2, 32, 32, requires_grad=True)
    pos = torch.arange(32).expand(2, 32)
    score_mod, _, _ = paths.bound_hooks(q, q, pos, *model.encoding.at_layer(0), x)
    if score_mod is None:
        pytest.skip(f"{name} has no score_mod")
    learns = paths._learns_through(score_mod, q)
    torch._dynamo.reset()
    traced = torch.compile(lambda q: paths._learns_through(score_mod, q), fullgraph=True,
                           backend=no_host_reads)(q)
    assert traced == learns
    learned = {n for n, p in model.encoding.named_parameters() if p.requires_grad}
    if name in ("t5", "fire", "kerple_log"):
        assert learns and learned, name
    if name in ("alibi", "sandwich"):
        assert not learns, name
