"""eval.longppl: key tokens and LongPPL against a float64 oracle that runs one forward per target
on its exact short context, the evaluator run, refusals, and the CLI (train and re-score)."""
import copy
import errno
import json
import math
import shutil
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import posbench
from helpers import posbench_cli, results, run_in_process, wandb_history, TOY
from posbench.data import prepare
from posbench.evaluations import longppl_cache
from posbench.evaluations.longppl import LongPPL, choose_keys, report_lines, window_rows
from posbench.evaluations.longppl_cache import FOLDER, key_path, key_text, read, write
from posbench.model.transformer import build_model

TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "device=cpu"]
CPU = torch.device("cpu")


def setup(overrides, seed=0):
    cfg = posbench.compose([*TINY, *overrides])
    data = prepare(cfg.dataset)
    torch.manual_seed(seed)
    model = build_model(cfg, data.vocab_size).eval()
    return cfg, data, model


def oracle_losses(model, data, plan, trunc, block):
    """Per window, float64 losses of every target: with the whole window, and with its short
    context alone (one forward per target on exactly those tokens, the first replaced by BOS
    under dataset.bos); NaN where the target is not scored or its short context starts at the
    window's start (is its long one)."""
    model = copy.deepcopy(model).double()
    n, bos = plan.length, data.bos
    long, short = [], []
    for s in plan.starts:
        row = torch.from_numpy(np.asarray(data.tokens[s:s + n + 1]).astype(np.int64))
        if bos is not None:
            row[0] = bos
        with torch.no_grad():
            logits = model(row[None, :-1])[0]
            long.append(F.cross_entropy(logits, row[1:], reduction="none"))
            line = torch.full((n,), math.nan, dtype=torch.float64)
            for p in range(max(trunc, plan.first), n):  # target row[p + 1]
                start = (p - trunc + 1) // block * block  # block 1: p - trunc + 1
                if start == 0:
                    continue
                context = row[start:p + 1].clone()
                if bos is not None:
                    context[0] = bos
                line[p] = F.cross_entropy(model(context[None])[0, -1], row[p + 1])
            short.append(line)
    return torch.stack(long), torch.stack(short)


def rule(long, short, alpha, beta):
    """LongPPL's find_key_token: loss_short - loss_long > alpha and loss_long < beta."""
    return ((short - long) > alpha) & (long < beta)


def split(values, lo, hi):
    """A threshold between two of the values, inside their [lo, hi] quantiles, at the middle of
    the widest gap there: no value sits near it."""
    v = values.sort().values
    a, b = int(lo * len(v)), int(hi * len(v))
    i = a + int(torch.diff(v[a:b + 1]).argmax())
    return float((v[i] + v[i + 1]) / 2)


def thresholds(long, short):
    """An alpha and a beta that split the eligible targets into key tokens and others."""
    ok = ~torch.isnan(short)
    return split((short - long)[ok], 0.5, 0.8), split(long[ok], 0.5, 0.9)


def borderline(long, short, alpha, beta, eps=1e-4):
    return (((short - long) - alpha).abs() < eps) | ((long - beta).abs() < eps)


@pytest.mark.parametrize("overrides, block, windows", [
    ([], 1, 3),  # nonoverlapping: every target scored
    (["dataset.bos=true", "eval.protocol=sliding", "eval.stride=12"], 3, 12),  # from 36 on
])
def test_key_tokens_and_longppl_match_a_brute_force_oracle(overrides, block, windows):
    cfg, data, model = setup(["train.seq_len=16", "eval.lengths=[16,48]", "eval.tokens=144",
                              "eval.longppl.enabled=true", "eval.longppl.trunc_len=12",
                              f"eval.longppl.block={block}", "eval.batch_tokens=100",
                              *overrides])
    section = LongPPL(LongPPL.config(cfg), cfg, data)
    plan = section.plans[-1]
    assert (plan.length, plan.count) == (48, windows)
    long, short = oracle_losses(model, data, plan, 12, block)
    alpha, beta = thresholds(long, short)
    assert 0 < alpha
    section.cfg.alpha, section.cfg.beta = alpha, beta
    expected = rule(long, short, alpha, beta)
    assert 0 < int(expected.sum()) < int((~torch.isnan(short)).sum())

    found = choose_keys(model, window_rows(plan), plan.first, section.cfg, 12, data.bos, 100,
                        CPU)
    unsure = borderline(long, short, alpha, beta)
    assert not unsure.any()
    assert torch.equal(found & ~unsure, expected & ~unsure)

    result = section.run(model, CPU)
    at_16, point = result["by_length"]
    first_16 = section.plans[0].first
    assert at_16["eligible"] == section.plans[0].count * max(0, 16 - max(11 + block, first_16))
    assert point["key_tokens"] == int(expected.sum())
    assert point["tokens"] == windows * (48 - plan.first)
    assert point["eligible"] == windows * (48 - max(11 + block, plan.first))
    assert point["eligible"] == int((~torch.isnan(short)).sum())
    assert point["fraction"] == pytest.approx(point["key_tokens"] / point["tokens"])
    assert point["longppl"] == pytest.approx(math.exp(long[expected].mean().item()), rel=1e-5)
    assert point["ppl"] == pytest.approx(math.exp(long[:, plan.first:].mean().item()), rel=1e-5)
    assert result["trunc_len"] == 12 and result["block"] == block and result["evaluator"] is None


