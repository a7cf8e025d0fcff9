"""`posbench extend RUN_DIR`: continued training of a finished run at a longer length, a run of
its own (posbench/runs/extend.py): its config and defaults, PoSE positions, a curve that starts at
the parent, its lineage, sweeps, an exact resume, LongRoPE's fine-tuning with a factors file, and
one-line refusals."""
import csv
import json
import math
import sys
import time

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import posbench
from posbench import evaluations
from posbench.cli import main
from posbench.data import prepare
from posbench.config import check
from posbench.encodings import Dims
from posbench.encodings.rope import RoPE, llama3_inv_freq, yarn_inv_freq
from posbench.core.errors import ConfigError
from posbench.runs.extend import extension_config, pose_positions
from helpers import posbench_cli, results, run_in_process

TOY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "train.batch_size=2",
       "train.seq_len=32", "train.warmup_steps=1", "eval.lengths=[32,64]", "eval.tokens=256",
       "device=cpu"]
EXTEND = ["train.pose_span=128", "train.steps=4", "train.eval_every=2", "eval.tokens=256"]
# LongRoPE factors for the toy's 8 rotary pairs (head dimension 16), chosen for 4L = 128
LAMBDA = [1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]


def posbench_here(*argv):
    """`posbench ARGV` in this process (for module fixtures, which cannot take capsys)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["posbench", *argv])
        try:
            main()
        except SystemExit as exit:
            return exit.code
    return 0


def files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def curve_rows(run_dir):
    with open(run_dir / "eval_vs_step.csv", newline="") as f:
        return list(csv.DictReader(f))


def factors_file(path, factors=LAMBDA, length=128):
    path.write_text(json.dumps({"factors": factors, "length": length}))
    return str(path)


@pytest.fixture(scope="module")
def parent(tmp_path_factory, stdlib_data):
    run_dir = tmp_path_factory.mktemp("extend") / "parent"
    assert posbench_here("train", *TOY, "train.steps=3", f"hydra.run.dir={run_dir}") == 0
    return run_dir


@pytest.fixture(scope="module")
def sweep(parent):
    """Two PoSE extensions to 4x the parent's length, without and with YaRN, by one command."""
    before = files(parent)
    folder = parent.parent / "sweep"
    assert posbench_here("extend", str(parent), "-m", "train.rope_scaling=none,yarn", *EXTEND,
                         f"hydra.sweep.dir={folder}") == 0
    return folder, before


def test_pose_positions_are_two_chunks_whose_second_skips_inside_the_span():
    pos = pose_positions(seed=0, step=3, batch=4096, seq_len=32, span=128).numpy()
    assert pos.shape == (4096, 32) and np.array_equal(pos, pose_positions(0, 3, 4096, 32, 128))
    steps = np.diff(pos, axis=1)
    assert ((steps == 1).sum(1) >= 30).all()  # one jump at most: the skip between the chunks
    first = 1 + np.argmax(steps != 1, axis=1)  # where the second chunk starts, when it jumps
    skip = pos[:, -1] - 31
    assert pos[:, 0].max() == 0 and pos.max() < 128 and skip.max() == 96 and skip.min() == 0
    jumped = skip > 0
    assert first[jumped].min() == 1 and first[jumped].max() == 16  # r uniform in 1..ceil(L/2)
    assert not np.array_equal(pos, pose_positions(0, 4, 4096, 32, 128))


def test_the_extension_config_takes_the_parent_and_the_references_defaults():
    trained = OmegaConf.to_container(posbench.compose(TOY), resolve=True)
    cfg = posbench.compose([*TOY, "train.rope_scaling=yarn"])
    ext = extension_config(cfg, "/runs/parent", trained, ["train.rope_scaling"])
    t = ext.train
    assert (t.seq_len, t.init_from, t.original_len, t.pose_span) == (128, "/runs/parent", 32, None)
    assert (t.steps, t.warmup_steps, t.eval_every, t.ckpt_every) == (200, 20, 20, 20)
    assert t.lr == pytest.approx(trained["train"]["lr"] * trained["train"]["min_lr_ratio"])
    assert (t.rope_scaling, t.rope_scaling_factor) == ("yarn", 4.0)
    assert (ext.eval.rope_scaling, ext.eval.rope_scaling_factor) == ("yarn", 4.0)
    assert list(ext.eval.lengths) == [32, 64, 128]
    # an extension of an extension: the scalings still count from the first run's length
    trained["train"].update(seq_len=64, original_len=32)
    cfg = posbench.compose([*TOY, "train.seq_len=256", "train.rope_scaling=pi", "train.lr=1e-3",
                            "eval.rope_scaling=none"])
    given = ["train.seq_len", "train.rope_scaling", "train.lr", "eval.rope_scaling"]
    ext = extension_config(cfg, "/runs/parent", trained, given)
    assert (ext.train.seq_len, ext.train.rope_scaling_factor, ext.train.lr) == (256, 8.0, 1e-3)
    assert (ext.eval.rope_scaling, ext.eval.rope_scaling_factor) == ("none", None)
    with pytest.raises(ConfigError, match=r"^train.seq_len=64 is not accepted; expected a length "
                                          r"above the parent's 64"):
        extension_config(posbench.compose([*TOY, "train.seq_len=64"]), "/runs/parent", trained,
                         ["train.seq_len"])


