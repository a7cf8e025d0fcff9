"""Sweep job dirs: one level deep, named by their swept values in characters that are safe in any
shell, so that a sweep started again over other values finds the jobs it ran (posbench/core/resolvers.py); and every verb on every run dir, however it
is named and however it is given (absolute, relative, `.`)."""
import re
import shutil

import pytest
import yaml
from omegaconf import open_dict

from posbench.core.resolvers import SWEPT, job_dir_name
from posbench.core.composing import composer
from helpers import posbench_cli, results, run_in_process

SAFE = re.compile(r"[A-Za-z0-9._-]+")


def test_a_name_is_the_swept_values_made_safe_or_the_job_number_when_nothing_is_swept():
    assert job_dir_name(3, ["model.n_layer=1", "encoding=alibi", "seed=1"],
                        ["encoding", "seed"]) == "encoding-alibi_seed-1"
    assert job_dir_name(0, ["model.n_layer=1"], []) == "0"
    assert job_dir_name(2, ["+experiment=quick", "encoding=t5"],
                        ["+experiment", "encoding"]) == "experiment-quick_encoding-t5"
    # a path or a list: a readable piece and a hash of the whole value
    path = job_dir_name(1, ["dataset.path=/data/corpora/wiki"], ["dataset.path"])
    assert re.fullmatch(r"dataset\.path-wiki-[0-9a-f]{6}", path)
    lengths = job_dir_name(1, ["eval.lengths=[128,1024]"], ["eval.lengths"])
    assert re.fullmatch(r"eval\.lengths-128-1024-[0-9a-f]{6}", lengths)
    # different values keep different names even where their readable pieces agree
    values = ["/a/wiki", "/b/wiki", "/a/wiki/", "[128,1024]", "[128, 1024]", "'x y'", "x" * 300,
              "x" * 301, "..", "${x}", "a=b,c"]
    names = [job_dir_name(5, [f"k={v}"], ["k"]) for v in values]
    assert len(set(names)) == len(values)
    keys = [f"key{i}" for i in range(20)]
    many = job_dir_name(7, [f"{key}={'v' * 20}" for key in keys], keys)
    for name in [path, lengths, *names, many]:
        assert SAFE.fullmatch(name) and len(name) <= 110 and not name.startswith("."), name


def test_a_sweep_dir_from_before_keeps_its_numbered_job_dirs(tmp_path):
    """Earlier versions put the job's number first; such a sweep resumes into those dirs."""
    (tmp_path / "12_encoding-alibi_seed-1").mkdir()
    (tmp_path / "3_encoding-alibi_seed-10").mkdir()
    name = lambda seed: job_dir_name(0, ["encoding=alibi", f"seed={seed}"], ["encoding", "seed"],
                                     tmp_path)
    assert (name(1), name(10), name(2)) == ("12_encoding-alibi_seed-1",
                                            "3_encoding-alibi_seed-10", "encoding-alibi_seed-2")


def subdir(overrides, num=4):
    """hydra.sweep.subdir of posbench's config for one job with these overrides."""
    with composer() as compose:
        cfg = compose(overrides, hydra=True)
    with open_dict(cfg):
        cfg.hydra.job.num = num
    return cfg.hydra.sweep.subdir


def test_the_config_names_jobs_by_the_keys_a_command_or_an_experiment_sweeps():
    # `posbench train -m train.steps=5 encoding=rope,alibi train.resume=true,false` names the
    # keys it sweeps in hydra.<SWEPT>; train.resume stays out of the name
    assert subdir(["train.steps=5", "encoding=alibi", "train.resume=true",
                   f"+hydra.{SWEPT}=[encoding,train.resume]"]) == "encoding-alibi"
    # +experiment=quick sweeps encoding through hydra.sweeper.params
    assert subdir(["+experiment=quick", "train.steps=5", "encoding=rope"]) == "encoding-rope"


def write_corpus(folder, n=40):
    folder.mkdir(parents=True)
    for i in range(n):
        (folder / f"doc{i:02d}.txt").write_text(f"Document {i} of {folder.name}. " * (40 + i))
    return folder


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, toy):
    """A real sweep over a path and a list: two corpora by two eval length lists."""
    root = tmp_path_factory.mktemp("jobs")
    corpora = [write_corpus(root / "corpora" / name) for name in ("wiki", "books")]
    args = [a for a in toy if not a.startswith("eval.lengths=")]
    proc = posbench_cli("train", "-m", *args, "dataset=text", "dataset.val_fraction=0.2",
                        f"dataset.path={corpora[0]},{corpora[1]}",
                        "eval.lengths=[32,64],[32,48]", "hydra.sweep.dir=sweep", cwd=root,
                        in_process=True)
    assert "Traceback" not in proc.stderr and "not available" not in proc.stderr, proc.stderr
    jobs = sorted((p for p in (root / "sweep").iterdir() if p.is_dir()), key=lambda p: p.name)
    return root, corpora, jobs


