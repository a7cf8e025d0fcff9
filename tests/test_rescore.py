"""Re-scoring as a comparison: `posbench eval` over a whole sweep with Hydra's multirun over eval
keys, each re-score named by what it changed (files, table, plot, wandb run), a repeat skipped,
`posbench report` grouping and overlaying the re-scores, and a finished run asked for new eval
settings through `posbench train`."""
import csv
import json
import shutil

import pytest
import yaml

from helpers import finished_wandb_records, posbench_cli, results, run_in_process
from posbench.runs.rescore import change_label, change_tag, eval_changes

TOY_SWEEP = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "train.steps=3",
             "train.batch_size=2", "train.seq_len=32", "train.warmup_steps=1",
             "eval.lengths=[32,64]", "eval.tokens=256", "device=cpu"]


def files(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A real two-encoding sweep, re-scored by one command with three RoPE scalings."""
    root = tmp_path_factory.mktemp("rescore")
    posbench_cli("train", "-m", *TOY_SWEEP, "encoding=rope,alibi", "hydra.sweep.dir=sweep",
                 cwd=root, in_process=True)
    sweep = root / "sweep"
    rope, alibi = sweep / "encoding-rope", sweep / "encoding-alibi"
    before = {job: files(job) for job in (rope, alibi)}
    proc = posbench_cli("eval", "sweep", "-m", "eval.rope_scaling=none,pi,yarn", "logger=wandb",
                        cwd=root)
    return root, sweep, rope, alibi, before, proc


def test_one_command_rescores_every_run_of_a_sweep_named_by_what_it_changed(sweep):
    root, folder, rope, alibi, before, proc = sweep
    assert sorted(p.name for p in rope.glob("results*.json")) == [
        "results.eval-rope_scaling-pi.json", "results.eval-rope_scaling-yarn.json",
        "results.json"]
    for scaling in ("pi", "yarn"):
        record = json.loads((rope / f"results.eval-rope_scaling-{scaling}.json").read_text())
        assert record["rescore"] == {"tag": f"rope_scaling-{scaling}",
                                     "label": f"rope_scaling={scaling}",
                                     "changes": {"eval.rope_scaling": scaling}}
        assert record["eval"]["rope_scaling"] == scaling
        for name in ("curve", "per_position"):
            assert (rope / f"{name}.eval-rope_scaling-{scaling}.csv").is_file()
        assert (rope / f"ppl_vs_length.eval-rope_scaling-{scaling}.png").stat().st_size > 0
        # its table, in its own output file: it names the change and the protocol
        output = (rope / f"output.eval-rope_scaling-{scaling}.log").read_text()
        assert f"rope re-scored (rope_scaling={scaling}): trained at 32" in output
        assert f"wrote {rope / f'results.eval-rope_scaling-{scaling}.json'}" in output
    assert "protocol nonoverlapping, 256 tokens per length, rope_scaling yarn (dynamic)" in (
        (rope / "output.eval-rope_scaling-yarn.log").read_text())
    # unchanged settings and non-rotary encodings are skipped, each in one line
    assert proc.stdout.count("no eval key differs from the run's own") == 2
    assert f"skipped {alibi}: eval.rope_scaling=pi applies to rotary encodings" in proc.stdout
    assert not list(alibi.glob("results.eval-*"))
    # the original files are untouched, and nothing of Hydra's lands in the run dirs or the sweep
    for job in (rope, alibi):
        assert all(files(job)[path] == blob for path, blob in before[job].items())
        assert not (job / "multirun.yaml").exists() and not (job / ".hydra" / "multirun.yaml").exists()
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == [alibi.name, rope.name]


def test_a_folder_rescore_prints_a_line_per_run_and_one_summary_table(sweep, tmp_path):
    _, folder, *_ = sweep
    shutil.copytree(folder, tmp_path / "sweep")
    lengths = "eval.lengths=[32,48,64,96,128,160,192,256]"  # a table of 8 rows per run before
    proc = posbench_cli("eval", "sweep", "-m", lengths, cwd=tmp_path, in_process=True)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) <= 15, proc.stdout + proc.stderr
    tag = change_tag({"eval.lengths": [32, 48, 64, 96, 128, 160, 192, 256]})
    for job, encoding in (("encoding-rope", "rope"), ("encoding-alibi", "alibi")):
        run_dir = tmp_path / "sweep" / job
        # a progress line as each run starts, and its row in the summary
        assert sum(line.startswith(f"posbench: re-scoring {run_dir} ") for line in lines) == 1
        (row,) = [line for line in lines if line.startswith(f"  {job} ")]
        ppl = [p["ppl"] for p in results(run_dir)["eval"]["curve"]]
        record = json.loads((run_dir / f"results.eval-{tag}.json").read_text())
        curve = {p["length"]: p["ppl"] for p in record["eval"]["curve"]}
        assert f"{curve[32]:.2f}" in row and f"{curve[256]:.2f} at 256" in row, (row, ppl)
        # the run's own table stays in its output file
        output = (run_dir / f"output.eval-{tag}.log").read_text()
        assert f"{encoding} re-scored (lengths=[32,48,64,96,128,160,192,256])" in output
        assert output.count("\n     160 ") == 1
    assert "posbench eval: 2 re-scores written, 0 skipped" in proc.stdout


def test_a_rescore_is_a_wandb_run_of_its_own_in_the_training_runs_group(sweep):
    _, folder, rope, alibi, *_ = sweep
    runs = {}
    for run_file in rope.glob("wandb/offline-run-*/run-*.wandb"):
        (run,) = [r.run for r in finished_wandb_records(run_file)
                  if r.WhichOneof("record_type") == "run"]
        runs[run.display_name] = run
    assert set(runs) == {f"{rope.name}.eval-rope_scaling-pi",
                         f"{rope.name}.eval-rope_scaling-yarn"}
    # the group `posbench train -m` gives its jobs: the sweep dir and its parent (the date)
    group = f"{folder.parent.name}/{folder.name}"
    assert {run.run_group for run in runs.values()} == {group}
    assert {run.job_type for run in runs.values()} == {"eval"}
    assert not (rope / "wandb_run_id").exists()  # the id file is a training run's
    assert not (alibi / "wandb").exists()


def test_the_same_rescore_again_is_skipped_and_writes_nothing(sweep):
    root, folder, rope, alibi, _, _ = sweep
    before = files(folder)
    proc = posbench_cli("eval", str(rope), "eval.rope_scaling=yarn", cwd=root, in_process=True)
    assert "results.eval-rope_scaling-yarn.json already holds this re-score" in proc.stdout
    assert files(folder) == before


def test_the_report_groups_rescores_by_their_change_and_overlays_them(sweep, monkeypatch, capsys):
    root, folder, *_ = sweep
    proc = run_in_process(["report", str(folder)], monkeypatch, capsys)
    assert proc.returncode == 0, proc.stderr
    rows = {(r["label"], int(r["length"])): r for r in csv.DictReader(open(folder / "summary.csv"))}
    assert {label for label, _ in rows} == {"rope", "alibi", "rope (rope_scaling=pi)",
                                            "rope (rope_scaling=yarn)"}
    assert rows[("rope (rope_scaling=yarn)", 64)]["rescore_of"] == "rope"
    yarn = json.loads((folder / "encoding-rope" / "results.eval-rope_scaling-yarn.json")
                      .read_text())
    assert float(rows[("rope (rope_scaling=yarn)", 64)]["ppl_mean"]) == pytest.approx(
        yarn["eval"]["curve"][1]["ppl"], rel=1e-5)
    summary = (folder / "summary.md").read_text()
    assert summary.startswith("# posbench report: 2 runs, 2 re-scores")
    assert "| rope (rope_scaling=pi) |" in summary
    # parity compares training only: a re-score has no gap of its own
    assert rows[("rope (rope_scaling=pi)", 32)]["train_length_gap"] == ""


def test_a_finished_run_asked_for_new_eval_settings_by_train_scores_them(sweep, monkeypatch,
                                                                         capsys):
    root, _, rope, *_ = sweep
    overrides = [*TOY_SWEEP, "encoding=rope", f"hydra.run.dir={rope}"]
    proc = run_in_process(["train", *overrides, "eval.lengths=[32,48]"], monkeypatch, capsys)
    assert proc.returncode == 0, proc.stderr
    assert "holds this run, finished; scoring its checkpoint with the new eval settings " \
           "(lengths=[32,48])" in proc.stdout
    (new,) = rope.glob("results.eval-lengths-*.json")
    assert [p["length"] for p in json.loads(new.read_text())["eval"]["curve"]] == [32, 48]
    again = run_in_process(["train", *overrides, "eval.lengths=[32,48]"], monkeypatch, capsys)
    assert again.returncode == 0 and "already holds this re-score" in again.stdout
    same = run_in_process(["train", *overrides], monkeypatch, capsys)
    assert same.returncode == 0 and f"skipped {rope}: it holds this run, finished" in same.stdout


def test_a_name_taken_by_another_rescore_and_a_training_key_are_refused_in_one_line(
        sweep, monkeypatch, capsys):
    _, _, rope, *_ = sweep
    taken = rope / "results.eval-rope_scaling-pi.json"
    record = json.loads(taken.read_text())
    record["config"]["eval"]["rope_scaling"] = "ntk"
    taken.write_text(json.dumps(record))
    for argv, needle in [
            (["eval", str(rope), "eval.rope_scaling=pi"], "holds a re-score with "
             "eval.rope_scaling=ntk"),
            (["eval", str(rope), "model.n_layer=2"], "model.n_layer=2 is not accepted by "
             "posbench eval"),
            (["eval", str(rope), "logger=nosuch"], "logger='nosuch' is not accepted")]:
        proc = run_in_process(argv, monkeypatch, capsys)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert json.loads(taken.read_text()) == record


def test_changes_are_read_against_the_runs_config_with_keys_it_predates():
    trained = {"eval": {"lengths": [128, 256], "rope_scaling": "none"}, "device": "auto"}
    now = {"eval": {"lengths": [128, 4096], "rope_scaling": "yarn", "rope_scaling_factor": None,
                    "temperature": None}, "device": "auto"}
    changes = eval_changes(trained, now)  # a factor absent from the old run counts at its default
    assert changes == {"eval.lengths": [128, 4096], "eval.rope_scaling": "yarn"}
    assert change_label(changes) == "lengths=[128,4096], rope_scaling=yarn"
    assert change_tag(changes).startswith("lengths-128-4096-")
    assert change_tag(changes).endswith("_rope_scaling-yarn")


def test_a_rescore_scores_passkey_retrieval_when_asked(sweep, monkeypatch, capsys):
    _, _, rope, *_ = sweep
    asked = ["eval.retrieval.enabled=true", "eval.retrieval.trials=1",
             "eval.retrieval.key_tokens=4", "eval.retrieval.lengths=[64]",
             "eval.retrieval.depths=[0.5]"]
    proc = run_in_process(["eval", str(rope), *asked], monkeypatch, capsys)
    assert proc.returncode == 0, proc.stderr
    (path,) = rope.glob("results.eval-retrieval.enabled-true*.json")
    grid = json.loads(path.read_text())["eval"]["retrieval"]["grid"]
    assert [(cell["length"], cell["depth"]) for cell in grid] == [(64, 0.5)]
    assert (rope / path.name.replace("results", "retrieval_heatmap").replace(".json", ".png")
            ).stat().st_size > 0


def test_every_file_of_a_rescore_changing_long_keys_stays_within_100_characters(
        sweep, monkeypatch, capsys):
    _, _, rope, *_ = sweep
    asked = ["eval.retrieval.enabled=true", "eval.retrieval.trials=1",
             "eval.retrieval.key_tokens=4", "eval.retrieval.lengths=[64]",
             "eval.retrieval.depths=[0.25,0.75]", "eval.rope_scaling=yarn"]
    before = set(rope.iterdir())
    proc = run_in_process(["eval", str(rope), *asked], monkeypatch, capsys)
    assert proc.returncode == 0, proc.stderr
    written = set(rope.iterdir()) - before
    assert any(p.name.startswith("results.eval-") for p in written)
    assert any(p.name.startswith("retrieval_heatmap.eval-") for p in written)
    assert all(len(p.name) <= 100 for p in written), sorted(p.name for p in written)
    # the longest names a re-score writes, and different long changes keep different names
    changes = [{f"eval.retrieval.{key}": value for key in ("trials", "key_tokens", "depths",
                                                           "lengths", "filler_tokens")}
               for value in ("1" * 30, "2" * 30)]
    tags = [change_tag(c) for c in changes]
    assert tags[0] != tags[1]
    for tag in tags:
        for name in (f"accuracy_vs_length.eval-{tag}.png", f"results.eval-{tag}.json",
                     f"retrieval_heatmap.eval-{tag}.png", f"per_position.eval-{tag}.csv"):
            assert len(name) <= 100, name


def test_a_distance_remap_rescores_rope_and_skips_what_it_does_not_apply_to(sweep, monkeypatch,
                                                                           capsys):
    root, folder, rope, alibi, _, _ = sweep
    proc = run_in_process(["eval", str(folder), "eval.rope_scaling=shifted_rope",
                           "eval.rope_shift=12"], monkeypatch, capsys)
    assert proc.returncode == 0, proc.stderr
    assert (f"skipped {alibi}: eval.rope_scaling=shifted_rope applies to RoPE-rotated "
            "encodings") in proc.stdout
    record = json.loads((rope / "results.eval-rope_scaling-shifted_rope_rope_shift-12.json")
                        .read_text())
    assert record["eval"]["rope_remap"] == {"near": 12, "window": 2, "shift": 12, "factor": None}
    assert "rope_scaling shifted_rope (near 12, window 2, shift 12)" in (
        rope / "output.eval-rope_scaling-shifted_rope_rope_shift-12.log").read_text()


def test_a_run_saved_before_newer_keys_existed_is_skipped_rescored_and_extended(
        tmp_path, monkeypatch, capsys):
    old = tmp_path / "old"
    overrides = [*TOY_SWEEP, "encoding=rope", f"hydra.run.dir={old}"]
    assert run_in_process(["train", *overrides], monkeypatch, capsys).returncode == 0
    # as an older posbench saved it: without keys that were added to the schema since
    config_file = old / ".hydra" / "config.yaml"
    cfg, record = yaml.safe_load(config_file.read_text()), results(old)
    for group, key in [("eval", "temperature"), ("train", "eval_every"), ("model", "qk_norm"),
                       ("dataset", "bos"), ("encoding", "base")]:
        del cfg[group][key], record["config"][group][key]
    config_file.write_text(yaml.safe_dump(cfg))
    (old / "results.json").write_text(json.dumps(record))
    same = run_in_process(["train", *overrides], monkeypatch, capsys)
    assert same.returncode == 0 and f"skipped {old}: it holds this run, finished" in same.stdout
    rescore = run_in_process(["eval", str(old), "eval.temperature=logn"], monkeypatch, capsys)
    assert rescore.returncode == 0, rescore.stderr
    assert (old / "results.eval-temperature-logn.json").is_file()
    extension = tmp_path / "extension"
    extend = run_in_process(["extend", str(old), "train.steps=1", "eval.lengths=[64]",
                             f"hydra.run.dir={extension}"], monkeypatch, capsys)
    assert extend.returncode == 0, extend.stderr
    assert results(extension)["status"] == "ok"
