"""`posbench reproduce gelberg2025_retrieval`: DroPE's Table 1, zero-shot success at 2L on
RULER's multi-query, multi-key and multi-value tasks; each row a config (or, for RoPE's three
scalings, RoPE's runs re-scored) that composes into its training and scoring, runs measured from
their results.json records and the declared re-scores, every claim judged on the paper's numbers,
on numbers that break it and on rows that did not learn a task at L, and the entry run at a toy
scale through the CLI: trained rows trained, the scalings re-scored, both skipped when run again."""
import dataclasses
import json
import math
import shutil
import statistics
from collections import Counter

import pytest

import posbench
from helpers import posbench_cli
from posbench.evaluations.ruler_tasks import DEFAULT_TASKS
from posbench.reproduce import NOT_COMPARABLE, NOT_REPRODUCED, REPRODUCED, Measured, registry
from posbench.reports.stats import t95
from posbench.reproduce.claims import task_group
from posbench.reproduce.command import sweep_overrides
from posbench.reproduce.gelberg2025_retrieval import NAMES
from posbench.reproduce.rescores import judged, sweep_rows

ENTRY = registry()["gelberg2025_retrieval"].cls
TASKS = ("niah_multiquery", "niah_multikey_1", "niah_multivalue")
# Gelberg et al. 2025, Table 1: success rate (%) at 2x the training context, MQ, MK, MV
TABLE1 = {"rope": (0, 0, 0), "rope_pi": (0, 0, 0), "rope_ntk": (21.1, 19.4, 16.5),
          "rope_yarn": (17.8, 0.5, 14.6), "alibi": (5.2, 0.0, 1.1), "nope": (9.2, 36.2, 21.4),
          "rnope_swa": (5.2, 25.6, 20.6), "drope": (28.0, 41.6, 23.3)}
# row -> (encoding, eval.rope_scaling, train.switch_encoding_at)
ROWS = {"rope": ("rope", "none", None), "rope_pi": ("rope", "pi", None),
        "rope_ntk": ("rope", "ntk", None), "rope_yarn": ("rope", "yarn", None),
        "alibi": ("alibi", "none", None), "nope": ("nope", "none", None),
        "rnope_swa": ("rnope_swa", "none", None), "drope": ("rope", "none", 0.875)}


def table(at_l=1.0, band=0.0, **rows):
    """Table 1 as rates at 2L, every row at `at_l` at L; a row given as (at L, (MQ, MK, MV) at 2L
    as rates) replaces the paper's; every value with a seeds' band `band`."""
    values = {}
    for row, rates in TABLE1.items():
        near, far = rows.get(row, (at_l, tuple(r / 100 for r in rates)))
        for task, value in zip(TASKS, far):
            values[task_group(task, row)] = {1.0: near, 2.0: value}
    spread = {g: {x: band for x in row} for g, row in values.items()}
    return Measured(values, at_paper_scale=False, spread=spread, score="recall")


def verdicts(measured):
    return {c.name: c.judge(measured)[0] for c in ENTRY.claims}


def test_the_entry_holds_table1():
    ENTRY.check()
    assert {r: tuple(row[c] for c in ("MQ", "MK", "MV")) for r, row in
            ENTRY.published.items()} == TABLE1
    assert set(ENTRY.groups) == {task_group(t, r) for t in TASKS for r in ROWS}


def row_overrides(row):
    """A trained row's config, or a re-scored row's source row with its eval overrides."""
    rescore = ENTRY.rescored.get(row)
    return ([f"gelberg2025_retrieval={row}"] if rescore is None
            else [f"gelberg2025_retrieval={rescore.of}", *rescore.overrides])


@pytest.mark.parametrize("row", list(ROWS))
def test_each_rows_config_composes_into_its_training_and_scoring_under_qk_norm(row):
    cfg = posbench.compose(["+experiment=gelberg2025_retrieval", *row_overrides(row)])
    assert (cfg.encoding.name, cfg.eval.rope_scaling, cfg.train.switch_encoding_at) == ROWS[row]
    assert cfg.eval.rope_scaling_factor is None  # dynamic: s = 2 at 2L, RoPE's own model at L
    assert cfg.model.qk_norm and cfg.train.switch_encoding_to == "nope"
    assert (cfg.train.seq_len, cfg.train.steps, cfg.train.ruler_mix) == (128, 12000, 0.5)
    # trained on RULER's ten default tasks (the three alone do not teach RoPE), scored on three
    assert list(cfg.train.ruler_tasks) == DEFAULT_TASKS and tuple(cfg.eval.ruler.tasks) == TASKS
    assert cfg.eval.ruler.enabled and list(cfg.eval.lengths) == [128, 256]
    assert cfg.eval.ruler.trials * len(cfg.eval.ruler.depths) == 500  # the paper's trials
    record = {"encoding": cfg.encoding.name,
              "config": {"train": {"switch_encoding_at": cfg.train.switch_encoding_at},
                         "eval": {"rope_scaling": cfg.eval.rope_scaling,
                                  "rope_scaling_factor": cfg.eval.rope_scaling_factor}}}
    assert ENTRY.group_of(record) == row


