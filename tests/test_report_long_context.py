"""RULER and LongPPL across the groups of a report (posbench/reports/long_context.py), from
results.json files written here (no training): summary.md's cells and the figures' plotted lines
against means and Student-t intervals recomputed here from the records, and neither view where
no run holds the data."""
import json
import math
import random
import re
import statistics

import pytest

import posbench.reports.long_context as long_context
from posbench.reports.report import write_report
from test_report import run_record, write
from test_report_html import Page, markdown_tables

stats = pytest.importorskip("scipy.stats")

TASKS = ("niah_single_1", "vt")
LENGTHS = (32, 64, 128)
TRUNC = 32  # LongPPL's short context: no key token at 32
# group -> seeds; alibi's seed 1 ran out of memory in vt at 128, rope's seed 2 found no key token
# at 64; nope scored neither evaluation
SEEDS = {"rope": 3, "alibi": 2, "nope": 1}
OOM = {("alibi", 1): ("vt", 128)}
NO_KEYS = {("rope", 2): 64}
SCORES = ("exact_match", "recall", "bits_saved")  # a RULER point's scores


def ruler_result(rng, oom=None, recall=True):
    """eval.ruler as results.json holds it: each task's exact match, recall (not in a record saved
    before recall existed) and bits by length, the average over the tasks where every task has
    the length."""
    tasks = {}
    for name in TASKS:
        points = []
        for n in LENGTHS:
            point = {"length": n}
            if (name, n) != oom:
                exact = rng.random()
                point.update(exact_match=exact, bits_saved=rng.uniform(-1, 3))
                if recall:  # every item found where all are, some where not all are
                    point["recall"] = exact + rng.random() * (1 - exact)
            points.append(point)
        tasks[name] = {"ruler": "r", "grid": [], "by_length": points}
    average = []
    for i, n in enumerate(LENGTHS):
        points = [t["by_length"][i] for t in tasks.values()]
        average.append({"length": n, **({key: statistics.mean(p[key] for p in points)
                                         for key in SCORES if key in points[0]}
                                        if all("exact_match" in p for p in points) else {})})
    return {"tasks": tasks, "by_length": average, "trials": 2}


def longppl_result(rng, no_keys=None):
    points = []
    for n in LENGTHS:
        keys = 0 if n <= TRUNC or n == no_keys else rng.randint(5, 50)
        loss = rng.uniform(0.5, 3)
        points.append({"length": n, "tokens": 256, "key_tokens": keys, "fraction": keys / 256,
                       "loss": loss if keys else None,
                       "longppl": math.exp(loss) if keys else None, "ppl": rng.uniform(5, 40)})
    return {"units": "nats", "alpha": 2.0, "beta": 2.0, "trunc_len": TRUNC, "block": 1,
            "evaluator": None, "by_length": points}


def write_runs(root, ruler=True, longppl=True, before_recall=()):
    """The runs of SEEDS, their records returned by group; the (group, seed) runs of
    `before_recall` scored RULER before recall existed."""
    rng, records = random.Random(7), {}
    for name, seeds in SEEDS.items():
        for seed in range(seeds):
            record = run_record(name, seed, {n: 10.0 + seed for n in LENGTHS})
            if name != "nope":
                record["eval"]["ruler"] = ruler_result(
                    rng, OOM.get((name, seed)), (name, seed) not in before_recall) \
                    if ruler else None
                record["eval"]["longppl"] = longppl_result(rng, NO_KEYS.get((name, seed))) \
                    if longppl else None
            write(root, f"{name}-{seed}", record)
            records.setdefault(name, []).append(record)
    return records


@pytest.fixture
def drawn(monkeypatch):
    """path name -> the figure long_context would write, drawn and also written."""
    figures, save = {}, long_context.save_figure

    def keep(plt, fig, path):
        fig.canvas.draw()
        figures[path.name] = fig
        save(plt, fig, path)

    monkeypatch.setattr(long_context, "save_figure", keep)
    return figures


def seed_points(records, points, key):
    """length -> the value of each record that has one, and how many records scored it."""
    out = {}
    for record in records:
        for p in points(record):
            values, scored = out.get(p["length"], ([], 0))
            out[p["length"]] = (values + ([p[key]] if p.get(key) is not None else []),
                                scored + 1)
    return out


