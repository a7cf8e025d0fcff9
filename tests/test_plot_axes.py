"""Axes of the perplexity and step plots, read from matplotlib's Axes (not pixels): a log
perplexity axis labelled with plain numbers across the data, whole fine-tuning steps, and inspect
panels whose titles clear the panel above; per-position plots at plain powers of two."""
import re

import pytest
from matplotlib.collections import PathCollection
from matplotlib.colors import to_rgb

import posbench.core.plots as plots
import posbench.reports.inspect as inspect
import posbench.runs.extend as extend

LO, HI = 8.2, 18.5  # the quick preset's sweep: curves from 8 to 18.5


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plotting functions would write, drawn instead."""
    figures = []

    def keep(plt, fig, path):
        fig.canvas.draw()
        figures.append(fig)

    for module in (plots, extend, inspect):
        monkeypatch.setattr(module, "save_figure", keep)
    return figures


def labels(axis):
    return [t.get_text() for t in axis.get_ticklabels() + axis.get_ticklabels(minor=True)
            if t.get_text()]


def assert_plain_log_ppl(ax):
    texts = labels(ax.yaxis)
    assert not [t for t in texts if re.search(r"\^|×|e[+-]|\$", t)], texts
    values = sorted(float(t) for t in texts)
    assert len(values) >= 3, texts
    # the labels reach both ends of the data: none leaves a third of its range unlabelled
    assert values[0] <= LO * 1.25 and values[-1] >= HI / 1.25, texts


def test_the_report_labels_its_log_ppl_axis_across_the_data(tmp_path, drawn):
    series = {"rope": [(32, LO, None), (64, 11.0, None), (128, HI, None)],
              "alibi": [(32, 8.4, None), (64, 9.0, None), (128, 9.5, None)]}
    plots.plot_curves(series, 32, tmp_path / "ppl_vs_length.png")
    assert_plain_log_ppl(drawn[0].axes[0])


def test_each_seeds_point_is_drawn_in_its_groups_colour(tmp_path, drawn):
    series = {"rope": [(32, 9.0, 0.5), (64, 12.0, 1.0)], "alibi": [(32, 9.5, None)]}
    seeds = {"rope": [(32, 8.8), (32, 9.2), (64, 11.5), (64, 12.5)]}
    plots.plot_curves(series, 32, tmp_path / "ppl_vs_length.png", seeds=seeds)
    ax = drawn[0].axes[0]
    (dots,) = [c for c in ax.collections if isinstance(c, PathCollection)]
    line = next(line for line in ax.get_lines() if line.get_label().startswith("rope"))
    assert sorted(map(tuple, dots.get_offsets().tolist())) == sorted(map(tuple, seeds["rope"]))
    assert tuple(dots.get_edgecolor()[0][:3]) == pytest.approx(to_rgb(line.get_color()))


@pytest.mark.parametrize("lo,hi", [(8, 18.5), (1, 10), (20, 200), (3, 1000), (126, 161)])
def test_log_ticks_span_the_range(lo, hi):
    ticks = plots.log_ticks(lo, hi)
    assert 3 <= len(ticks) <= 8 and all(lo <= t <= hi for t in ticks)
    assert ticks[0] <= lo * (hi / lo) ** 0.5 <= ticks[-1]


def test_per_position_positions_are_plain_powers_of_two_across_the_windows(tmp_path, drawn):
    bins = {"start": [0, 2, 6, 14, 30], "end": [2, 6, 14, 30, 62],
            "loss": [3.0, 2.0, 1.5, 1.4, 2.5]}
    plots.plot_per_position([{"length": 62, "per_position": bins}], 32, tmp_path / "pp.png")
    ticks = labels(drawn[0].axes[0].xaxis)
    # the bins' midpoints run from 1.5 to 46.5: every power of two between, written plainly
    assert ticks == ["2", "4", "8", "16", "32"], ticks


def test_eval_vs_step_has_whole_steps_and_plain_log_ppl(tmp_path, drawn):
    rows = [(step, length, ppl + length / 64 - 1)
            for step, ppl in zip((0, 1, 2, 3), (HI, 12, 10, LO)) for length in (32, 64)]
    curve = tmp_path / extend.CURVE
    curve.write_text(",".join(extend.COLUMNS) + "\n"
                     + "".join(f"{s},{n},{0.0},{p},,\n" for s, n, p in rows))
    cfg = {"train": {"seq_len": 64}, "encoding": {"name": "rope"}}
    # as a run resumed at step 3 finds its curve; close() needs no model
    extend.StepCurve(extend.OmegaConf.create(cfg), None, tmp_path, first=3).close()
    run = {"_dir": str(tmp_path), "_file": extend.RESULTS, "seed": 0, "config": cfg}
    assert extend.plot_sweep([run], {0: "rope"}, tmp_path / "sweep.png")
    for fig in drawn:
        ax = fig.axes[0]
        assert_plain_log_ppl(ax)
        steps = labels(ax.xaxis)
        assert steps and all(re.fullmatch(r"−?\d+", t) for t in steps), steps


def test_inspect_titles_clear_the_panel_above(tmp_path, drawn):
    bins = inspect.lag_bins(128)
    mass = [[[1 / len(bins)] * len(bins)] * 2] * 3  # 3 layers, 2 heads
    summary = {"lag_bins": bins, "lengths": [
        {"length": n, "mass": mass, "mass_beyond_train_len": [[0.1] * 2] * 3 if n > 33 else None}
        for n in (32, 128)]}
    inspect.plot_attention(summary, 32, tmp_path / "inspect_attention.png")
    fig = drawn[0]
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        title = ax.title.get_window_extent(renderer)
        for other in fig.axes:
            if other is ax:
                continue
            texts = (other.get_xticklabels() + other.get_yticklabels()
                     + [other.xaxis.label, other.yaxis.label])
            for text in texts:
                if text.get_text():
                    assert not title.overlaps(text.get_window_extent(renderer)), \
                        (ax.get_title(), text.get_text())
    # the lags at the bins' starts, written plainly; the 32-token column reaches the bin of 16
    assert labels(fig.axes[0].xaxis) == ["0", "1", "2", "4", "8", "16"]
    assert labels(fig.axes[1].xaxis) == ["0", "1", "2", "4", "8", "16", "32", "64"]
