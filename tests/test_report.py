"""Reports over many runs, from results.json files written here (no training): seed averages with
a 95% t-interval, accuracy for tasks, per-group training lengths, and runs that failed."""
import csv
import json
import math

import pytest

from helpers import run_in_process, wandb_history, wandb_summary
from posbench.reports.report import write_report
from posbench.reports.stats import t95


def run_record(name, seed, ppls, status="ok", seq_len=32, accuracy=None, **config):
    curve = [{"length": n, "loss": math.log(p), "ppl": p} for n, p in ppls.items()]
    for point, acc in zip(curve, accuracy or []):
        point["accuracy"] = acc
    dataset = config.get("dataset", {"name": "task_copy" if accuracy else "pystdlib"})
    return {"encoding": name, "seed": seed, "status": status, "dataset": dataset,
            "train": {"seq_len": seq_len}, "eval": {"protocol": "nonoverlapping", "curve": curve},
            "config": {"encoding": {"name": name}, "seed": seed,
                       "train": {"seq_len": seq_len}, **config}}


def write(root, name, record):
    (root / name).mkdir(parents=True)
    (root / name / "results.json").write_text(json.dumps(record))


def summary_rows(root):
    return {(r["label"], int(r["length"])): r for r in csv.DictReader(open(root / "summary.csv"))}


def test_t95_is_students_t():
    stats = pytest.importorskip("scipy.stats")
    for df in range(1, 200):
        assert abs(t95(df) - stats.t.ppf(0.975, df)) < 0.003