def test_the_sweep_trains_each_trained_row_once_per_seed_and_the_scalings_are_re_scores():
    assert set(ENTRY.rescored) == {r for r, (_, scaling, _) in ROWS.items() if scaling != "none"}
    jobs = Counter(sweep_rows(ENTRY, sweep_overrides(ENTRY, [])))
    assert jobs == {r: 3 for r in ROWS if r not in ENTRY.rescored}


def test_the_papers_numbers_reproduce_every_claim():
    assert set(verdicts(table()).values()) == {REPRODUCED}
    assert set(verdicts(ENTRY.paper_measured()).values()) == {REPRODUCED}


def test_numbers_that_break_a_claim_do_not_reproduce_it():
    # RoPE (and so PI, its model at L) retrieving at 2L
    found = verdicts(table(rope=(1.0, (0.3, 0.0, 0.0)), rope_pi=(1.0, (0.0, 0.2, 0.0))))
    assert found["rope_fails_at_2L"] == found["pi_fails_at_2L"] == NOT_REPRODUCED
    # NTK behind RoPE beyond the band on one task; YaRN and NoPE and RNoPE-SWA below RoPE
    found = verdicts(table(rope=(1.0, (0.3, 0.3, 0.3))))
    for name in ("ntk_above_rope_and_pi", "yarn_above_rope", "nope_above_rope",
                 "rnope_swa_above_rope", "drope_above_rope_scalings"):
        assert found[name] == NOT_REPRODUCED, name
    # ALiBi as posbench's RULER calibration measured it at 2L (docs/results.md: 0.66 on average)
    assert verdicts(table(alibi=(0.9, (0.93, 0.95, 0.0))))["alibi_fails_at_2L"] == NOT_REPRODUCED
    # DroPE behind NoPE on MK beyond the band: neither best nor tied
    found = verdicts(table(drope=(1.0, (0.28, 0.2, 0.233))))
    assert found["drope_best"] == NOT_REPRODUCED
    # and 0.2 against NTK's 0.194 on MK is inside the band: a tie, which "above" cannot read
    assert found["drope_above_rope_scalings"] == NOT_COMPARABLE


def test_a_gap_inside_the_band_is_a_tie():
    # NTK at RoPE's 0 on every task: no direction to read
    found = verdicts(table(rope_ntk=(1.0, (0.0, 0.0, 0.0))))
    assert found["ntk_above_rope_and_pi"] == NOT_COMPARABLE
    # the seeds' bands added in quadrature: DroPE's 0.069 over NTK on MQ is inside ±0.05 + 0.05√2
    found = verdicts(table(band=0.05))
    assert found["drope_above_rope_scalings"] == NOT_COMPARABLE
    assert found["drope_best"] == REPRODUCED  # best or tied: a tie holds
    detail = ENTRY.claims[-1].judge(table(band=0.05))[1]
    assert f"band ±{0.05 + math.hypot(0.05, 0.05):.3f}" in detail
    assert detail.startswith("recall at 2L: ")  # the measure's score, named
    assert ENTRY.claims[-1].judge(dataclasses.replace(table(band=0.05), score="exact match"))[
        1].startswith("exact match at 2L: ")