def test_no_key_tokens_is_null_and_a_count_of_0_and_short_lengths_have_none():
    cfg, data, model = setup(["train.seq_len=16", "eval.lengths=[16,32]", "eval.tokens=64",
                              "eval.longppl.enabled=true", "eval.longppl.alpha=50"])
    points = LongPPL(LongPPL.config(cfg), cfg, data).run(model, CPU)["by_length"]
    assert [(p["length"], p["eligible"], p["key_tokens"], p["longppl"], p["fraction"])
            for p in points] == [(16, 0, 0, None, 0.0), (32, 2 * 16, 0, None, 0.0)]
    result = {"by_length": points, "alpha": 50.0, "beta": 2.0, "trunc_len": 16, "evaluator": None}
    lines = LongPPL.report_lines([{"eval": {"longppl": result}}], {0: "rope"})
    assert lines[-1].startswith("| rope |") and "null (0)" in lines[-1]
    assert LongPPL.length_metrics({"by_length": points})[32] == {
        "eval/longppl": None, "eval/longppl_key_tokens": 0, "eval/longppl_fraction": 0.0}


KEYS = ["eval.longppl.alpha=0", "eval.longppl.beta=100", "eval.longppl.trunc_len=16"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run trained through the CLI with eval.longppl enabled, and a second (ALiBi) without."""
    root = tmp_path_factory.mktemp("longppl")
    proc = posbench_cli("train", *TOY, "eval.longppl.enabled=true", *KEYS, "hydra.run.dir=judge",
                        "logger=wandb", cwd=root)
    posbench_cli("train", *TOY, "encoding=alibi", "hydra.run.dir=other", cwd=root, in_process=True)
    return root, proc


def test_train_records_longppl_by_length_and_prints_it(trained):
    root, proc = trained
    record = results(root / "judge")
    r = record["eval"]["longppl"]
    assert (r["alpha"], r["beta"], r["trunc_len"], r["block"], r["evaluator"]) == (
        0.0, 100.0, 16, 1, None)
    curve = {p["length"]: p["ppl"] for p in record["eval"]["curve"]}
    assert [p["length"] for p in r["by_length"]] == [32, 64]
    for p in r["by_length"]:
        assert p["ppl"] == pytest.approx(curve[p["length"]], rel=1e-4)
        assert p["eligible"] == 256 // p["length"] * (p["length"] - 16)
        assert 0 < p["key_tokens"] <= p["eligible"]  # alpha 0: the long context helps at all
        assert p["longppl"] == pytest.approx(math.exp(p["loss"]))
        assert p["fraction"] == pytest.approx(p["key_tokens"] / p["tokens"])
    assert "longppl: length 64 (2/2)" in proc.stderr
    assert (root / "judge" / "longppl_vs_length.png").stat().st_size > 0


def test_train_prints_longppl_in_its_summary_and_logs_it_to_wandb_by_length(trained):
    root, proc = trained
    by_length = {p["length"]: p for p in results(root / "judge")["eval"]["longppl"]["by_length"]}
    assert "LongPPL" in proc.stdout and f"{by_length[64]['longppl']:.3f}" in proc.stdout
    (run_file,) = (root / "judge").glob("wandb/offline-run-*/run-*.wandb")
    rows = [r for r in wandb_history(run_file) if "eval/ppl" in r]
    assert {r["eval/length"]: (r["eval/longppl"], r["eval/longppl_key_tokens"]) for r in rows} \
        == {n: (p["longppl"], p["key_tokens"]) for n, p in by_length.items()}


def test_a_report_over_the_runs_tables_longppl_for_the_runs_that_scored_it(trained, tmp_path):
    root, _ = trained
    folder = tmp_path / "runs"
    for name in ("judge", "other"):
        shutil.copytree(root / name, folder / name, ignore=shutil.ignore_patterns("wandb"))
    posbench_cli("report", str(folder), cwd=tmp_path, in_process=True)
    summary = (folder / "summary.md").read_text()
    by_length = results(root / "judge")["eval"]["longppl"]["by_length"]
    value = f"{by_length[-1]['longppl']:.3f}"
    rows = [line for line in summary.splitlines() if f"/ {value}" in line]
    assert len(rows) == 1 and rows[0].startswith("| rope")  # the ALiBi run did not score it
    assert "LongPPL: perplexity / perplexity on the key tokens only" in summary
    # across groups: one seed, so the run's own value and key tokens, and the figure
    across = summary.split("LongPPL across groups")[1].split("\n\n")[1].splitlines()
    assert len(across) == 3 and across[2].startswith("| rope")
    assert across[2].endswith(f"| {value} ({by_length[-1]['key_tokens']}) |")
    assert (folder / "longppl_by_group.png").is_file()


def test_an_evaluator_run_chooses_the_key_tokens_for_another(trained, monkeypatch, capsys):
    root, _ = trained
    from posbench.runs.run import trained_model

    judge = trained_model(root / "judge").model
    other = trained_model(root / "other")
    cfg = posbench.compose([*TOY, "encoding=alibi", "eval.longppl.enabled=true", *KEYS,
                            f"eval.longppl.evaluator={root / 'judge'}"])
    data = prepare(cfg.dataset)
    section = LongPPL(LongPPL.config(cfg), cfg, data)
    section.load_trained = trained_model  # as evaluations.plan gives it in a run
    plan = section.plans[-1]
    long_judge, short = oracle_losses(judge, data, plan, 16, 1)
    expected = rule(long_judge, short, 0.0, 100.0)
    # the judge's choice, in float32: the oracle's but for targets within 1e-4 of alpha
    keys = choose_keys(judge, window_rows(plan), plan.first, section.cfg, 16, None, 16384, CPU)
    unsure = borderline(long_judge, short, 0.0, 100.0)
    assert torch.equal(keys & ~unsure, expected & ~unsure) and int(unsure.sum()) < 5
    long_other, _ = oracle_losses(other.model, data, plan, 16, 1)
    point = section.run(other.model, CPU)["by_length"][-1]
    assert point["key_tokens"] == int(keys.sum()) > 0
    assert point["longppl"] == pytest.approx(math.exp(long_other[keys].mean().item()), rel=1e-5)

    # the judge judging itself as an evaluator run is the judge's own LongPPL (evaluator null)
    own = results(root / "judge")["eval"]["longppl"]["by_length"]
    cfg_self = posbench.compose([*TOY, "eval.longppl.enabled=true", *KEYS,
                                 f"eval.longppl.evaluator={root / 'judge'}"])
    section = LongPPL(LongPPL.config(cfg_self), cfg_self, data)
    section.load_trained = trained_model
    as_evaluator = section.run(judge, CPU)["by_length"]
    assert [p["key_tokens"] for p in as_evaluator] == [p["key_tokens"] for p in own]
    assert [p["longppl"] for p in as_evaluator] == pytest.approx([p["longppl"] for p in own],
                                                                 rel=1e-6)

    # through the CLI: a re-score of the ALiBi run with the judge's key tokens
    proc = posbench_cli("eval", "other", "eval.longppl.enabled=true", *KEYS,
                        "eval.longppl.evaluator=judge", cwd=root, in_process=True)
    (path,) = (root / "other").glob("results.eval-*.json")
    rescored = json.loads(path.read_text())["eval"]["longppl"]
    assert rescored["evaluator"] == "judge"
    assert rescored["by_length"][-1]["key_tokens"] == point["key_tokens"]
    assert rescored["by_length"][-1]["longppl"] == pytest.approx(point["longppl"], rel=1e-5)
    # the judge's key tokens were cached by the runs above, whatever path named the judge
    assert "longppl: length 64 (2/2) key tokens from cache" in proc.stderr
    assert list((root / "other").glob("longppl_vs_length.eval-*.png"))


class Counted:
    """The evaluator's loader (evaluations.plan's), counting the forwards of the models it
    loads: the evaluator's long and short passes."""

    def __init__(self):
        self.forwards = 0

    def __call__(self, run_dir, device):
        from posbench.runs.run import trained_model

        loaded = trained_model(run_dir, device)
        loaded.model.blocks[0].register_forward_pre_hook(self.count)
        return loaded

    def count(self, *_):
        self.forwards += 1