def test_yarn_and_the_dynamic_scale_count_from_the_original_length():
    enc = RoPE(RoPE.Config(name="rope"), Dims(1, 2, 64, 128, 512, original_len=32))
    enc.set_eval_options("yarn", rope_scaling_factor=4.0)
    inv_freq, factor = enc.frequencies(128)
    torch.testing.assert_close(inv_freq, yarn_inv_freq(enc.inv_freq, 4.0, 32, 1e4, 32))
    assert not torch.allclose(inv_freq, yarn_inv_freq(enc.inv_freq, 4.0, 32, 1e4, 128))
    enc.set_eval_options("pi")
    assert enc.scale(128) == 4.0 and enc.scale(32) == 1.0


def test_llama3_trains_and_extends_counting_from_the_original_length():
    trained = OmegaConf.to_container(posbench.compose(TOY), resolve=True)
    cfg = posbench.compose([*TOY, "train.rope_scaling=llama3"])
    ext = extension_config(cfg, "/runs/parent", trained, ["train.rope_scaling"])
    assert (ext.train.rope_scaling, ext.train.rope_scaling_factor) == ("llama3", 4.0)
    assert (ext.eval.rope_scaling, ext.eval.rope_scaling_factor) == ("llama3", 4.0)
    enc = RoPE(RoPE.Config(name="rope"), Dims(1, 2, 64, 128, 512, original_len=32))
    enc.set_eval_options("llama3", rope_scaling_factor=4.0)
    inv_freq, _ = enc.frequencies(128)
    torch.testing.assert_close(inv_freq, llama3_inv_freq(enc.inv_freq, 4.0, 32))
    assert not torch.allclose(inv_freq, llama3_inv_freq(enc.inv_freq, 4.0, 128))


def test_longrope_trains_with_its_file_and_evaluates_with_it(tmp_path):
    path = factors_file(tmp_path / "factors.json")
    trained = OmegaConf.to_container(posbench.compose(TOY), resolve=True)
    cfg = posbench.compose(TOY)
    cfg.train.rope_scaling, cfg.train.longrope_factors = "longrope", path
    ext = extension_config(cfg, "/runs/parent", trained,
                           ["train.rope_scaling", "train.longrope_factors"])
    t = ext.train
    assert (t.seq_len, t.rope_scaling, t.rope_scaling_factor, t.longrope_factors) == (
        128, "longrope", None, path)
    assert (ext.eval.rope_scaling, ext.eval.rope_scaling_factor, ext.eval.longrope_factors) == (
        "longrope", None, path)
    check(ext)
    # its own extension keeps the method but not the file, whose length was this one's
    again = extension_config(ext, "/runs/ext", OmegaConf.to_container(ext), [])
    assert (again.train.seq_len, again.train.rope_scaling, again.train.longrope_factors) == (
        512, "longrope", None)
    with pytest.raises(ConfigError, match=r"^train.longrope_factors=None is not accepted; "
                                          r"expected the path of a JSON file"):
        check(again)