def band(values):
    """Mean and the 95% Student-t half-width of the mean (0 for one value)."""
    n = len(values)
    if n == 1:
        return values[0], 0.0
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return statistics.mean(values), half


def assert_cell(text, values, scored, digits):
    """A table cell, `mean ± half (notes; k of n seeds)`, against `values`: the other notes
    are returned."""
    found = re.fullmatch(r"(-?[\d.]+)(?: ± ([\d.]+))?(?: \((.*)\))?", text)
    assert found, text
    mean, half = band(values)
    assert float(found[1]) == pytest.approx(mean, abs=0.51 * 10 ** -digits), text
    assert (found[2] is None) == (len(values) == 1), text
    if found[2] is not None:  # within the cell's last digit, or the t table's 3 decimals
        assert float(found[2]) == pytest.approx(half, rel=3e-4, abs=0.51 * 10 ** -digits), text
    notes = found[3].split("; ") if found[3] else []
    partial = [note for note in notes if note.endswith(" seeds")]
    assert partial == ([f"{len(values)} of {scored} seeds"] if len(values) < scored else []), text
    return [note for note in notes if note not in partial]


def tables_after(summary, heading, count):
    """The `count` markdown tables that follow the line of summary.md starting with `heading`,
    each named by the text line before it."""
    lines = summary.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    out, name = {}, None
    for i in range(start, len(lines)):
        if lines[i].startswith("| group |") and len(out) < count:
            out[name] = markdown_tables("\n".join(lines[i:]))[0]
        elif lines[i] and not lines[i].startswith("|"):
            name = lines[i]
    return out


def task_points(name):
    return lambda ruler: ruler["by_length"] if name == "average" else \
        ruler["tasks"][name]["by_length"]


# RULER's score, recall, where every run has it; exact match for all where one run lacks it
@pytest.mark.parametrize("before_recall, score, name", [((), "recall", "recall"),
                                                        ({("rope", 1)}, "exact_match",
                                                         "exact match")])
def test_ruler_by_group_tables_and_plots_the_mean_over_seeds_of_each_task(
        tmp_path, drawn, before_recall, score, name):
    records = write_runs(tmp_path, before_recall=before_recall)
    write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    tables = tables_after(summary, "RULER across groups", 1 + len(TASKS))
    assert list(tables) == ["average (mean over the tasks):", f"niah_single_1 ({name}):",
                            f"vt ({name}):"]
    fig = drawn["ruler_by_group.png"]
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
    assert [ax.get_title() for ax in panels] == ["average over the tasks", *TASKS]
    partial = 0
    assert fig.get_suptitle().startswith(f"RULER {name} by length")
    for (heading, table), ax in zip(tables.items(), panels):
        assert table[0] == ["group", "32 (L)", "64", "128"]
        assert [row[0] for row in table[1:]] == ["alibi", "rope"]  # nope scored no RULER
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert lines["train length 32"].get_xdata()[0] == 32
        scattered = {tuple(map(float, xy)) for c in ax.collections
                     if hasattr(c, "get_offsets") and type(c).__name__ == "PathCollection"
                     for xy in c.get_offsets()}
        for row in table[1:]:
            group = seed_points([r["eval"]["ruler"] for r in records[row[0]]],
                                task_points(heading.split(" ")[0]), score)
            for n, text in zip(LENGTHS, row[1:]):
                assert assert_cell(text, *group[n], digits=2) == []
                partial += len(group[n][0]) < group[n][1]
            # the plotted line: the mean over the seeds that have the length; each seed a circle
            xs, ys = lines[row[0]].get_data()
            assert list(xs) == list(LENGTHS)
            assert list(ys) == pytest.approx([statistics.mean(group[n][0]) for n in LENGTHS],
                                             abs=1e-12)
            assert {(n, v) for n in LENGTHS for v in group[n][0]} <= scattered
        assert ax.get_xscale() == "log" and [t.get_text() for t in ax.get_xticklabels()] == \
            ["32", "64", "128"]
    assert partial == 2  # alibi's vt and average at 128: one of its two seeds
    (legend,) = [ax.get_legend() for ax in panels if ax.get_legend()]
    assert [t.get_text() for t in legend.get_texts()] == ["alibi", "rope", "train length 32"]
    html = Page((tmp_path / "report.html").read_text())
    assert [i["alt"] for i in html.images][-2:] == ["ruler_by_group.png", "longppl_by_group.png"]


