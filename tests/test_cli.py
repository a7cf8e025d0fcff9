"""End to end through the installed `posbench` command, at toy size."""
import csv
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import posbench
from posbench.encodings import registry
from helpers import cpuinfo_model, posbench_cli, results, run_in_process


def check_results_schema(record):
    assert {"encoding", "seed", "status", "model", "dataset", "train", "eval", "config"} <= set(record)
    assert {"params", "n_layer", "n_head", "d_model"} <= set(record["model"])
    assert record["dataset"]["fingerprint"].startswith("sha256:")
    assert {"seq_len", "steps", "tokens", "final_loss", "tokens_per_second",
            "wall_seconds"} <= set(record["train"])
    assert {"protocol", "tokens_per_length", "curve"} <= set(record["eval"])
    for point in record["eval"]["curve"]:
        assert {"length", "loss", "ppl"} <= set(point)


def test_train_writes_every_output(tmp_path, toy):
    proc = posbench_cli("train", *toy, "encoding=alibi", "hydra.run.dir=run", cwd=tmp_path)
    run_dir = tmp_path / "run"
    record = results(run_dir)
    check_results_schema(record)
    assert record["encoding"] == "alibi" and record["status"] == "ok"
    assert record["config"]["train"]["seq_len"] == 32
    machine = record["machine"]
    assert machine["torch"] == torch.__version__ and machine["threads"] >= 1
    assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    if cpuinfo_model() is not None:  # Linux, as CI
        assert machine["cpu"] == cpuinfo_model()
    rows = list(csv.DictReader(open(run_dir / "curve.csv")))
    assert [int(r["length"]) for r in rows] == [32, 64]
    assert (run_dir / "ppl_vs_length.png").read_bytes()[:4] == b"\x89PNG"
    assert (run_dir / "checkpoint.pt").stat().st_size > 0
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert "length" in proc.stdout and "ppl" in proc.stdout  # the closing table


def test_parallel_multirun_with_seeds_wandb_and_report(tmp_path, toy):
    """Two jobs at a time in joblib's processes, each its own wandb run."""
    posbench_cli("train", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *toy,
                 "encoding=nope,alibi", "seed=0,1", "logger=wandb", "hydra.sweep.dir=sweep",
                 cwd=tmp_path)
    sweep = tmp_path / "sweep"
    jobs = sorted(p.parent for p in sweep.rglob("results.json"))
    assert len(jobs) == 4
    ids = []
    for job in jobs:
        runs = list((job / "wandb").glob("offline-run-*"))
        assert [r.name.rsplit("-", 1)[1] for r in runs] == [(job / "wandb_run_id").read_text()]
        ids.append((job / "wandb_run_id").read_text())
    assert len(set(ids)) == 4  # every job its own wandb run
    summary = (sweep / "summary.md").read_text()
    assert "| nope |" in summary and "| alibi |" in summary and "±" in summary
    assert (sweep / "ppl_vs_length.png").stat().st_size > 0
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert {r["label"] for r in rows} == {"nope", "alibi"} and {r["seeds"] for r in rows} == {"2"}
    (sweep / "summary.md").unlink()
    posbench_cli("report", str(sweep), cwd=tmp_path)
    assert (sweep / "summary.md").read_text() == summary


def test_cfg_job_and_help_work_through_the_dispatcher(tmp_path):
    cfg = posbench_cli("train", "encoding=t5", "--cfg", "job", cwd=tmp_path).stdout
    assert "name: t5" in cfg and "seq_len:" in cfg
    assert "encoding" in posbench_cli("train", "--help", cwd=tmp_path).stdout
    assert not (tmp_path / "outputs").exists()


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("where", ["repo root", "project folder"])
def test_own_configs_in_conf_are_found_beside_the_packaged_ones(tmp_path, monkeypatch, where):
    """The conf/ of the folder a command runs in: the repo's example study, model preset and
    encoding by `_target_`, and the same files in a user's project folder."""
    cwd = ROOT if where == "repo root" else tmp_path
    if where == "project folder":
        shutil.copytree(ROOT / "conf", tmp_path / "conf")
    proc = posbench_cli("train", "+experiment=my_study", "encoding=rope_500k", "--cfg", "job",
                        cwd=cwd)
    assert proc.stderr == ""  # nothing from Hydra about its search path
    cfg = yaml.safe_load(proc.stdout)
    study = yaml.safe_load((ROOT / "conf" / "experiment" / "my_study.yaml").read_text())
    assert cfg["train"].items() >= study["train"].items()
    assert cfg["eval"].items() >= study["eval"].items()
    assert cfg["model"].items() >= yaml.safe_load(
        (ROOT / "conf" / "model" / "tiny_wide.yaml").read_text()).items()
    assert cfg["encoding"] == yaml.safe_load(
        (ROOT / "conf" / "encoding" / "rope_500k.yaml").read_text())
    monkeypatch.chdir(cwd)
    for name in study["hydra"]["sweeper"]["params"]["encoding"].split(","):  # all accepted
        assert posbench.compose(["+experiment=my_study", f"encoding={name}"]).encoding.name == name


