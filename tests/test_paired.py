"""Paired comparisons (posbench/reports/paired.py): the estimate against its formula computed
here in float64, the bootstrap interval against the normal approximation it must approach, and
what may not be paired."""
import math

import numpy as np
import pytest

from posbench.reports.paired import paired, report_lines


def run(seed, losses, length=128, tokens=None, fingerprint="sha256:a", per_length=None):
    losses = np.asarray(losses, dtype=float)
    tokens = np.full(len(losses), 128) if tokens is None else np.asarray(tokens)
    mean = float((losses * tokens).sum() / tokens.sum())
    points = [{"length": length, "loss": mean, "ppl": math.exp(mean),
               "windows": {"loss": losses.tolist(), "tokens": tokens.tolist()}}]
    return {"seed": seed, "dataset": {"fingerprint": fingerprint},
            "eval": {"protocol": "nonoverlapping", "tokens_per_length": 16384, "stride": None,
                     "curve": points + (per_length or [])}}


def test_the_estimate_is_the_token_weighted_mean_difference_over_shared_seeds():
    rng = np.random.default_rng(1)
    tokens = rng.integers(5, 40, 50)
    a = {s: rng.normal(2.0, 0.3, 50) for s in range(3)}
    b = {s: rng.normal(1.9, 0.3, 50) for s in range(4)}  # seed 3 has no partner: left out
    got = paired([run(s, a[s], tokens=tokens) for s in a],
                 [run(s, b[s], tokens=tokens) for s in b], 128)
    want = sum(((a[s] - b[s]) * tokens).sum() for s in range(3)) / (3 * tokens.sum())
    assert got.seeds == 3 and got.windows == 50
    assert math.isclose(got.ratio, math.exp(want), rel_tol=1e-12)
    assert got.low < got.ratio < got.high


def test_a_constant_difference_has_a_zero_width_interval():
    base = np.linspace(1, 3, 40)
    got = paired([run(s, base + 0.05) for s in (0, 1)], [run(s, base) for s in (0, 1)], 128)
    for value in (got.ratio, got.low, got.high):
        assert math.isclose(value, math.exp(0.05), rel_tol=1e-12)
    assert got.significant and got.cell().endswith("*")


def test_over_windows_alone_the_interval_is_the_normal_one():
    """One seed: a percentile bootstrap of a mean over 4000 windows approaches mean ± 1.96 se."""
    rng = np.random.default_rng(2)
    diff = rng.normal(0.01, 0.2, 4000)
    got = paired([run(0, 2.0 + diff)], [run(0, np.full(4000, 2.0))], 128)
    se = diff.std(ddof=1) / math.sqrt(len(diff))
    assert math.isclose(math.log(got.low), diff.mean() - 1.96 * se, abs_tol=0.15 * se * 1.96)
    assert math.isclose(math.log(got.high), diff.mean() + 1.96 * se, abs_tol=0.15 * se * 1.96)


def test_seeds_that_disagree_make_a_tie_however_many_windows_agree():
    base = np.linspace(1, 3, 500)
    a = [run(0, base + 0.03), run(1, base - 0.03), run(2, base + 0.03), run(3, base - 0.03)]
    got = paired(a, [run(s, base) for s in range(4)], 128)
    assert not got.significant and got.low < 1 < got.high
    assert not got.cell().endswith("*")


@pytest.mark.parametrize("other", [
    run(1, [1.0] * 4),  # no shared seed
    run(0, [1.0] * 5),  # other windows
    run(0, [1.0] * 4, fingerprint="sha256:b"),  # other data
    run(0, [1.0] * 4, length=256),  # not scored at 128
])
def test_what_cannot_be_paired_is_none(other):
    assert paired([run(0, [1.1] * 4)], [other], 128) is None


def test_runs_without_per_window_losses_are_not_paired():
    old = run(0, [1.0] * 4)
    del old["eval"]["curve"][0]["windows"]
    assert paired([run(0, [1.1] * 4)], [old], 128) is None


def test_the_report_table_names_each_groups_reference_and_marks_the_significant():
    base = np.linspace(1, 3, 100)
    groups = {"alibi": [run(s, base + 0.02) for s in (0, 1)],
              "rope": [run(s, base) for s in (0, 1)],
              "t5": [run(0, base + 0.05), run(1, base - 0.05)]}
    lines = report_lines(groups, {"alibi": "rope", "rope": "rope", "t5": "rope"})
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
    assert set(rows) == {"group", "alibi", "t5"}
    assert rows["alibi"].startswith("| alibi | rope | +2.0% [+2.0%, +2.0%]*")
    assert "*" not in rows["t5"]
    assert report_lines({"rope": groups["rope"]}, {"rope": "rope"}) == []