def test_seeds_are_averaged_with_a_t_interval_and_the_ratio_is_reported(tmp_path):
    ppls = {"alibi": [(10.0, 11.0), (10.5, 11.5), (11.0, 13.0)], "nope": [(9.0, 50.0)] * 3}
    for encoding, by_seed in ppls.items():
        for seed, (short, long) in enumerate(by_seed):
            write(tmp_path, f"{encoding}-{seed}", run_record(encoding, seed, {32: short, 128: long}))
    write_report(tmp_path)
    rows = summary_rows(tmp_path)
    alibi = rows[("alibi", 128)]
    sd = math.sqrt(((11 - 11.833) ** 2 + (11.5 - 11.833) ** 2 + (13 - 11.833) ** 2) / 2)
    assert float(alibi["ppl_mean"]) == pytest.approx(11.8333, rel=1e-4)
    assert float(alibi["ppl_ci95"]) == pytest.approx(4.303 * sd / math.sqrt(3), rel=1e-3)
    assert alibi["seeds"] == "3" and float(rows[("nope", 128)]["ppl_ci95"]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "| alibi | 10.500 ± 1.242 | 11.833 ± 2.586 | +0.120 | 1.13 |" in summary
    assert "| nope | 9.000 ± 0.000 | 50.000 ± 0.000 | +1.715 | 5.56 | +0.0% |" in summary
    assert "Student t" in summary and "Failed" not in summary
    assert (tmp_path / "ppl_vs_length.png").stat().st_size > 0


def test_failed_partial_unreadable_and_missing_results_do_not_stop_the_report(tmp_path):
    write(tmp_path, "0_ok", run_record("rope", 0, {32: 8.0, 64: 9.0}))
    write(tmp_path, "1_failed", {"encoding": "t5", "status": "failed",
                                 "error": "FloatingPointError: non-finite loss at step 7"})
    write(tmp_path, "2_failed_full", {**run_record("alibi", 0, {}), "status": "failed",
                                      "error": "RuntimeError: boom"})
    (tmp_path / "3_bad").mkdir()
    (tmp_path / "3_bad" / "results.json").write_text("{not json")
    (tmp_path / "4_killed" / ".hydra").mkdir(parents=True)
    (tmp_path / "4_killed" / ".hydra" / "config.yaml").write_text("seed: 0\n")
    write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "| rope | 8.000 | 9.000 | +0.118 | 1.12 | +0.0% |" in summary
    failed = summary.split("Failed, interrupted or refused runs:")[1]
    for needle in ("1_failed (failed): FloatingPointError",
                   "2_failed_full (failed): RuntimeError: boom",
                   "3_bad (unreadable): results.json unreadable",
                   "4_killed (incomplete): no results.json"):
        assert needle in failed
    assert {label for label, _ in summary_rows(tmp_path)} == {"rope"}


def test_tasks_get_an_accuracy_table_and_plot(tmp_path):
    for seed in (0, 1):
        write(tmp_path, f"copy-{seed}", run_record("rope", seed, {32: 1.5, 64: 3.0},
                                                   accuracy=[0.9 + 0.1 * seed, 0.0]))
    write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "Exact-match accuracy" in summary and "| rope | 0.950 ± 0.635 | 0.000 ± 0.000 |" in summary
    assert summary_rows(tmp_path)[("rope", 32)]["accuracy_mean"] == "0.95"
    assert (tmp_path / "accuracy_vs_length.png").stat().st_size > 0


def test_several_tasks_get_a_panel_each_their_groups_labelled_within_the_task(tmp_path):
    """Two tasks at their own training lengths, NoPE and RoPE on each in two seeds, and a
    re-score of copy's RoPE: one panel per task, its curves named by encoding alone (the
    task is the panel's), the re-score by its change, each task's own L, each seed's points."""
    for task, n in (("task_copy", 41), ("task_parity", 17)):
        for enc in ("nope", "rope"):
            for seed in (0, 1):
                write(tmp_path, f"{task}-{enc}-{seed}",
                      run_record(enc, seed, {n: 1.5, 2 * n: 3.0}, seq_len=n,
                                 accuracy=[1.0, 0.25 * seed], dataset={"name": task}))
    rescore = run_record("rope", 0, {41: 1.5, 82: 2.0}, seq_len=41, accuracy=[1.0, 0.5],
                         dataset={"name": "task_copy"})
    rescore.update(rescore={"label": "pi", "changes": {"eval.rope_scaling": "pi"}})
    (tmp_path / "task_copy-rope-0" / "results.eval-pi.json").write_text(json.dumps(rescore))
    from posbench.reports.report import by_task, find_runs, groups_of

    groups, _, base_of, _, _ = groups_of(find_runs(tmp_path)[0])
    series = {label: [(41, 1.0, None)] for label in groups}
    seeds = {label: [(41, 1.0), (41, 0.5)] for label in groups}
    panels, lengths = by_task(groups, series, seeds, base_of)
    assert lengths == {"task_copy": 41, "task_parity": 17}
    assert set(panels["task_parity"]) == {"nope", "rope"}
    assert set(panels["task_copy"]) == {"nope", "rope", "rope (pi)"}
    copy_rope = next(label for label in groups if label.startswith("rope [")
                     and groups[label][0]["dataset"]["name"] == "task_copy")
    assert panels["task_copy"]["rope"] == (series[copy_rope], seeds[copy_rope])
    parity = {label: groups[label] for label in groups if "parity" in label}
    assert by_task(parity, {label: series[label] for label in parity}, seeds, {}) == ({}, {})
    write_report(tmp_path)
    assert (tmp_path / "accuracy_vs_length.png").stat().st_size > 0


def test_a_swept_training_length_is_its_own_group_with_its_own_ratio(tmp_path):
    write(tmp_path, "a", run_record("alibi", 0, {32: 10.0, 64: 9.0, 128: 12.0}, seq_len=32))
    write(tmp_path, "b", run_record("alibi", 0, {32: 10.0, 64: 8.0, 128: 12.0}, seq_len=64))
    write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "| alibi [seq_len=32] | 10.000 | 9.000 | 12.000 | +0.038 | 1.20 | +0.0% |" in summary
    assert "| alibi [seq_len=64] | 10.000 | 8.000 | 12.000 | +0.405 | 1.50 | +0.0% |" in summary


def test_an_encodings_own_keys_label_only_runs_of_that_encoding(tmp_path):
    t5 = lambda buckets: {"encoding": {"name": "t5", "num_buckets": buckets}}
    write(tmp_path, "a", run_record("rope", 0, {32: 9.0}, encoding={"name": "rope", "base": 1e4}))
    write(tmp_path, "b", run_record("t5", 0, {32: 8.0}, **t5(32)))
    write(tmp_path, "c", run_record("t5", 0, {32: 7.0}, **t5(16)))
    write_report(tmp_path)
    labels = {label for label, _ in summary_rows(tmp_path)}
    assert labels == {"rope", "t5 [num_buckets=32]", "t5 [num_buckets=16]"}


def test_labels_name_a_knob_only_where_a_group_has_other_than_the_usual_value(tmp_path):
    """A sweep of knobs: each row names the knob it changed, not every knob the sweep touched;
    summary.md says what the unnamed ones are. An encoding's own key is usual per encoding."""
    model = lambda **keys: {"model": {"attn_gate": "none", "attn_sinks": False, **keys}}
    write(tmp_path, "rope", run_record("rope", 0, {32: 9.0}, **model()))
    write(tmp_path, "rope-1", run_record("rope", 1, {32: 9.2}, **model()))
    write(tmp_path, "sinks", run_record("rope", 0, {32: 9.1}, **model(attn_sinks=True)))
    write(tmp_path, "gate", run_record("rope", 0, {32: 8.9}, **model(attn_gate="elementwise")))
    write(tmp_path, "alibi", run_record("alibi", 0, {32: 9.5}, **model()))
    t5 = lambda buckets, **keys: {"encoding": {"name": "t5", "num_buckets": buckets},
                                  **model(**keys)}
    write(tmp_path, "t5", run_record("t5", 0, {32: 8.0}, **t5(32)))
    write(tmp_path, "t5-sinks", run_record("t5", 0, {32: 8.0}, **t5(32, attn_sinks=True)))
    write(tmp_path, "t5-16", run_record("t5", 0, {32: 8.0}, **t5(16)))
    write_report(tmp_path)
    rows = summary_rows(tmp_path)
    assert {label: row["seeds"] for (label, _), row in rows.items()} == {
        "rope": "2", "rope [attn_sinks=true]": "1", "rope [attn_gate=elementwise]": "1",
        "alibi": "1", "t5": "1", "t5 [attn_sinks=true]": "1", "t5 [num_buckets=16]": "1"}
    assert ("the sweep share: attn_gate=none, attn_sinks=false, t5 num_buckets=32."
            in (tmp_path / "summary.md").read_text())


def test_a_key_added_since_a_run_was_saved_reads_as_its_default(tmp_path):
    """Seeds of one setting saved before and after train.pack_documents existed are one group;
    a run that set the new key to another value is its own."""
    train = lambda **keys: {"train": {"seq_len": 32, **keys}}
    write(tmp_path, "old", run_record("rope", 0, {32: 10.0}))  # saved before the key existed
    write(tmp_path, "new", run_record("rope", 1, {32: 12.0}, **train(pack_documents=False)))
    write(tmp_path, "packed", run_record("rope", 0, {32: 9.0}, **train(pack_documents=True)))
    write_report(tmp_path)
    rows = summary_rows(tmp_path)
    assert {label: row["seeds"] for (label, _), row in rows.items()} == {
        "rope [pack_documents=false]": "2", "rope [pack_documents=true]": "1"}
    assert float(rows["rope [pack_documents=false]", 32]["ppl_mean"]) == pytest.approx(11.0)


def test_parity_gap_to_the_best_at_the_training_length_marks_under_trained_groups(tmp_path):
    # at the training length 32: rope 4.0 (best), alibi 4.4 (+10%), sinusoidal 3 seeds around
    # 6.0 (+50%); a group trained at 64 is compared only with its own training length
    runs = {("rope", 0): 4.0, ("alibi", 0): 4.4, ("sinusoidal", 0): 5.0, ("sinusoidal", 1): 6.0,
            ("sinusoidal", 2): 7.0}
    for (name, seed), ppl in runs.items():
        write(tmp_path, f"{name}-{seed}", run_record(name, seed, {32: ppl, 128: 2 * ppl}))
    write(tmp_path, "t5-64", run_record("t5", 0, {64: 9.0, 128: 9.0}, seq_len=64))
    write_report(tmp_path)
    rows = summary_rows(tmp_path)
    half_width = 4.303 * 1.0 / math.sqrt(3)  # sd of (5, 6, 7) is 1
    expected = {"rope": (0.0, 0.0), "alibi": (0.1, 0.0), "sinusoidal": (0.5, half_width / 4.0)}
    for label, (gap, band) in expected.items():
        row = rows[(label, 32)]  # 32, the length most groups share, is left out of labels
        assert float(row["train_length_gap"]) == pytest.approx(gap, abs=1e-9)
        assert float(row["train_length_gap_ci95"]) == pytest.approx(band, rel=1e-3)
        assert row["under_trained"] == str(gap > 0.15)
        assert float(row["extrapolation_ratio"]) == pytest.approx(2.0)
    assert float(rows[("t5 [seq_len=64]", 64)]["train_length_gap"]) == 0.0
    summary = (tmp_path / "summary.md").read_text()
    assert "| sinusoidal |" in summary and "the sweep share: seq_len=32." in summary
    assert f"+50.0% ± {half_width / 4.0:.1%} under-trained |" in summary
    under = [line for line in summary.splitlines() if "extrapolation ratio is not comparable" in line]
    assert len(under) == 1 and under[0].startswith("- **sinusoidal")


@pytest.mark.figures  # wandb reads the PNGs
def test_the_sweep_report_logs_parity_to_wandb(tmp_path):
    from omegaconf import OmegaConf

    from posbench.runs.loggers import log_sweep_report

    write(tmp_path, "a", run_record("rope", 0, {32: 4.0, 64: 5.0}))
    write(tmp_path, "b", run_record("sinusoidal", 0, {32: 6.0, 64: 9.0}))
    parity = write_report(tmp_path)
    assert parity["sinusoidal"]["under_trained"] and parity["sinusoidal"]["gap"] == pytest.approx(0.5)
    # a second figure, as a folder of several sizes draws (by_size.png)
    (tmp_path / "by_size.png").write_bytes((tmp_path / "ppl_vs_length.png").read_bytes())
    log_sweep_report(OmegaConf.create({"mode": "offline", "project": "posbench", "entity": None}),
                     tmp_path, parity)
    summary = wandb_summary(tmp_path)  # read back from the offline run file
    assert summary["parity/sinusoidal/gap"] == pytest.approx(0.5)
    assert summary["parity/sinusoidal/under_trained"] is True
    assert summary["parity/rope/train_length_ppl"] == pytest.approx(4.0)
    # every figure the report drew, by its name
    drawn = {png.stem for png in tmp_path.glob("*.png")}
    assert {"ppl_vs_length", "by_size"} <= drawn
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    assert {key.rsplit("/", 1)[0] for row in wandb_history(run_file)
            for key, value in row.items() if value == "image-file"} == drawn


def test_a_repeated_seed_is_counted_once_and_throughput_is_reported(tmp_path):
    for name, ppl, seconds in (("0_rope", 8.0, 100.0), ("1_rope_again", 9.0, 300.0)):
        record = run_record("rope", 0, {32: ppl, 64: 2 * ppl})
        record["train"].update(tokens_per_second=1000.0, wall_seconds=seconds)
        write(tmp_path, name, record)
    write_report(tmp_path)
    rows = summary_rows(tmp_path)
    assert rows[("rope", 32)]["seeds"] == "1" and rows[("rope", 32)]["ppl_mean"] == "8"
    assert rows[("rope", 32)]["tokens_per_second"] == "1000"
    assert rows[("rope", 32)]["wall_seconds"] == "100"
    summary = (tmp_path / "summary.md").read_text()
    assert "±" not in summary and "| rope | tokens | 1000 | 1:40 |" in summary
    assert (f"- {tmp_path}/1_rope_again/results.json repeats {tmp_path}/0_rope/results.json "
            "(same config and seed 0): counted once") in summary


def test_the_headline_is_the_mean_log_ppl_growth_past_the_training_length(tmp_path):
    # a dip at one length (other text sampled there) moves the ratio at the longest length,
    # while the mean over every length past L moves by a third of it
    write(tmp_path, "a", run_record("rope", 0, {32: 4.0, 64: 8.0, 128: 4.0, 256: 16.0}))
    write_report(tmp_path)
    row = summary_rows(tmp_path)[("rope", 32)]
    assert float(row["log_ppl_growth"]) == pytest.approx((math.log(2) + 0 + math.log(4)) / 3)
    assert float(row["extrapolation_ratio"]) == pytest.approx(4.0)
    assert "eval.protocol=growing_context" in (tmp_path / "summary.md").read_text()


def test_plots_keep_the_legend_outside_with_plain_ticks_for_many_groups(tmp_path, monkeypatch):
    import posbench.core.plots as plots

    saved = {}
    monkeypatch.setattr(plots, "save_figure", lambda plt, fig, path: saved.update(fig=fig))
    series = {f"encoding_{i} [lr=0.00{i}, seq_len=128]": [(128, 126.6 + i, None), (256, 140.0, None),
                                                          (2048, 161.0 + i, None)]
              for i in range(30)}
    plots.plot_curves(series, 128, tmp_path / "p.png", title="perplexity vs length " * 8)
    fig = saved["fig"]
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend()
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # beside the axes
    texts = [t.get_text() for t in legend.get_texts()]
    assert len(texts) == plots.LEGEND_ENTRIES and texts[-1] == "and 12 more (summary.md)"
    ticks = [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels()]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["128", "256", "2048"]
    assert all(t.replace(".", "").isdigit() for t in ticks), ticks
    assert len(ax.get_yticklabels()) >= 3
    assert max(len(line) for line in ax.get_title().splitlines()) <= 70


def test_every_table_of_the_summary_lists_the_groups_in_one_order(tmp_path):
    # folders in an order that is not the labels' (the perplexity table's) order
    for name, ppl in (("0_rope", 8.0), ("1_alibi", 9.0), ("2_nope", 10.0)):
        record = run_record(name.split("_")[1], 0, {32: ppl, 64: 2 * ppl},
                            accuracy=[0.5, 0.25])
        record["train"].update(tokens_per_second=1000.0, wall_seconds=60.0)
        write(tmp_path, name, record)
    write_report(tmp_path)
    tables, rows = [], None
    for line in (tmp_path / "summary.md").read_text().splitlines():
        if line.startswith("| group |") or line.startswith("| encoding |"):
            rows = []
            tables.append(rows)
        elif line.startswith("|---") and rows is not None:
            continue
        elif line.startswith("| ") and rows is not None:
            rows.append(line.split(" | ")[0].removeprefix("| "))
        else:
            rows = None
    assert len(tables) >= 4  # perplexity, accuracy, effective length, throughput
    assert tables[0] == ["alibi", "nope", "rope"]
    assert all(table == tables[0] for table in tables), tables


def protocol_record(name, protocol, ppls):
    record = run_record(name, 0, ppls, eval={"protocol": protocol})
    record["eval"]["protocol"] = protocol
    return record


def test_a_folder_of_several_protocols_says_so_and_reports_one_on_request(
        tmp_path, monkeypatch, capsys):
    # sliding windows score each token with more context: lower perplexity, whatever the encoding
    write(tmp_path, "0_rope", protocol_record("rope", "nonoverlapping", {32: 4.0, 128: 8.0}))
    write(tmp_path, "1_alibi", protocol_record("alibi", "nonoverlapping", {32: 4.4, 128: 4.8}))
    write(tmp_path, "2_rope", protocol_record("rope", "sliding", {32: 3.0, 128: 6.0}))

    bad = run_in_process(["report", str(tmp_path), "--protocol", "slidng"], monkeypatch, capsys)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "'slidng'" in bad.stderr and "nonoverlapping, sliding" in bad.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0_rope", "1_alibi", "2_rope"]

    write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    (note,) = [line for line in summary.splitlines() if "2 protocols" in line]
    assert "nonoverlapping (2 groups), sliding (1 group)" in note
    assert f"`posbench report {tmp_path} --protocol NAME`" in note
    rows = summary_rows(tmp_path)
    # the gap at the training length compares groups of one protocol: rope is the best of its
    sliding = [label for label, n in rows if "sliding" in label and n == 32]
    assert len(sliding) == 1
    assert float(rows[(sliding[0], 32)]["train_length_gap"]) == 0.0
    nonoverlapping = [label for label, n in rows if label.startswith("rope") and n == 32
                      and label != sliding[0]]
    assert float(rows[(nonoverlapping[0], 32)]["train_length_gap"]) == 0.0

    proc = run_in_process(["report", str(tmp_path), "--protocol=sliding"], monkeypatch, capsys)
    assert proc.returncode == 0, proc.stderr
    assert {label for label, _ in summary_rows(tmp_path)} == {sliding[0]}
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# posbench report: 1 runs (eval.protocol=sliding only; 2 results "
                              "of other protocols left out)")
    assert "2 protocols" not in summary