def test_list_names_every_encoding(tmp_path):
    out = posbench_cli("list", cwd=tmp_path, in_process=True).stdout
    for name in registry():
        assert f"  {name} " in out


BAD = [
    (["train", "encoding=nosuch"], "nosuch"),
    (["train", "model=huge"], "huge"),
    (["train", "dataset=nosuch"], "nosuch"),
    (["train", "train.stpes=3"], "stpes"),
    (["train", "eval.lengths=[]"], "eval.lengths"),
    (["train", "eval.lengths=[128,-4]"], "eval.lengths"),
    (["train", "eval.lengths=[12.5]"], "12.5"),
    (["train", "train.seq_len=100000000"], "train.seq_len"),
    (["train", "train.steps=abc"], "train.steps=abc"),
    (["train", "model.n_layer=0"], "model.n_layer=0"),
    (["train", "model.d_model=30", "model.n_head=4"], "model.d_model=30"),
    (["train", "model.d_model=24", "model.n_head=8", "encoding=rope"], "even head dimension"),
    (["train", "eval.lengths=[1000000]"], "eval.lengths entry 1000000"),
    (["train", "train.ckpt_every=-1"], "train.ckpt_every=-1"),
    (["train", "train.resume=maybe"], "train.resume=maybe"),
    *([] if torch.cuda.is_available() else [(["train", "device=cuda"], "device='cuda'")]),
    (["train", "dataset=text"], "dataset.path=None"),
    (["train", "dataset=text", "dataset.path=/nonexistent-posbench"], "names no files"),
    (["report", "."], "no finished run"),
    (["frobnicate"], "frobnicate"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_clear_line_and_writes_nothing(tmp_path, monkeypatch, capsys, args,
                                                        needle):
    monkeypatch.chdir(tmp_path)
    proc = run_in_process(args, monkeypatch, capsys)
    assert proc.returncode not in (0, None)
    assert "Traceback" not in proc.stderr + proc.stdout
    assert needle in proc.stderr
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*.json"))


def test_the_installed_command_exits_non_zero_on_bad_input_with_one_line(tmp_path):
    proc = posbench_cli("train", "encoding=nosuch", cwd=tmp_path, ok=False)
    assert proc.returncode == 2  # a usage error, as argparse's
    assert proc.stderr.strip().count("\n") == 0 and "nosuch" in proc.stderr


def test_finished_run_dir_is_never_overwritten(tmp_path, toy, toy_run_copy):
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    proc = posbench_cli("train", *toy, "encoding=alibi", "train.warmup_steps=2",
                        "hydra.run.dir=run", cwd=tmp_path, ok=False, in_process=True)
    assert proc.returncode != 0 and "already holds results.json" in proc.stderr
    assert "train.warmup_steps" in proc.stderr.split("(also ")[1]  # every differing key named
    after = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert before == after


def test_a_run_whose_hydra_files_cannot_be_written_frees_its_run_dir(tmp_path, toy, monkeypatch,
                                                                      capsys):
    import errno

    import posbench.cli

    def full_disk(run_dir, cfg):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(posbench.cli, "_save_hydra_files", full_disk)
    proc = run_in_process(["train", *toy, f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch,
                          capsys)
    assert proc.returncode == 1 and "could not start: OSError" in proc.stderr
    assert not (tmp_path / "run" / "run.lock").exists()  # released: a next start may take it


def test_typos_in_eval_are_one_line_with_a_did_you_mean(tmp_path, toy_run_copy, monkeypatch,
                                                         capsys):
    """`posbench eval` composes a run's saved config, which Hydra holds no schema for: a
    misspelt key got Hydra's advice to add it with `+`, a misspelt choice a Python tuple."""
    monkeypatch.chdir(tmp_path)
    before = sorted(p for p in tmp_path.rglob("*"))
    for arg, line in [
            ("eval.lenghts=[128]", "eval.lenghts is not a config key (did you mean 'lengths'?); "
             "expected one of: lengths, tokens, protocol, stride, batch_tokens, rope_scaling, "
             "rope_scaling_factor, rope_window, rope_shift, rope_chunk, longrope_factors, "
             "temperature, randomized_positions, attention, lambda_sinks, lambda_window, "
             "ppl_tolerance, longppl, retrieval, ruler"),
            ("eval.retrieval.enabeld=true", "eval.retrieval.enabeld is not a config key (did you "
             "mean 'enabled'?); expected one of: enabled, lengths, depths, key_tokens, keys, "
             "trials, seed, metric, threshold"),
            ("eval.rope_scaling=yarnn", "eval.rope_scaling='yarnn' is not accepted; expected one "
             "of: none, pi, ntk, dynamic_ntk, yarn, llama3, longrope, rerope, self_extend, "
             "shifted_rope, dca, streaming_llm (did you mean 'yarn'?)")]:
        proc = run_in_process(["eval", "run", arg], monkeypatch, capsys)
        assert (proc.returncode, proc.stderr) == (2, f"posbench: error: {line}\n")
    assert sorted(p for p in tmp_path.rglob("*")) == before
    proc = run_in_process(["train", "train.rope_scaling=yarnn"], monkeypatch, capsys)
    assert proc.returncode == 2 and "(did you mean 'yarn'?)" in proc.stderr


def test_eval_lengths_none_past_the_training_length_are_named_before_training(tmp_path, toy,
                                                                               toy_run):
    proc = posbench_cli("train", *toy, "eval.lengths=[16,32]", "hydra.run.dir=run", cwd=tmp_path,
                        in_process=True)
    warning = ("posbench: warning: eval.lengths=[16, 32] has no length past train.seq_len=32: "
               "the run measures no extrapolation (its log-ppl growth past L is '—' in reports); "
               "a length above 32 measures it")
    lines = proc.stdout.splitlines()
    assert warning in lines and lines.index(warning) < 4  # beside the run dir and the estimate
    assert results(tmp_path / "run")["status"] == "ok"  # scoring at L alone is a study too
    assert "has no length past" not in toy_run[1]  # TOY's lengths, 32 and 64


def test_help_version_and_the_key_a_refusal_names(tmp_path, toy, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for verb in ("report", "inspect", "extend", "longrope"):
        proc = run_in_process([verb, "--help"], monkeypatch, capsys)
        assert proc.stdout.startswith(f"usage: posbench {verb} ") and proc.stderr == ""
    assert run_in_process(["--version"], monkeypatch, capsys).stdout == (
        f"posbench {posbench.__version__}\n")
    with pytest.raises(posbench.ConfigError, match="nosuch' does not exist"):
        posbench.load_run(tmp_path / "nosuch")
    assert run_in_process(["train", *toy, "encoding=alibi", "hydra.run.dir=alibi"], monkeypatch,
                          capsys).returncode == 0
    proc = run_in_process(["extend", "alibi", "train.rope_scaling=yarn"], monkeypatch, capsys)
    assert proc.returncode == 2 and proc.stderr.startswith(
        "posbench: error: train.rope_scaling='yarn' is not accepted; expected 'none' for "
        "encoding=alibi")


def test_a_training_length_the_validation_documents_cannot_hold_is_refused_before_training(
        tmp_path, toy, monkeypatch, capsys):
    """Validation scores train.batch_size windows of L + 1 tokens: when the documents hold fewer,
    the run is refused at its start in one line naming train.seq_len, and its run dir removed
    (it failed at step 1 and kept the dir before), with the empty outputs/<date>/ Hydra made
    above it; a folder of the user's above an explicit run dir stays."""
    monkeypatch.chdir(tmp_path)
    args = [a for a in toy if not a.startswith(("train.seq_len=", "eval.lengths="))]
    (tmp_path / "study").mkdir()
    for where in ([], ["hydra.run.dir=study/run"]):
        proc = run_in_process(["train", *args, "train.seq_len=200000", "eval.lengths=[64]",
                               *where], monkeypatch, capsys)
        assert proc.returncode == 2, proc.stderr[-2000:]
        error = [line for line in proc.stderr.splitlines() if "error" in line]
        assert len(error) == 1 and error[0].startswith(
            "posbench: error: train.seq_len=200000 is not accepted with train.batch_size=2: "
            "validation scores 2 windows of 200001 tokens"), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study"]
    assert not any((tmp_path / "study").iterdir())