def judged(model, evaluator, overrides=(), patch=None):
    """LongPPL of `model` (an ALiBi model of TOY) with `evaluator`'s key tokens, and how many
    forwards the evaluator ran; patch(section) first, where given."""
    cfg = posbench.compose([*TOY, "encoding=alibi", "eval.longppl.enabled=true", *KEYS,
                            f"eval.longppl.evaluator={evaluator}", *overrides])
    section = LongPPL(LongPPL.config(cfg), cfg, prepare(cfg.dataset))
    section.load_trained = Counted()
    if patch is not None:
        patch(section)
    result = section.run(model, CPU)
    return result, section.load_trained.forwards


def cached_files(judge):
    return sorted((judge / FOLDER).glob("*.bin"))


@pytest.fixture(scope="module")
def warm(trained, tmp_path_factory):
    """A copy of the judge whose key tokens for the ALiBi run's TOY config are cached, that
    run's model and its result."""
    from posbench.runs.run import trained_model

    root, _ = trained
    judge = tmp_path_factory.mktemp("warm") / "judge"
    shutil.copytree(root / "judge", judge, ignore=shutil.ignore_patterns("wandb", FOLDER))
    other = trained_model(root / "other").model
    result, forwards = judged(other, judge)
    assert forwards > 0 and len(cached_files(judge)) == 2  # one file per length
    return judge, other, result