def test_sweep_job_dirs_are_one_level_deep_with_safe_names_and_keep_their_overrides(sweep):
    root, corpora, jobs = sweep
    assert len(jobs) == 4
    assert {p.parent for p in (root / "sweep").rglob("results.json")} == set(jobs)
    for job in jobs:
        assert SAFE.fullmatch(job.name), job.name
        assert results(job)["status"] == "ok"
    for job, (corpus, lengths, pieces) in zip(jobs, [
            (corpora[1], "[32,48]", "32-48"), (corpora[1], "[32,64]", "32-64"),
            (corpora[0], "[32,48]", "32-48"), (corpora[0], "[32,64]", "32-64")]):
        assert re.fullmatch(rf"dataset\.path-{corpus.name}-[0-9a-f]{{6}}_"
                            rf"eval\.lengths-{pieces}-[0-9a-f]{{6}}", job.name), job.name
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        assert f"dataset.path={corpus}" in overrides and f"eval.lengths={lengths}" in overrides


def test_a_sweep_started_again_with_its_values_in_another_order_finds_its_jobs(sweep, toy):
    """The job numbers change with the order; the names do not, so every job is skipped."""
    root, corpora, jobs = sweep
    before = {job.name: (job / "results.json").read_bytes() for job in jobs}
    args = [a for a in toy if not a.startswith("eval.lengths=")]
    proc = posbench_cli("train", "-m", *args, "dataset=text", "dataset.val_fraction=0.2",
                        f"dataset.path={corpora[1]},{corpora[0]}",
                        "eval.lengths=[32,48],[32,64]", "hydra.sweep.dir=sweep", cwd=root,
                        in_process=True)
    assert proc.stdout.count("skipped") == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    after = {p.name: (p / "results.json").read_bytes() for p in (root / "sweep").iterdir()
             if p.is_dir()}
    assert after == before


def evaluated(job, run_dir_arg, cwd):
    """`posbench eval RUN_DIR_ARG` from cwd re-scores the job: a new results file in its dir."""
    before = set(job.glob("results*.json"))
    posbench_cli("eval", run_dir_arg, "eval.lengths=[48]", cwd=cwd, in_process=True)
    assert len(set(job.glob("results*.json")) - before) == 1


def test_eval_takes_a_job_dir_as_an_absolute_path(sweep):
    root, _, jobs = sweep
    evaluated(jobs[0], str(jobs[0]), cwd=root)


def test_eval_takes_dot_inside_a_job_dir(sweep):
    _, _, jobs = sweep
    evaluated(jobs[1], ".", cwd=jobs[1])


def test_eval_takes_a_relative_path_to_a_job_dir_named_the_old_way(sweep):
    """Sweeps before these names pasted overrides verbatim: `=`, `,`, `[`, a space, a quote."""
    root, _, jobs = sweep
    old = root / "older" / "2_dataset.path=books,eval.lengths=[32,64] it's"
    shutil.copytree(jobs[2], old)
    evaluated(old, str(old.relative_to(root)), cwd=root)


def test_inspect_and_train_started_again_take_a_job_dir(sweep, monkeypatch, capsys):
    _, _, jobs = sweep
    posbench_cli("inspect", jobs[3].name, cwd=jobs[3].parent, in_process=True)
    assert (jobs[3] / "inspect.json").is_file()
    # the job started again by hand in its own dir, with its overrides: nothing left to do
    before = (jobs[3] / "results.json").read_bytes()
    overrides = yaml.safe_load((jobs[3] / ".hydra" / "overrides.yaml").read_text())
    monkeypatch.chdir(jobs[3])
    proc = run_in_process(["train", *overrides, "hydra.run.dir=."], monkeypatch, capsys)
    assert proc.returncode == 0 and "skipped" in proc.stdout, proc.stderr[-2000:]
    assert (jobs[3] / "results.json").read_bytes() == before


def test_a_run_dir_argument_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    odd = tmp_path / "a${x}"
    (odd / ".hydra").mkdir(parents=True)
    (odd / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (odd / "checkpoint.pt").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    for argv, needle in [(["eval", "encoding=rope"], "needs RUN_DIR first"),
                         (["inspect", "--lengths", "64"], "needs RUN_DIR first"),
                         (["eval", "nosuch"], "RUN_DIR='nosuch' is not accepted"),
                         (["eval", "a${x}"], "expected a path without '${'")]:
        proc = run_in_process(argv, monkeypatch, capsys)
        assert proc.returncode == 2 and needle in proc.stderr, (argv, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1