def test_a_longrope_extension_turns_at_its_file_s_factors_in_training_and_at_every_length(
        parent, tmp_path, monkeypatch, capsys):
    """PoSE windows of L = 32 tokens spanning 128 = the file's length: the factors turn every
    training window, though none is longer than L, and every evaluated length, L's included."""
    path = factors_file(tmp_path / "factors.json")
    calls, frequencies = [], RoPE.frequencies

    def recorded(self, n):
        inv_freq, factor = frequencies(self, n)
        calls.append((self.training, n, inv_freq.clone(), factor))
        return inv_freq, factor

    monkeypatch.setattr(RoPE, "frequencies", recorded)
    args = ["extend", str(parent), "train.rope_scaling=longrope",
            f"train.longrope_factors={path}", "train.pose_span=128", "train.steps=2",
            "train.eval_every=2", f"hydra.run.dir={tmp_path / 'ext'}"]
    proc = run_in_process(args, monkeypatch, capsys)
    assert proc.returncode == 0, proc.stderr
    # the oracle: theta_p = 10^4^(-2p/16) over lambda_p, cos and sin times
    # sqrt(1 + ln(128/32) / ln 32)
    want = torch.tensor([1e4 ** (-2 * p / 16) / LAMBDA[p] for p in range(8)], dtype=torch.float64)
    magnitude = math.sqrt(1 + math.log(128 / 32) / math.log(32))
    trained = [(n, f, m) for training, n, f, m in calls if training]
    evaluated = {n for training, n, _, _ in calls if not training}
    assert trained and {n for n, _, _ in trained} == {32} and evaluated == {32, 64, 128}
    for _, n, inv_freq, factor in calls:
        torch.testing.assert_close(inv_freq, want, rtol=1e-14, atol=0)
        assert factor == pytest.approx(magnitude, rel=1e-12)
    record = results(tmp_path / "ext")
    t = record["config"]["train"]
    assert (t["rope_scaling"], t["longrope_factors"], t["rope_scaling_factor"]) == (
        "longrope", path, None)
    assert record["eval"]["rope_scaling"] == "longrope"
    assert (record["eval"]["longrope"]["factors"], record["eval"]["longrope"]["length"]) == (
        LAMBDA, 128)
    # the config results.json records is the command's: run again, it finds the run finished
    proc = run_in_process(args, monkeypatch, capsys)
    assert proc.returncode == 0 and "it holds this run, finished" in proc.stdout, proc.stderr


def test_longrope_is_refused_in_one_line_with_nothing_written(parent, tmp_path, monkeypatch,
                                                             capsys):
    fits = factors_file(tmp_path / "fits.json")
    seven = factors_file(tmp_path / "seven.json", LAMBDA[:7])
    before = files(parent)
    for extra, words in (
            (["train.rope_scaling=longrope"], "train.longrope_factors=None is not accepted; "
             "expected the path of a JSON file of LongRoPE factors with "
             "train.rope_scaling=longrope"),
            (["train.rope_scaling=longrope", f"train.longrope_factors={seven}"],
             f"train.longrope_factors='{seven}' is not accepted; expected 8 factors, one per "
             "rotary pair of the head's 16 dimensions; the file holds 7"),
            (["train.rope_scaling=longrope", f"train.longrope_factors={fits}",
              "train.rope_scaling_factor=4"], "train.rope_scaling_factor=4 is not accepted; "
             "expected null for longrope"),
            (["train.rope_scaling=longrope", f"train.longrope_factors={fits}",
              "train.seq_len=256"], f"train.longrope_factors='{fits}' is not accepted; expected "
             "a file whose `length` is the length training reaches, 256 (train.pose_span, else "
             "train.seq_len)"),
            ([f"train.longrope_factors={fits}"], f"train.longrope_factors='{fits}' is not "
             "accepted; expected null unless train.rope_scaling=longrope")):
        proc = run_in_process(["extend", str(parent), *extra,
                               f"hydra.run.dir={tmp_path / 'ext'}"], monkeypatch, capsys)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert files(parent) == before and not (tmp_path / "ext").exists()


def test_an_extension_starts_at_its_parent_and_records_its_lineage(parent, sweep):
    folder, before = sweep
    assert files(parent) == before  # the parent's dir is never written
    for job, scaling in (("train.rope_scaling-none", "none"), ("train.rope_scaling-yarn",
                                                                  "yarn")):
        record = results(folder / job)
        t = record["config"]["train"]
        assert (t["init_from"], t["seq_len"], t["pose_span"]) == (str(parent), 32, 128)
        assert (t["rope_scaling"], record["eval"]["rope_scaling"]) == (scaling, scaling)
        assert record["lineage"] == [{"run_dir": str(parent), "encoding": "rope", "seq_len": 32,
                                      "steps": 3, "rope_scaling": "none",
                                      "rope_scaling_factor": None, "pose_span": None}]
        rows = curve_rows(folder / job)
        assert [(int(r["step"]), int(r["length"])) for r in rows] == [
            (s, n) for s in (0, 2, 4) for n in (32, 64, 128)]
        assert (folder / job / "eval_vs_step.png").stat().st_size > 0
    # step 0 is the parent's model under the extension's eval settings, scored as at the end
    cfg = OmegaConf.load(folder / "train.rope_scaling-yarn" / ".hydra" / "config.yaml")
    model = posbench.load_run(parent).model
    scores = evaluations.run(evaluations.plan(cfg, prepare(cfg.dataset)), model,
                             torch.device("cpu"))
    assert [float(r["loss"]) for r in rows[:3]] == [p["loss"] for p in scores["curve"]]
    assert (folder / "summary.md").is_file()
    assert (folder / "eval_vs_step.png").stat().st_size > 0  # the sweep's curves on one plot