def warm_copy(warm, tmp_path):
    return shutil.copytree(warm[0], tmp_path / "judge")


def test_two_runs_get_the_evaluators_key_tokens_from_its_cache_bit_for_bit(warm, tmp_path,
                                                                          capsys):
    judge = warm_copy(warm, tmp_path)
    _, other, first = warm
    torch.manual_seed(1)
    fresh = build_model(posbench.compose([*TOY, "encoding=alibi"]), other.head.out_features)
    capsys.readouterr()
    again, forwards = judged(other, judge)
    assert forwards == 0 and again["by_length"] == first["by_length"]
    from_cache, forwards = judged(fresh.eval(), judge)
    err = capsys.readouterr().err
    assert forwards == 0
    assert "length 32 (1/2) key tokens from cache" in err
    assert "length 64 (2/2) key tokens from cache" in err
    shutil.rmtree(judge / FOLDER)
    computed, forwards = judged(fresh, judge)
    assert forwards > 0 and "length 64 (2/2) key tokens computed " in capsys.readouterr().err
    assert from_cache == computed  # every float, bit for bit
    assert computed["by_length"][-1]["key_tokens"] > 0
    assert computed["by_length"][-1]["longppl"] != first["by_length"][-1]["longppl"]


@pytest.mark.parametrize("warmed, changed, misses", [
    ([], ["eval.longppl.alpha=0.5"], 2),
    ([], ["eval.longppl.beta=50"], 2),
    ([], ["eval.longppl.trunc_len=8"], 2),
    ([], ["eval.longppl.block=2"], 2),
    ([], ["eval.tokens=128"], 2),
    ([], ["eval.protocol=sliding", "eval.stride=16"], 2),
    (["eval.protocol=sliding", "eval.stride=16"], ["eval.protocol=sliding", "eval.stride=8"], 2),
    ([], ["eval.lengths=[32,48]"], 1),  # 32 is cached
    ([], ["eval.batch_tokens=4096"], 2),
    ([], ["eval.stride=8"], 0),  # nonoverlapping ignores it: the same windows
    ([], ["eval.temperature=logn"], 0),  # the judged run's own options: not the evaluator's
])
def test_a_change_of_what_decides_the_key_tokens_misses_the_cache(warm, tmp_path, capsys,
                                                                   warmed, changed, misses):
    judge = warm_copy(warm, tmp_path)
    other = warm[1]
    if warmed:
        judged(other, judge, warmed)
    capsys.readouterr()
    _, forwards = judged(other, judge, changed)
    assert capsys.readouterr().err.count("key tokens computed") == misses
    assert (forwards > 0) == (misses > 0)