def test_a_row_that_did_not_learn_a_task_at_L_is_not_comparable():
    assert set(verdicts(table(at_l=0.3)).values()) == {NOT_COMPARABLE}
    # RoPE's model under the bar at L: RoPE, its scalings and every comparison with them
    found = verdicts(table(rope=(0.3, (0.0,) * 3), rope_pi=(0.3, (0.0,) * 3),
                           rope_ntk=(0.3, (0.211, 0.194, 0.165)),
                           rope_yarn=(0.3, (0.178, 0.005, 0.146))))
    for name in ("rope_fails_at_2L", "pi_fails_at_2L", "ntk_above_rope_and_pi",
                 "yarn_above_rope", "nope_above_rope", "rnope_swa_above_rope",
                 "drope_above_rope_scalings"):
        assert found[name] == NOT_COMPARABLE, name
    assert found["alibi_fails_at_2L"] == REPRODUCED
    # a rival under the bar is left out of DroPE's best and named; DroPE under it is not read
    verdict, detail = ENTRY.claims[-1].judge(table(nope=(0.3, (0.5, 0.5, 0.5))))
    assert verdict == REPRODUCED and "not learned at L, left out: nope 0.300" in detail
    verdict, detail = ENTRY.claims[-1].judge(table(drope=(0.4, (0.9, 0.9, 0.9))))
    assert verdict == NOT_COMPARABLE and "drope not learned at L (0.400 under 0.5)" in detail


def record(encoding, seed, scores, scaling="none", factor=None, at=None, **found):
    """A finished run's results.json as the measure reads it: scores task -> recall (at L, at
    2L), its exact match below it (a model that finds some of several values);
    `found`: find_runs' _dir and _file, and a re-score's `rescore`."""
    return {"encoding": encoding, "seed": seed, "train": {"seq_len": 128},
            "config": {"train": {"switch_encoding_at": at},
                       "eval": {"rope_scaling": scaling, "rope_scaling_factor": factor}},
            "eval": {"ruler": {"trials": 100, "tasks": {
                task: {"by_length": [{"length": n, "recall": v, "exact_match": v / 2,
                                      "bits_saved": bits}
                                     for n, v, bits in ((128, near, 7.0), (256, far, 1.0))]}
                for task, (near, far) in scores.items()}}}, **found}


def test_runs_are_measured_by_row_task_and_length_from_their_ruler_records():
    runs = [record("rope", 0, {t: (0.9, 0.0) for t in TASKS}, at=0.875),
            record("rope", 1, {t: (0.8, 0.2) for t in TASKS}, at=0.875),
            record("rope", 0, {t: (0.9, 0.1) for t in TASKS}, scaling="ntk"),
            record("alibi", 0, {"niah_multiquery": (1.0, 0.66)})]
    measured = ENTRY.measure(runs)
    assert measured.score == ENTRY.paper_measured().score == "recall"  # RULER's string_match_all
    assert measured.values[task_group("niah_multikey_1", "drope")] == \
        pytest.approx({1.0: 0.85, 2.0: 0.1})
    # two seeds: the 95% t-interval of their mean, t(1) x sd / sqrt(2)
    spread = measured.spread[task_group("niah_multikey_1", "drope")][2.0]
    assert spread == pytest.approx(t95(1) * statistics.stdev([0.0, 0.2]) / math.sqrt(2))
    assert measured.spread[task_group("niah_multivalue", "rope_ntk")] == {1.0: 0.0, 2.0: 0.0}
    assert measured.values[task_group("niah_multivalue", "rope_ntk")] == {1.0: 0.9, 2.0: 0.1}
    assert task_group("niah_multikey_1", "alibi") not in measured.values  # not scored there
    assert ENTRY.owns(runs) == []
    others = [record("rope", 0, {}, at=0.5), record("rope", 0, {}, scaling="yarn", factor=2.0)]
    assert ENTRY.owns(others) == ["rope_dropped_at_0.5", "rope_yarn_x2"]
    lines = "\n".join(ENTRY.tables(measured, 128))
    assert "| DroPE | 28.0 | 10.0 (85.0) | 41.6 | 10.0 (85.0) | 23.3 | 10.0 (85.0) |" in lines
    assert "| RoPE + NTK | 21.1 | 10.0 (90.0) |" in lines
    assert "| ALiBi | 5.2 | 66.0 (100.0) | 0.0 | — |" in lines
    assert "## niah_multikey_1: RULER's score by length over L" in lines