def test_an_extension_stopped_midway_resumes_exactly(parent, sweep, tmp_path, monkeypatch,
                                                      capsys):
    import posbench.runs.train as train_module

    folder, _ = sweep
    steps, step = [], train_module.train_step

    def stop_at_the_fourth(*args, **kwargs):
        steps.append(1)
        if len(steps) == 4:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    args = ["extend", str(parent), "train.rope_scaling=yarn", *EXTEND,
            f"hydra.run.dir={tmp_path / 'ext'}"]
    monkeypatch.setattr(train_module, "train_step", stop_at_the_fourth)
    assert run_in_process(args, monkeypatch, capsys).returncode == 130
    assert results(tmp_path / "ext")["status"] == "interrupted"
    monkeypatch.setattr(train_module, "train_step", step)
    proc = run_in_process(args, monkeypatch, capsys)
    assert proc.returncode == 0, proc.stderr
    assert "resuming from step 2 of 4" in proc.stdout
    resumed, reference = results(tmp_path / "ext"), results(folder / "train.rope_scaling-yarn")
    assert resumed["eval"]["curve"] == reference["eval"]["curve"]
    assert resumed["train"]["final_loss"] == reference["train"]["final_loss"]
    assert curve_rows(tmp_path / "ext") == curve_rows(folder / "train.rope_scaling-yarn")


@pytest.mark.parametrize("extra,words", [
    (["train.seq_len=32"], "train.seq_len=32 is not accepted; expected a length above the "
                           "parent's 32"),
    (["model.n_layer=2"], "model.n_layer=2 is not accepted by posbench extend"),
    (["hydra.run.dir=PARENT"], "it is the run being extended"),
])
def test_refused_in_one_line_with_nothing_written(parent, extra, words, monkeypatch, capsys):
    before = files(parent)
    extra = [arg.replace("PARENT", str(parent)) for arg in extra]
    proc = run_in_process(["extend", str(parent), *extra], monkeypatch, capsys)
    assert proc.returncode == 2 and words in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and files(parent) == before


def test_each_step_is_evaluated_once_named_and_outside_the_training_time(
        parent, tmp_path, monkeypatch, capsys):
    scored, run = [], evaluations.run

    def slow_run(*args):  # an evaluation far slower than the toy's training
        scored.append(1)
        time.sleep(2.0)
        return run(*args)

    monkeypatch.setattr(evaluations, "run", slow_run)
    proc = run_in_process(["extend", str(parent), *EXTEND, f"hydra.run.dir={tmp_path / 'ext'}"],
                          monkeypatch, capsys)
    assert proc.returncode == 0, proc.stderr
    assert len(scored) == 3  # steps 0, 2 and 4; the final evaluation reuses step 4's
    evals = [line for line in proc.stderr.splitlines() if line.startswith("eval")]
    assert [line.split(":")[0] for line in evals] == [
        f"eval at step {s}/4" for s in (0, 2, 4) for _ in (32, 64, 128)]
    assert proc.stdout.count("<- train length") == 1
    # the evaluations at steps 0 and 2 alone, counted, would add 4 s; a loaded machine runs the
    # toy's four steps in under 2
    assert results(tmp_path / "ext")["train"]["wall_seconds"] < 3.5


@pytest.mark.parametrize("extra", [["train.seq_len=16"], ["train.lr=-1"],
                                   ["-m", "train.rope_scaling=none,bogus"],
                                   ["train.batch_size=1000000000"]])  # memory: petabytes
def test_a_refused_extension_creates_no_folder(parent, extra, tmp_path):
    # Hydra makes outputs/<date>/... before the job starts: the refusal must come first
    proc = posbench_cli("extend", str(parent), *extra, cwd=tmp_path, ok=False, in_process=True)
    assert proc.returncode == 2 and "is not accepted" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unfinished_parent_and_a_scaling_the_encoding_lacks_are_refused(parent, tmp_path,
                                                                          monkeypatch, capsys):
    failed = tmp_path / "failed"
    failed.mkdir()
    for name in ("checkpoint.pt", "checkpoint.pt.sha256"):
        (failed / name).write_bytes((parent / name).read_bytes())
    (failed / ".hydra").mkdir()
    (failed / ".hydra" / "config.yaml").write_text((parent / ".hydra" / "config.yaml").read_text())
    record = {**results(parent), "status": "failed"}
    (failed / "results.json").write_text(json.dumps(record))
    proc = run_in_process(["extend", str(failed)], monkeypatch, capsys)
    assert proc.returncode == 2 and "holds no finished results.json (status failed)" in proc.stderr
    with pytest.raises(ConfigError, match=r"^train.rope_scaling='pi' is not accepted; expected "
                                          r"'none' for encoding=alibi"):
        posbench.compose(["encoding=alibi", "train.rope_scaling=pi"])