def test_the_evaluators_checkpoint_its_eval_options_and_the_corpus_are_in_the_key(
        warm, tmp_path, monkeypatch):
    from posbench.runs.checkpoint import Checkpoint

    judge = warm_copy(warm, tmp_path)
    other = warm[1]
    original = LongPPL.judge
    factors = tmp_path / "factors.json"

    def with_options(options):
        def judge_with(self, model, device):
            judge_model, node, digest = original(self, model, device)
            return judge_model, OmegaConf.merge(node, options), digest
        return judge_with

    with monkeypatch.context() as patched:
        patched.setattr(LongPPL, "judge", with_options({"temperature": "logn"}))
        assert judged(other, judge)[1] > 0
    with monkeypatch.context() as patched:  # a factors file by what it holds, not its path
        patched.setattr(LongPPL, "judge", with_options(
            {"rope_scaling": "longrope", "longrope_factors": str(factors)}))
        for factor, misses in ((1.0, True), (1.0, False), (2.0, True)):
            factors.write_text(json.dumps({"factors": [factor] * 8, "length": 64}))
            assert (judged(other, judge)[1] > 0) == misses
    assert judged(other, judge)[1] == 0
    assert judged(other, judge, patch=lambda s: monkeypatch.setattr(
        s.data, "fingerprint", "sha256:0"))[1] > 0
    monkeypatch.undo()
    assert judged(other, judge)[1] == 0
    checkpoint = Checkpoint.load(judge / "checkpoint.pt")  # the same path, other weights
    checkpoint.model["tok_emb.weight"][0, 0] += 1
    checkpoint.save(judge / "checkpoint.pt")
    assert judged(other, judge)[1] > 0
    assert len(cached_files(judge)) == 12  # and nothing was replaced