def test_the_judge_reads_the_declared_re_scores_of_the_source_rows_runs_and_only_those():
    scores = {t: (0.9, 0.0) for t in TASKS}

    def rescore(scaling, factor=None, file=None):
        changes = {"eval.rope_scaling": scaling, **({} if factor is None else
                                                    {"eval.rope_scaling_factor": factor})}
        return record("rope", 0, scores, scaling, factor, _dir="a",
                      _file=file or f"results.eval-rope_scaling-{scaling}.json",
                      rescore={"changes": changes})

    runs = [record("rope", 0, scores, _dir="a", _file="results.json"),
            rescore("pi"), rescore("ntk"),
            rescore("yarn", 2.0, "results.eval-rope_scaling-yarn_rope_scaling_factor-2.json"),
            record("nope", 0, scores, _dir="b", _file="results.json"),
            record("nope", 0, scores, "pi", _dir="b", _file="results.eval-rope_scaling-pi.json",
                   rescore={"changes": {"eval.rope_scaling": "pi"}}),
            record("rope", 0, scores, "ntk", _dir="c", _file="results.json")]
    records, plan, left_out = judged(ENTRY, runs)
    # rope's run and its two declared re-scores; YaRN at a static factor is no declared re-score,
    # NoPE's pi re-score is of no source run, and the run trained as rope_ntk is left out
    assert [(r["_dir"], r["_file"]) for r in records] == [
        ("a", "results.json"), ("b", "results.json"),
        ("a", "results.eval-rope_scaling-pi.json"), ("a", "results.eval-rope_scaling-ntk.json")]
    assert [(w.run_dir, w.row, w.found is not None) for w in plan] == [
        ("a", "rope_pi", True), ("a", "rope_ntk", True), ("a", "rope_yarn", False)]
    assert [r["_dir"] for r in left_out] == ["c"]
    assert plan[2].command() == "posbench eval a eval.rope_scaling=yarn"


def test_the_entry_dry_runs_through_the_cli(tmp_path):
    done = posbench_cli("reproduce", "gelberg2025_retrieval", "gelberg2025_retrieval=rope,drope",
                        "seed=0", "train.steps=10", "--dry-run", cwd=tmp_path, in_process=True)
    assert "posbench train -m +experiment=gelberg2025_retrieval" in done.stdout
    for row in ("rope", "drope"):
        assert f"  gelberg2025_retrieval-{row}_seed-0: " in done.stdout
    assert "2 jobs: " in done.stdout and "declared wall time: 15 trainings" in done.stdout
    # RoPE's one run, scored again for each of its three scalings
    assert "then 3 re-scores of the finished runs" in done.stdout
    assert "rope_yarn: 1 run of rope with eval.rope_scaling=yarn" in done.stdout
    assert list(tmp_path.iterdir()) == []


TOY = ("hydra/launcher=basic", "gelberg2025_retrieval=rope,nope", "seed=0", "model.n_layer=1",
       "model.d_model=32", "model.n_head=2", "train.steps=2", "train.batch_size=2",
       "train.warmup_steps=1", "train.log_every=1", "eval.ruler.trials=2", "eval.tokens=256")
RESCORES = {row: f"results.eval-rope_scaling-{scaling}.json"
            for row, (_, scaling, _) in ROWS.items() if scaling != "none"}
ROPE, NOPE = "gelberg2025_retrieval-rope_seed-0", "gelberg2025_retrieval-nope_seed-0"


@pytest.fixture(scope="module")
def toy_sweep(tmp_path_factory):
    """The entry at a toy scale through the CLI (`posbench reproduce` in this process, its
    trainings and re-scores the installed command's): RoPE and NoPE, one seed."""
    cwd = tmp_path_factory.mktemp("gelberg_retrieval")
    sweep = cwd / "sweep"
    args = ("reproduce", "gelberg2025_retrieval", *TOY, f"hydra.sweep.dir={sweep}")
    return cwd, sweep, args, posbench_cli(*args, cwd=cwd, in_process=True)


def by_row(sweep, files):
    """row -> task -> {x: RULER's score} read from each run's own file (row -> (run dir, file))."""
    out = {}
    for row, (run, name) in files.items():
        found = json.loads((sweep / run / name).read_text())["eval"]["ruler"]["tasks"]
        out[row] = {t: {p["length"] / 128: p["recall"] for p in found[t]["by_length"]}
                    for t in TASKS}
    return out


def toy_files():
    return {"rope": (ROPE, "results.json"), "nope": (NOPE, "results.json"),
            **{row: (ROPE, name) for row, name in RESCORES.items()}}


