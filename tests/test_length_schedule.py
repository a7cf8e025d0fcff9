"""Length schedules in training (posbench/runs/lengths.py, docs/design.md#length-schedules):
SkyLadder's window per step against its published formula; its windows and packed documents
against each piece attended alone (a dense float64 oracle, and the whole model for every
encoding that accepts packing); the packed rows of the token file; a run killed and resumed
equal to an uninterrupted one; the refusals."""
import math
import re

import numpy as np
import pytest
import torch

import posbench
import posbench.attention.paths as paths
import posbench.runs.train
from posbench.attention.paths import attend
from posbench.attention.span import GLOBAL, Segmented, Span
from posbench.core.errors import ConfigError
from posbench.data.tokens import TokenData
from posbench.data.windows import IGNORE
from posbench.encodings import registry
from posbench.runs.lengths import training_batch, window_at
from posbench.runs.run import RunFailed, train
from helpers import killed_in_step, random_encoding

H, D = 2, 8
# three documents in the first row, one in the second
PIECES = [[9, 14, 17], [40]]
RUN = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "train.seq_len=32",
       "train.batch_size=2", "train.steps=6", "train.warmup_steps=1", "train.log_every=2",
       "train.ckpt_every=2", "train.val_every=0", "eval.lengths=[32]", "eval.tokens=128",
       "device=cpu"]


def test_the_window_grows_by_skyladders_formula():
    t = posbench.compose(["train.seq_len=128", "train.length_schedule=skyladder"]).train
    # SkyLadder (Zhu et al. 2025): w(t) = min(w_e, w_s + floor(alpha t)), its reference code's
    # defaults w_s = 32 and alpha = 1/8 (one token every 8 steps)
    alpha, start = 1 / 8, 32
    assert [window_at(s, t) for s in range(1000)] == [min(128, start + math.floor(alpha * s))
                                                      for s in range(1000)]
    assert window_at(767, t) == 127 and window_at(768, t) == 128  # (128 - 32) / alpha
    plain = posbench.compose(["train.seq_len=128"]).train
    assert {window_at(s, plain) for s in range(0, 5000, 7)} == {128}


def segments_of(pieces):
    return torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in pieces])


def positions_of(pieces):
    return torch.tensor([[p for n in row for p in range(n)] for row in pieces])


def encoding(name):
    return random_encoding(name, H, n_layer=1, d_model=16, vocab=64)


def dense(q, k, v, pos, enc, span, sinks):
    """Attention of one document alone, by the definition: scores q.k/sqrt(d), the encoding's
    score_mod, keys outside the causal span at -inf, a sink logit per head in the denominator."""
    n = q.shape[2]
    i, j = torch.arange(n).view(1, 1, n, 1), torch.arange(n).view(1, 1, 1, n)
    h = torch.arange(H).view(1, H, 1, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    if enc.score_mod is not None:
        scores = enc.score_mod(q, k, pos, 0)(scores, torch.zeros(1, 1, 1, 1, dtype=torch.long),
                                             h, i, j)
    visible = (j <= i) & (i - j < (span.width or n))
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.view(1, H, 1, 1).expand(1, H, n, 1)), -1)
    return (torch.softmax(scores, -1)[..., :n]) @ v


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("span", [GLOBAL, Span("sliding", 5)], ids=str)
@pytest.mark.parametrize("name", ["nope", "alibi", "t5", "fire"])
def test_packed_attention_is_each_document_attended_alone(name, span, sinks):
    """On CPU's blockwise path (none, a fixed and a learned additive bias), forward and
    gradients: the packed rows with their segments against each document's dense attention."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, H, 40, D, generator=g, dtype=torch.float64).requires_grad_()
               for _ in range(3))
    enc = encoding(name)
    sink = torch.randn(H, generator=g, dtype=torch.float64).requires_grad_() if sinks else None
    pos = positions_of(PIECES)
    out = attend(q, k, v, pos, enc, 0, span=Segmented(span, segments_of(PIECES)), sinks=sink)
    ref = torch.zeros_like(out)
    for b, row in enumerate(PIECES):
        a = 0
        for n in row:
            cut = [t[b:b + 1, :, a:a + n] for t in (q, k, v)]
            ref[b:b + 1, :, a:a + n] = dense(*cut, pos[b:b + 1, a:a + n], enc, span, sink)
            a += n
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    wrt = [q, k, v, *([sink] if sinks else []), *enc.parameters()]
    probe = torch.randn_like(ref)
    grads = torch.autograd.grad((out * probe).sum(), wrt, retain_graph=True)
    for got, want in zip(grads, torch.autograd.grad((ref * probe).sum(), wrt)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["nope", "alibi"])
def test_flexattentions_block_mask_of_the_segments_on_cpu(name, monkeypatch):
    """FlexAttention as CUDA calls it, with a block mask per sequence, run eagerly on CPU."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    monkeypatch.setattr(paths, "_compiled_flex", lambda: eager_flex)
    monkeypatch.setattr(paths, "_compiled_block_mask", lambda: create_block_mask)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, H, 40, D, generator=g) for _ in range(3))
    enc, pos, segments = encoding(name).float(), positions_of(PIECES), segments_of(PIECES)
    fn = enc.score_mod(q, k, pos, 0) if enc.score_mod is not None else None
    with torch.no_grad():
        out = paths.flex_attention(q, k, v, fn, Segmented(GLOBAL, segments))
        ref = paths.blockwise_attention(q, k, v, fn, additive=True,
                                        span=Segmented(GLOBAL, segments))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def packs(name) -> bool:
    try:
        posbench.config.check(posbench.compose([f"encoding={name}", "train.pack_documents=true"]))
    except ConfigError as err:
        assert "pack_documents" in str(err) or "attention" in str(err), err
        return False
    return True