@pytest.mark.parametrize("corrupt", [
    lambda blob: blob[:len(blob) // 2],  # truncated
    lambda blob: blob[:-1] + bytes([blob[-1] ^ 1]),  # one bit of the mask
    lambda blob: blob.replace(b'"shape": [', b'"shape": [1, '),
    lambda blob: b"",
])
def test_a_corrupt_cached_file_is_recomputed_and_replaced(warm, tmp_path, capsys, corrupt):
    judge = warm_copy(warm, tmp_path)
    _, other, first = warm
    for path in cached_files(judge):
        path.write_bytes(corrupt(path.read_bytes()))
    capsys.readouterr()
    result, forwards = judged(other, judge)
    assert forwards > 0 and result["by_length"] == first["by_length"]
    assert capsys.readouterr().err.count("was corrupt or unreadable: replaced") == 2
    assert judged(other, judge)[1] == 0


def test_an_evaluator_dir_that_cannot_be_written_only_goes_uncached(warm, tmp_path, capsys,
                                                                    monkeypatch):
    judge = warm_copy(warm, tmp_path)
    _, other, first = warm
    shutil.rmtree(judge / FOLDER)

    def read_only(path):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(longppl_cache, "atomic_path", read_only)
    capsys.readouterr()
    result, forwards = judged(other, judge)
    assert forwards > 0 and result["by_length"] == first["by_length"]
    assert capsys.readouterr().err.count("key tokens computed, not cached (") == 2
    assert not cached_files(judge)


def test_writers_of_one_key_at_once_all_succeed_and_leave_a_valid_file(tmp_path):
    mask = torch.rand(5, 64, generator=torch.Generator().manual_seed(0)) < 0.3
    text = key_text({"length": 64})
    path = key_path(tmp_path, text)
    start, errors, seen = threading.Barrier(3), [], []

    def writer():
        start.wait()
        for _ in range(100):
            write(path, text, mask)

    def reader():  # a file that is there is always whole: never half of a write
        start.wait()
        while any(t.is_alive() for t in writers):
            found = read(path, text, (5, 64))
            seen.append(found is None or torch.equal(found, mask))

    def caught(work):
        try:
            work()
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    writers = [threading.Thread(target=caught, args=(writer,)) for _ in range(2)]
    watcher = threading.Thread(target=caught, args=(reader,))
    for thread in (*writers, watcher):
        thread.start()
    for thread in (*writers, watcher):
        thread.join()
    assert not errors and all(seen)
    assert torch.equal(read(path, text, (5, 64)), mask)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def refused(argv, monkeypatch, capsys, cwd):
    monkeypatch.chdir(cwd)
    proc = run_in_process(["train", *argv, "hydra.run.dir=refused"], monkeypatch, capsys)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert not (cwd / "refused" / "results.json").exists()
    return lines[0]


@pytest.mark.parametrize("override, refusal", [
    ("eval.longppl.alpha=-1", "eval.longppl.alpha=-1.0 is not accepted; expected a finite number "
     "of nats >= 0"),
    ("eval.longppl.beta=0", "eval.longppl.beta=0.0 is not accepted; expected a finite number of "
     "nats > 0"),
    ("eval.longppl.trunc_len=0", "eval.longppl.trunc_len=0 is not accepted; expected an integer "
     ">= 1 below the longest evaluated length 64"),
    ("eval.longppl.trunc_len=64", "eval.longppl.trunc_len=64 is not accepted"),
    ("eval.longppl.block=0", "eval.longppl.block=0 is not accepted; expected a positive integer"),
    ("eval.lengths=[32]", "eval.longppl.trunc_len=null is not accepted with eval.lengths up to "
     "32: null is the training length 32"),
    ("eval.longppl.evaluator=nowhere", "eval.longppl.evaluator='nowhere' is not accepted: it "
     "holds no finished run"),
])
def test_impossible_values_are_refused_in_one_line(tmp_path, monkeypatch, capsys, override,
                                                   refusal):
    line = refused([*TOY, "eval.longppl.enabled=true", override], monkeypatch, capsys, tmp_path)
    assert refusal in line, line


@pytest.mark.parametrize("edit, refusal", [
    (lambda r: r["config"]["dataset"].update(tokenizer="gpt2"), "(tokenizer gpt2, bos False"),
    (lambda r: r["config"]["dataset"].update(name="tinyshakespeare"), "dataset tinyshakespeare"),
    (lambda r: r["dataset"].update(fingerprint="sha256:0"), "fingerprint sha256:0"),
    (lambda r: r.update(status="failed"), "it holds no finished run"),
])
def test_an_evaluator_of_another_corpus_or_tokenizer_is_refused(trained, tmp_path, monkeypatch,
                                                                capsys, edit, refusal):
    root, _ = trained
    shutil.copytree(root / "judge", tmp_path / "judge")
    record = results(tmp_path / "judge")
    edit(record)
    (tmp_path / "judge" / "results.json").write_text(json.dumps(record))
    line = refused([*TOY, "eval.longppl.enabled=true", "eval.longppl.evaluator=judge"],
                   monkeypatch, capsys, tmp_path)
    assert line.startswith("posbench: eval.longppl.evaluator='judge' is not accepted") or \
        "eval.longppl.evaluator='judge' is not accepted" in line, line
    assert refusal in line, line


def test_the_run_table_names_each_runs_key_tokens_where_runs_chose_them_differently():
    def run(block, loss):
        point = {"length": 64, "tokens": 100, "key_tokens": 4, "fraction": 0.04, "loss": loss,
                 "longppl": math.exp(loss), "ppl": 9.0}
        return {"eval": {"longppl": {"units": "nats", "alpha": 2.0, "beta": 2.0, "trunc_len": 16,
                                     "block": block, "evaluator": None, "by_length": [point]}}}

    same = report_lines([run(1, 1.0), run(1, 0.5)], {0: "rope", 1: "alibi"})
    assert "chosen by the run itself, trunc_len=16, block=1, alpha=2, beta=2." in same[1]
    assert same[3] == "| run | 64 |"
    # another block is another short context, so other key tokens: each row says its own
    mixed = report_lines([run(1, 1.0), run(16, 0.5)], {0: "rope", 1: "alibi"})
    assert mixed[3] == "| run | 64 | key tokens |"
    assert mixed[5:] == [
        f"| rope | 9.000 / {math.exp(1.0):.3f} (4) | by the run itself, trunc_len=16, block=1, "
        "alpha=2, beta=2 |",
        f"| alibi | 9.000 / {math.exp(0.5):.3f} (4) | by the run itself, trunc_len=16, "
        "block=16, alpha=2, beta=2 |"]