def test_the_toy_sweep_trains_the_trained_rows_and_re_scores_ropes_run(toy_sweep):
    cwd, sweep, _, done = toy_sweep
    assert sorted(p.parent.name for p in sweep.glob("*/results.json")) == [NOPE, ROPE]
    assert sorted(p.name for p in (sweep / ROPE).glob("results.eval-*.json")) == \
        sorted(RESCORES.values())
    assert not list((sweep / NOPE).glob("results.eval-*.json"))
    for row, name in RESCORES.items():
        assert f"posbench reproduce: {row}: `posbench eval {sweep / ROPE}" in done.stdout
    report = json.loads((sweep / "reproduction.json").read_text())
    assert report["rescores"] == {"written": [str(sweep / ROPE / n) for n in RESCORES.values()],
                                  "missing": [], "left_out": []}
    assert report["runs"] == [str(sweep / NOPE), str(sweep / ROPE)]
    expected = {task_group(t, row): {str(int(x)): v for x, v in points.items()}
                for row, tasks in by_row(sweep, toy_files()).items()
                for t, points in tasks.items()}
    assert report["measured"] == expected
    assert "- Runs: 2 finished and 3 re-scores in" in done.stdout
    assert not (cwd / "outputs").exists()


def test_the_table_reads_each_re_score_file_as_its_row(toy_sweep, tmp_path):
    cwd, sweep, _, _ = toy_sweep
    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy)
    # the toy model retrieves nothing: distinct rates per file show which file each row read
    for i, name in enumerate(RESCORES.values()):
        path = copy / ROPE / name
        record = json.loads(path.read_text())
        for j, task in enumerate(TASKS):
            for k, point in enumerate(record["eval"]["ruler"]["tasks"][task]["by_length"]):
                point["recall"] = round(0.1 * (i + 1) + 0.03 * j + 0.01 * k, 2)
        path.write_text(json.dumps(record))
    done = posbench_cli("reproduce", "gelberg2025_retrieval", "--report", str(copy), cwd=cwd,
                        in_process=True)
    for row, tasks in by_row(copy, toy_files()).items():
        cells = " | ".join(f"{ENTRY.published[row][c]:.1f} | {100 * tasks[t][2.0]:.1f} "
                           f"({100 * tasks[t][1.0]:.1f})"
                           for t, c in zip(TASKS, ("MQ", "MK", "MV")))
        assert f"| {NAMES[row]} | {cells} |" in done.stdout, row


def test_a_second_run_skips_the_trainings_and_the_re_scores(toy_sweep):
    cwd, sweep, args, _ = toy_sweep
    written = sorted(sweep.glob("*/results*.json"))
    before = {p: p.stat().st_mtime_ns for p in written}
    again = posbench_cli(*args, cwd=cwd, in_process=True)
    assert again.stdout.count("posbench: skipped") == 2 + len(RESCORES)
    assert "posbench reproduce: rope_" not in again.stdout  # no `posbench eval` was run
    assert {p: p.stat().st_mtime_ns for p in sorted(sweep.glob("*/results*.json"))} == before


def test_a_failed_re_score_is_named_and_its_row_judged_without_it(toy_sweep, tmp_path):
    cwd, sweep, _, _ = toy_sweep
    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy)
    (copy / ROPE / RESCORES["rope_yarn"]).unlink()
    (copy / ROPE / "checkpoint.pt").unlink()  # `posbench eval` refuses the run: nothing to score
    # a re-score the entry does not declare, as `posbench eval RUN eval.rope_scaling=pi
    # eval.rope_scaling_factor=2` writes it, is not read
    stray = json.loads((copy / ROPE / RESCORES["rope_pi"]).read_text())
    stray["config"]["eval"]["rope_scaling_factor"] = 2.0
    stray["rescore"]["changes"]["eval.rope_scaling_factor"] = 2.0
    for task in stray["eval"]["ruler"]["tasks"].values():
        for point in task["by_length"]:
            point["recall"] = 0.5
    (copy / ROPE / "results.eval-rope_scaling-pi_rope_scaling_factor-2.json").write_text(
        json.dumps(stray))
    done = posbench_cli("reproduce", "gelberg2025_retrieval", *TOY, f"hydra.sweep.dir={copy}",
                        cwd=cwd, ok=False, in_process=True)
    assert done.returncode == 2 and f"RUN_DIR='{copy / ROPE}' is not accepted" in done.stderr
    report = json.loads((copy / "reproduction.json").read_text())
    assert report["rescores"]["missing"] == [
        f"posbench eval {copy / ROPE} eval.rope_scaling=yarn"]
    assert f"- Missing re-scores (their rows are judged without them; `posbench reproduce " \
           f"gelberg2025_retrieval` on this folder runs them): rope_yarn of {copy / ROPE}." \
        in done.stdout
    first = json.loads((sweep / "reproduction.json").read_text())["measured"]
    assert report["measured"] == {g: v for g, v in first.items() if not g.endswith("/rope_yarn")}
    assert "| RoPE + YaRN | 17.8 | — |" in done.stdout