def test_each_groups_budget_is_named_and_a_mixed_folder_says_so(tmp_path):
    tokens = run_record("rope", 0, {32: 8.0, 64: 16.0}, train={"seq_len": 32, "budget": "tokens"})
    tokens["train"].update(steps=2000, budget="tokens")
    flops = run_record("path", 0, {32: 8.0, 64: 16.0}, train={"seq_len": 32, "budget": "flops"})
    flops["train"].update(budget="flops", budget_flops=2.2e13, steps_run=1380)
    write(tmp_path, "rope", tokens)
    write(tmp_path, "path", flops)
    write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "These runs trained under 2 budgets (flops, tokens; train.budget)" in summary
    assert "| rope [budget=tokens] | tokens: 2000 steps |" in summary
    assert "| path [budget=flops] | flops: 2.2e+13 (1380 steps) |" in summary


def wallclock_record(name, seed, device):
    record = run_record(name, seed, {32: 8.0, 64: 16.0},
                        train={"seq_len": 32, "budget": "wallclock", "budget_seconds": 60.0})
    record["train"].update(budget="wallclock", budget_seconds=60.0, device=device,
                           steps_reached=100 + seed)
    return record


def test_wallclock_runs_on_several_devices_are_named_and_a_mixed_group_is_marked(tmp_path):
    write(tmp_path, "rope0", wallclock_record("rope", 0, "NVIDIA H100 80GB HBM3"))
    write(tmp_path, "rope1", wallclock_record("rope", 1, "NVIDIA H200"))
    write(tmp_path, "alibi0", wallclock_record("alibi", 0, "NVIDIA H100 80GB HBM3"))
    write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert ("These wallclock runs spent their seconds on 2 devices (NVIDIA H100 80GB HBM3; "
            "NVIDIA H200)") in summary
    rows = {line.split(" | ")[0].strip("| "): line for line in summary.splitlines()
            if "wallclock: 60 s" in line}
    assert "MIXED DEVICES: NVIDIA H100 80GB HBM3, NVIDIA H200" in rows["rope"]
    assert "MIXED" not in rows["alibi"]


def test_wallclock_runs_on_one_device_get_no_device_line(tmp_path):
    write(tmp_path, "rope0", wallclock_record("rope", 0, "NVIDIA H200"))
    write(tmp_path, "alibi0", wallclock_record("alibi", 0, "NVIDIA H200"))
    write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "spent their seconds on" not in summary and "MIXED" not in summary
