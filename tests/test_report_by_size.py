"""A sweep over model sizes: parity judged within each size, each encoding's series across the
sizes in summary.md, and by_size.png; from results.json files written here (no training)."""
import math

import pytest

from posbench.reports.report import write_report
from test_report import run_record, summary_rows, write

# (encoding, d_model) -> ppl at L (32) per seed; the ppl at 4L is twice it for rope, equal for
# alibi. At 64 wide rope is best, at 128 wide alibi: a gap taken across the sizes would judge
# every small model against the large alibi.
PPL = {("rope", 64): [6.0, 6.2], ("alibi", 64): [6.6, 6.6], ("rope", 128): [4.4, 4.4],
       ("alibi", 128): [4.0, 4.2]}
PARAMS = {64: 214_000, 128: 822_000}


def write_ladder(root):
    for (name, width), ppls in PPL.items():
        for seed, ppl in enumerate(ppls):
            far = 2 * ppl if name == "rope" else ppl
            record = run_record(name, seed, {32: ppl, 128: far}, model={"d_model": width})
            record["model"] = {"n_layer": 4, "n_head": 4, "d_model": width,
                               "params": PARAMS[width] + (name == "rope")}
            write(root, f"{name}-{width}-{seed}", record)


@pytest.mark.figures  # it reads the PNG
def test_parity_is_judged_within_each_model_size_and_the_series_are_tabled(tmp_path):
    write_ladder(tmp_path)
    parity = write_report(tmp_path)
    means = {key: sum(v) / len(v) for key, v in PPL.items()}
    for (name, width), mean in means.items():
        best = min(means[(other, width)] for other in ("rope", "alibi"))
        label = f"{name} [d_model={width}]"
        assert parity[label]["gap"] == pytest.approx(mean / best - 1, abs=1e-12)
        row = summary_rows(tmp_path)[(label, 32)]
        assert float(row["train_length_gap"]) == pytest.approx(mean / best - 1, rel=1e-5)
    summary = (tmp_path / "summary.md").read_text()
    assert "relative to the best trained group at that length and model size" in summary
    # the series table: one row per encoding, a column per size named by its fewest parameters
    lines = summary.splitlines()
    start = lines.index("| series | 214K | 822K |")
    rows = {line.split(" | ")[0][2:]: line for line in lines[start + 2:start + 4]}
    gap = means[("alibi", 64)] / means[("rope", 64)] - 1
    assert rows["alibi"] == (f"| alibi | {means[('alibi', 64)]:.3f} (+{gap:.1%}) | "
                             f"{means[('alibi', 128)]:.3f} (+0.0% ± "
                             f"{parity['alibi [d_model=128]']['gap_ci95']:.1%}) |")
    ratios = lines[lines.index("| series | 214K | 822K |", start + 1) + 2:][:2]
    assert ratios == ["| rope | 2.00 | 2.00 |", "| alibi | 1.00 | 1.00 |"] or \
        ratios == ["| alibi | 1.00 | 1.00 |", "| rope | 2.00 | 2.00 |"]
    assert (tmp_path / "by_size.png").stat().st_size > 10_000
    assert "by_size.png" in (tmp_path / "report.html").read_text()


def test_one_size_has_no_section_by_size(tmp_path):
    for seed, name in enumerate(("rope", "alibi")):
        record = run_record(name, 0, {32: 4.0 + seed, 128: 8.0})
        record["model"] = {"n_layer": 4, "n_head": 4, "d_model": 128, "params": 822_000}
        write(tmp_path, name, record)
    write_report(tmp_path)
    assert "By model size" not in (tmp_path / "summary.md").read_text()
    assert not (tmp_path / "by_size.png").exists()
    assert math.isclose(float(summary_rows(tmp_path)[("alibi", 32)]["train_length_gap"]), 0.25)