@pytest.mark.parametrize("name", sorted(registry()))
def test_every_encoding_reads_packed_documents_as_alone_or_refuses_them(name):
    """The whole model in float64 in training mode: the packed rows (positions restarting at
    each document) against each document run alone, for every encoding the config check lets
    pack."""
    cfg = posbench.compose([f"encoding={name}", "model.n_layer=2", "model.d_model=32",
                            "model.n_head=2", "train.seq_len=32"])
    torch.manual_seed(0)
    model = posbench.build_model(cfg, 64).double().train()
    with torch.no_grad():
        for p in model.encoding.parameters():
            p.add_(0.1 * torch.randn_like(p))
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = model(idx, pos=positions_of(PIECES), segments=segments_of(PIECES))
        alone = torch.zeros_like(packed)
        for b, row in enumerate(PIECES):
            for a, n in zip(np.cumsum([0, *row[:-1]]), row):
                alone[b:b + 1, a:a + n] = model(idx[b:b + 1, a:a + n])
    same = torch.allclose(packed, alone, rtol=1e-9, atol=1e-9)
    assert same == packs(name), f"{name}: packed equals alone: {same}"


def test_skyladder_attends_within_windows_at_the_rows_positions():
    """A window of w tokens is read at its positions in the row (the reference masks the
    attention alone): an absolute encoding tells the two apart."""
    cfg = posbench.compose(["encoding=learned", "model.n_layer=1", "model.d_model=16",
                            "model.n_head=2", "train.seq_len=32"])
    torch.manual_seed(0)
    model = posbench.build_model(cfg, 64).double().eval()
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        packed = model(idx, segments=(torch.arange(32) // 12).expand(2, 32))
        at_row = torch.cat([model(idx[:, a:a + 12], pos=torch.arange(a, min(a + 12, 32)))
                            for a in (0, 12, 24)], 1)
        restarted = torch.cat([model(idx[:, a:a + 12]) for a in (0, 12, 24)], 1)
    torch.testing.assert_close(packed, at_row, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(packed, restarted, atol=1e-3)


# documents of 1 to 70 tokens back to back, each token its index in the file: a row's tokens
# say where it starts
LENGTHS = np.random.default_rng(0).integers(1, 70, size=60)
OFFSETS = np.concatenate([[0], np.cumsum(LENGTHS)])


def token_data(bos=None):
    end = OFFSETS[-1]
    return TokenData(np.arange(end + 10), OFFSETS, np.array([end, end + 10]), vocab_size=end + 10,
                     fingerprint="sha256:0", name="synthetic", bos=bos)


@pytest.mark.parametrize("bos", [None, -1])
def test_packed_rows_are_the_documents_back_to_back(bos):
    data = token_data(bos)
    x, y, pos, segments = data.document_batch(64, 16, 0, 5)
    again = data.document_batch(64, 16, 0, 5)
    assert all(torch.equal(a, b) for a, b in zip((x, y, pos, segments), again))
    assert not torch.equal(x, data.document_batch(64, 16, 0, 6)[0])
    starts = token_data().document_batch(64, 16, 0, 5)[0][:, 0]  # the same draws, no BOS
    crossed = 0
    for row, start in enumerate(starts.tolist()):
        index = np.arange(start, start + 65)
        owner = np.searchsorted(OFFSETS, index, side="right") - 1
        begins = np.r_[True, owner[1:] != owner[:-1]]
        assert (pos[row].numpy() == index[:-1] - np.maximum(OFFSETS[owner[:-1]], start)).all()
        assert (segments[row].numpy() == owner[:-1] - owner[0]).all()
        want_x = np.where(begins[:-1], bos, index[:-1]) if bos else index[:-1]
        ignored = begins[1:] | (begins[:-1] if bos else False)
        assert (x[row].numpy() == want_x).all()
        assert (y[row].numpy() == np.where(ignored, IGNORE, index[1:])).all()
        crossed += owner[-1] > owner[0]
    assert crossed >= 8  # most rows hold several documents here


def test_skyladder_and_documents_cut_a_row_into_windows_of_its_pieces():
    data = token_data()
    t = ["train.seq_len=64", "train.batch_size=4", "train.length_schedule=skyladder",
         "train.length_start=20", "train.length_every=3"]
    cfg = posbench.compose([*t, "train.pack_documents=true"])
    x, y, pos, segments = training_batch(data, cfg, 9)  # window 20 + 9 // 3 = 23
    _, _, doc_pos, docs = data.document_batch(64, 4, 0, 9)
    index = torch.arange(64)
    same = segments.unsqueeze(-1) == segments.unsqueeze(-2)
    want = (docs.unsqueeze(-1) == docs.unsqueeze(-2)) & (index // 23 == (index // 23).view(-1, 1))
    assert torch.equal(same, want) and torch.equal(pos, doc_pos)
    plain = posbench.compose(t)
    x, y, pos, segments = training_batch(data, plain, 9)
    assert pos is None and torch.equal(segments, (index // 23).expand(4, 64))
    assert training_batch(data, plain, 3 * 44)[3] is None  # the window reached L = 64


def run(tmp_path, name, *overrides):
    cfg = posbench.compose([*RUN, *overrides])
    posbench.config.check(cfg)
    return train(cfg, tmp_path / name, group="test", name=name)


# the window grows every step, 28 to 32 over the first four: a resume at step 2 lands mid-climb
LADDER = ["encoding=alibi", "train.length_schedule=skyladder", "train.length_start=28",
          "train.length_every=1", "train.pack_documents=true"]


def test_a_run_killed_and_resumed_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    whole = run(tmp_path, "whole", *LADDER)
    real = killed_in_step(monkeypatch, 3)  # after the checkpoint of step 2
    with pytest.raises(RunFailed, match="checkpoint at step 2"):
        run(tmp_path, "resumed", *LADDER)
    monkeypatch.setattr(posbench.runs.train, "train_step", real)
    resumed = run(tmp_path, "resumed", *LADDER)
    assert resumed["train"]["resumed_from_step"] == 2
    assert resumed["train"]["final_loss"] == whole["train"]["final_loss"]  # floats, exactly
    assert resumed["eval"]["curve"] == whole["eval"]["curve"]
    plain = run(tmp_path, "plain", "encoding=alibi")
    assert plain["train"]["final_loss"] != whole["train"]["final_loss"]


def test_a_corpus_of_short_documents_trains_packed_and_is_scored_as_a_stream(tmp_path):
    """Every document shorter than L: no window fits one, so training refuses, naming
    packing; packed, the rows are documents back to back, and dataset.val_stream scores
    windows across the validation documents, as WikiText's stream evaluation does."""
    corpus = tmp_path / "short"
    corpus.mkdir()
    for i in range(60):  # 20 to 29 bytes each, under L = 32 + 1
        (corpus / f"{i:02d}.txt").write_text(f"note {i}: " + "ab" * (6 + i % 5))
    data = ["dataset=text", f"dataset.path={corpus}", "dataset.val_fraction=0.25",
            f"dataset.cache_dir={tmp_path / 'cache'}", "dataset.val_stream=true"]
    with pytest.raises(ConfigError, match=re.escape(
            "the longest training document of text has 29 tokens, expected <= 28, or "
            "train.pack_documents=true")):
        run(tmp_path, "plain", *data)
    result = run(tmp_path, "packed", *data, "train.pack_documents=true")
    assert set(map(int, result["train"]["segment_lengths"])) <= set(range(1, 30))
    assert math.isfinite(result["eval"]["curve"][0]["ppl"])


@pytest.mark.parametrize("overrides, message", [
    (["train.length_schedule=skyladdr"], "train.length_schedule='skyladdr' is not accepted; "
                                         "expected one of ('none', 'skyladder') (did you mean "
                                         "'skyladder'?)"),
    (["train.length_schedule=skyladder", "train.length_start=256"],
     "train.length_start=256 is not accepted; expected a first window of 1 to "
     "train.seq_len=128 tokens"),
    (["train.length_schedule=skyladder", "train.length_every=0"], "train.length_every=0"),
    (["train.pack_documents=true", "dataset=task_copy"],
     "train.pack_documents=True is not accepted; expected false with dataset=task_copy"),
    (["train.pack_documents=true", "train.pose_span=512"], "train.pose_span=512 is not accepted"),
    (["train.pack_documents=true", "train.retrieval_mix=0.5"], "train.retrieval_mix=0.5"),
    (["train.pack_documents=true", "model.attention=chunked"],
     "model.attention='chunked' is not accepted"),
    (["train.pack_documents=true", "model.temperature=ssmax"],
     "model.temperature='ssmax' is not accepted"),
    (["train.pack_documents=true", "encoding=path"],
     "train.pack_documents=True is not accepted; expected false for encoding=path"),
])
def test_bad_length_options_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        posbench.config.check(posbench.compose(["encoding=rope", *overrides]))
    assert "\n" not in str(err.value)
