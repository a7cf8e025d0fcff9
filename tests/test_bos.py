"""dataset.bos: every training and evaluation window (and passkey sequence) starts with a BOS token
one id past the tokenizer's, and the prediction made at BOS is neither trained nor scored."""
import dataclasses

import numpy as np
import pytest
import torch

import posbench
from posbench.data import prepare, vocab_size
from posbench.data.windows import IGNORE
from posbench.core.errors import ConfigError
from posbench.evaluations.perplexity import eval_plan, evaluate
from posbench.evaluations.retrieval import Passkeys
from helpers import results, run_in_process


@pytest.fixture(scope="module")
def data(stdlib_data):
    """The stdlib corpus as dataset.bos=true prepares it, beside the plain one."""
    bos = prepare(posbench.compose(["dataset.bos=true"]).dataset)
    return stdlib_data, bos


def test_bos_is_one_id_past_the_tokenizer_and_the_corpus_is_the_same(data):
    plain, bos = data
    assert (plain.bos, bos.bos, bos.vocab_size) == (None, 256, 257)
    assert vocab_size(posbench.compose(["dataset.bos=true"]).dataset) == 257
    assert bos.fingerprint == plain.fingerprint and np.array_equal(bos.tokens, plain.tokens)


def test_training_windows_start_with_bos_whose_prediction_is_not_trained(data):
    plain, bos = data
    x0, y0 = plain.train_batch(32, 4, seed=0, step=3)
    x, y = bos.train_batch(32, 4, seed=0, step=3)
    assert (x[:, 0] == 256).all() and (y[:, 0] == IGNORE).all()
    # the same windows otherwise: only the first token and the target predicted from it differ
    assert torch.equal(x[:, 1:], x0[:, 1:]) and torch.equal(y[:, 1:], y0[:, 1:])
    assert (x0[:, 0] != 256).all() and (y0 != IGNORE).all()


@pytest.mark.parametrize("protocol,stride,first", [("nonoverlapping", None, 1),
                                                   ("sliding", 32, 1), ("sliding", 8, 24)])
def test_eval_windows_start_with_bos_and_its_position_is_not_scored(data, protocol, stride, first):
    _, bos = data
    cfg = posbench.compose([f"eval.protocol={protocol}", "eval.lengths=[32]", "eval.tokens=128",
                            f"eval.stride={stride if stride else 'null'}"]).eval
    plan = eval_plan(bos, 32, cfg)
    rows, _ = plan.rows(0, plan.count)
    assert (rows[:, 0] == 256).all() and plan.first == first


def test_the_loss_at_the_bos_position_is_left_out_of_perplexity(data):
    _, bos = data
    cfg = posbench.compose(["dataset.bos=true", "model.n_layer=1", "model.d_model=32",
                            "model.n_head=2", "train.seq_len=32", "eval.lengths=[32]",
                            "eval.tokens=128"])
    torch.manual_seed(0)
    model = posbench.build_model(cfg, bos.vocab_size)
    (point,) = evaluate(model, bos, cfg.eval, torch.device("cpu"))
    rows, _ = eval_plan(bos, 32, cfg.eval).rows(0, 4)
    rows = torch.from_numpy(rows.astype(np.int64))
    with torch.no_grad():
        losses = model.token_losses(rows[:, :-1], rows[:, 1:]).double()
    assert point["tokens"] == 4 * 31 and point["per_position"]["start"][0] == 1
    assert point["loss"] == pytest.approx(losses[:, 1:].mean().item(), rel=1e-9)
    assert point["loss"] != pytest.approx(losses.mean().item(), rel=1e-6)


def test_passkey_sequences_start_with_bos_and_keep_their_key(data):
    _, bos = data
    passkeys = Passkeys(bos, posbench.compose(["dataset.bos=true"]).dataset)
    for depth in (0.0, 1.0):
        row, first, second = passkeys.make(np.random.default_rng(0), 64, depth, 1, 4)
        assert len(row) == 65 and row[0] == 256 and (row[1:] != 256).all()
        assert np.array_equal(row[first:first + 4], row[second:second + 4])
    assert passkeys.overhead(1) == Passkeys(dataclasses.replace(bos, bos=None), posbench.compose(
        []).dataset).overhead(1) + 1


def test_a_task_refuses_bos_in_one_line():
    with pytest.raises(ConfigError, match=r"^dataset.bos=True is not accepted; expected false "
                                          r"for dataset=task_copy \(each instance starts"):
        posbench.compose(["dataset=task_copy", "dataset.bos=true"])


def test_a_run_with_bos_trains_and_evaluates(toy, tmp_path, monkeypatch, capsys):
    proc = run_in_process(["train", *toy, "dataset.bos=true", f"hydra.run.dir={tmp_path}"],
                          monkeypatch, capsys)
    assert proc.returncode == 0, proc.stderr
    record = results(tmp_path)
    assert record["config"]["dataset"]["bos"] is True
    assert [p["per_position"]["start"][0] for p in record["eval"]["curve"]] == [1, 1]