def test_longppl_by_group_tables_key_tokens_and_plots_it_beside_perplexity(tmp_path, drawn):
    records = write_runs(tmp_path)
    write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    (table,) = tables_after(summary, "LongPPL across groups", 1).values()
    assert "key tokens chosen by the run itself, trunc_len=32, block=1, alpha=2, beta=2" in summary
    assert table[0] == ["group", "32 (L)", "64", "128"]
    assert [row[0] for row in table[1:]] == ["alibi", "rope"]
    left, right = drawn["longppl_by_group.png"].axes
    assert left.get_shared_x_axes().joined(left, right)
    for row in table[1:]:
        results = [r["eval"]["longppl"] for r in records[row[0]]]
        longppl = seed_points(results, lambda r: r["by_length"], "longppl")
        ppl = seed_points(results, lambda r: r["by_length"], "ppl")
        for n, text in zip(LENGTHS, row[1:]):
            keys = statistics.mean(p["key_tokens"] for r in results for p in r["by_length"]
                                   if p["length"] == n)
            if not longppl[n][0]:
                assert text == f"null ({keys:.0f})"
            else:
                assert assert_cell(text, *longppl[n], digits=3) == [f"{keys:.0f}"]
        plotted = {line.get_label(): line.get_data() for line in right.get_lines()}
        xs = [n for n in LENGTHS if longppl[n][0]]
        assert list(plotted[row[0]][0]) == xs == [64, 128]
        assert list(plotted[row[0]][1]) == pytest.approx(
            [statistics.mean(longppl[n][0]) for n in xs], abs=1e-12)
        plotted = {line.get_label(): line.get_data() for line in left.get_lines()}
        assert list(plotted[row[0]][1]) == pytest.approx(
            [statistics.mean(ppl[n][0]) for n in LENGTHS], abs=1e-12)
    assert "2 of 3 seeds" in table[2][2]  # rope at 64: seed 2 found no key token


def test_no_run_with_the_data_no_view_and_no_key_token_no_figure(tmp_path, drawn):
    write_runs(tmp_path / "neither", ruler=False, longppl=False)
    write_report(tmp_path / "neither")
    summary = (tmp_path / "neither" / "summary.md").read_text()
    assert "RULER across groups" not in summary and "LongPPL across groups" not in summary
    assert not drawn and not list((tmp_path / "neither").glob("*_by_group.png"))
    assert "by_group" not in (tmp_path / "neither" / "report.html").read_text()

    records = write_runs(tmp_path / "ruler", longppl=False)
    write_report(tmp_path / "ruler")
    assert list(drawn) == ["ruler_by_group.png"]
    assert "LongPPL across groups" not in (tmp_path / "ruler" / "summary.md").read_text()

    # LongPPL scored, without a key token at any length: its table, no empty figure
    for group in records.values():
        for i, record in enumerate(group):
            if record["eval"].get("ruler"):
                record["eval"]["ruler"] = None
                record["eval"]["longppl"] = longppl_result(random.Random(i), no_keys=None)
                for p in record["eval"]["longppl"]["by_length"]:
                    p.update(key_tokens=0, longppl=None, loss=None)
            write(tmp_path / "keyless", f"{record['encoding']}-{i}", record)
    drawn.clear()
    write_report(tmp_path / "keyless")
    (table,) = tables_after((tmp_path / "keyless" / "summary.md").read_text(),
                            "LongPPL across groups", 1).values()
    assert table[1][1:] == ["null (0)"] * 3 and not drawn


def test_each_training_length_is_marked_with_its_own_dashes(tmp_path, drawn):
    rng = random.Random(3)
    for seq_len in (32, 64):
        record = run_record("rope", 0, {n: 10.0 for n in LENGTHS}, seq_len=seq_len)
        record["eval"]["ruler"] = ruler_result(rng)
        write(tmp_path, f"rope-{seq_len}", record)
    write_report(tmp_path)
    (table, *_) = tables_after((tmp_path / "summary.md").read_text(), "RULER across groups",
                               1).values()
    assert table[0] == ["group", "32", "64", "128"]  # no one L to mark
    for ax in drawn["ruler_by_group.png"].axes[:1 + len(TASKS)]:
        marks = {line.get_label(): (line.get_xdata()[0], line.get_linestyle())
                 for line in ax.get_lines() if line.get_label().startswith("train length")}
        assert {label: x for label, (x, _) in marks.items()} == {"train length 32": 32,
                                                                 "train length 64": 64}
        assert len({style for _, style in marks.values()}) == 2


def test_runs_scored_on_other_instance_formats_are_named_apart(tmp_path, drawn):
    records = write_runs(tmp_path / "one")
    write_report(tmp_path / "one")
    assert "different formats" not in (tmp_path / "one" / "summary.md").read_text()
    for name, group in records.items():  # alibi's runs scored on format 2, rope's on format 1
        for i, record in enumerate(group):
            if record["eval"].get("ruler"):
                record["eval"]["ruler"]["format"] = 2 if name == "alibi" else 1
            write(tmp_path / "mixed", f"{name}-{i}", record)
    write_report(tmp_path / "mixed")
    assert ("only the groups of one format compare: format 1: rope; format 2: alibi."
            in (tmp_path / "mixed" / "summary.md").read_text())


def test_the_changes_every_rescored_group_shares_are_named_once_not_in_each_label(tmp_path,
                                                                                   drawn):
    """`posbench eval DIR eval.longppl.enabled=true eval.longppl.block=16` over runs trained
    without LongPPL (RULER too), and RoPE's run also with YaRN: each view's groups are all
    re-scores sharing those two changes, so its labels leave them out and its heading names them;
    with a run scored in training among them, nothing is shared and every label stays whole."""
    rng = random.Random(5)
    shared = {"eval.longppl.enabled": True, "eval.longppl.block": 16}
    rescores = {"alibi": [{}], "rope": [{}, {"eval.rope_scaling": "yarn"}]}
    for name, extras in rescores.items():
        run = tmp_path / name
        record = run_record(name, 0, {n: 10.0 for n in LENGTHS})
        write(tmp_path, name, record)
        for extra in extras:
            changes = {**extra, **shared}
            label = ", ".join(f"{k.removeprefix('eval.')}={str(v).lower()}"
                              for k, v in changes.items())
            rescore = {**record, "eval": {**record["eval"], "longppl": longppl_result(rng),
                                          "ruler": ruler_result(rng)},
                       "rescore": {"tag": label, "label": label, "changes": changes}}
            (run / f"results.eval-{len(extra)}.json").write_text(json.dumps(rescore))
    write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    (table,) = tables_after(summary, "LongPPL across groups", 1).values()
    assert [row[0] for row in table[1:]] == ["alibi", "rope", "rope (rope_scaling=yarn)"]
    heading = next(line for line in summary.splitlines()
                   if line.startswith("LongPPL across groups"))
    assert "every group re-scored with longppl.enabled=true, longppl.block=16." in heading
    _, right = drawn["longppl_by_group.png"].axes
    assert {line.get_label() for line in right.get_lines()} >= {
        "alibi", "rope", "rope (rope_scaling=yarn)"}
    (ruler_table,) = tables_after(summary, "RULER across groups", 1).values()
    assert [row[0] for row in ruler_table[1:]] == ["alibi", "rope", "rope (rope_scaling=yarn)"]
    # one run scored in training: nothing shared, every label whole
    record = run_record("t5", 0, {n: 10.0 for n in LENGTHS})
    record["eval"]["longppl"] = longppl_result(rng)
    write(tmp_path, "t5", record)
    write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    (table,) = tables_after(summary, "LongPPL across groups", 1).values()
    assert [row[0] for row in table[1:]] == [
        "alibi (longppl.enabled=true, longppl.block=16)",
        "rope (longppl.enabled=true, longppl.block=16)",
        "rope (rope_scaling=yarn, longppl.enabled=true, longppl.block=16)", "t5"]
    heading = next(line for line in summary.splitlines()
                   if line.startswith("LongPPL across groups"))
    assert "every group re-scored" not in heading
