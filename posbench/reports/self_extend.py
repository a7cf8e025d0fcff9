"""Self-Extend's group size G and neighbour window W chosen per length. LongLM's README (section
"How to choose the group_size and neighbor_window") leaves the choice to a search on a
representative task; posbench's is a Hydra sweep of re-scores,

    posbench eval RUN_DIR -m eval.rope_scaling=self_extend eval.rope_scaling_factor=2,4,8 \
        eval.rope_window=8,16,24

and this section of the report: for each trained group whose self_extend re-scores cover two
(G, W) pairs or more under otherwise equal eval keys (a grid), the grid's perplexity by length
(mean over the seeds), the pair with the lowest perplexity at each length, and plain RoPE beside
them. The same rows go to self_extend_grid.csv.
"""
from __future__ import annotations

import csv
import io
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from posbench.config import flatten
from posbench.core.io import write_text

CSV = "self_extend_grid.csv"
SWEPT = ("eval.rope_scaling_factor", "eval.rope_window")  # the grid's axes


def pair(record: dict) -> Tuple[Optional[int], int]:
    """(G, W) in effect, defaults filled in (results.json's eval.rope_remap); G None: the
    smallest that fits each length."""
    remap = record["eval"]["rope_remap"]
    return (None if remap["factor"] is None else int(remap["factor"])), remap["window"]


def grids(groups: Dict[str, List[dict]],
          base_of: Dict[str, str]) -> Dict[Tuple[str, str], Dict[Tuple[Optional[int], int], str]]:
    """(trained group, the grid's other eval keys) -> (G, W) -> the re-score group's label, for
    the grids of two pairs or more."""
    found: Dict[Tuple[str, str], Dict[Tuple[Optional[int], int], str]] = defaultdict(dict)
    for label, members in groups.items():
        record = members[0]
        if label not in base_of or record["eval"].get("rope_scaling") != "self_extend":
            continue
        rest = {k: v for k, v in flatten(record["config"]["eval"], "eval.").items()
                if k not in SWEPT}
        found[base_of[label], repr(sorted(rest.items()))][pair(record)] = label
    return {key: cells for key, cells in found.items() if len(cells) > 1}


def g_text(g: Optional[int]) -> str:
    return "dynamic" if g is None else str(g)


def report_lines(groups: Dict[str, List[dict]], base_of: Dict[str, str],
                 ppl: Dict[str, Dict[int, dict]], path: Path) -> List[str]:
    """summary.md's section on Self-Extend grids, and their rows in `path` (CSV); nothing
    without a grid. `ppl`: label -> length -> {mean, n, ...} (report.aggregate)."""
    found = grids(groups, base_of)
    if not found:
        return []
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["group", "group_size", "window", "length", "ppl_mean", "seeds", "best",
                     "plain_rope_ppl"])
    lines = ["", "Self-Extend's (G, W) by length: each grid of self_extend re-scores of a group "
             "(`posbench eval RUN -m eval.rope_scaling=self_extend eval.rope_scaling_factor=... "
             "eval.rope_window=...`), perplexity by length, mean over seeds, the lowest of each "
             "length in bold, and plain RoPE (the group itself) beside them. The pair is chosen "
             "on the windows these perplexities score, so its value is the grid's best, not a "
             f"held-out estimate. Rows in {CSV}."]
    for (base, _), cells in sorted(found.items()):
        lengths = sorted({n for label in cells.values() for n in ppl.get(label, {})})
        mean = {(p, n): ppl[label][n]["mean"] for p, label in cells.items()
                for n in lengths if n in ppl.get(label, {})}
        best = {n: min((p for p in cells if (p, n) in mean), key=lambda p: mean[p, n])
                for n in lengths}
        plain = {n: ppl.get(base, {}).get(n, {}).get("mean") for n in lengths}
        seeds = sorted({r.get("seed") for label in cells.values() for r in groups[label]},
                       key=str)
        lines += ["", f"**{base}** ({len(cells)} pairs, seeds {', '.join(map(str, seeds))}):",
                  "", "| G | W | " + " | ".join(map(str, lengths)) + " |",
                  "|---:|---:|" + "---:|" * len(lengths)]
        order = sorted(cells, key=lambda p: (p[0] is None, p[0] or 0, p[1]))
        for p in order:
            row = [f"**{mean[p, n]:.3f}**" if best[n] == p else f"{mean[p, n]:.3f}"
                   if (p, n) in mean else "—" for n in lengths]
            lines.append(f"| {g_text(p[0])} | {p[1]} | " + " | ".join(row) + " |")
            for n in lengths:
                if (p, n) in mean:
                    writer.writerow([base, g_text(p[0]), p[1], n, f"{mean[p, n]:.6g}",
                                     ppl[cells[p]][n]["n"], int(best[n] == p),
                                     "" if plain[n] is None else f"{plain[n]:.6g}"])
        lines.append("| plain RoPE | | " + " | ".join(
            "—" if plain[n] is None else f"{plain[n]:.3f}" for n in lengths) + " |")
        lines += ["", "Best (G, W) per length: " + "; ".join(
            f"{n}: G={g_text(best[n][0])}, W={best[n][1]}" for n in lengths) + "."]
    write_text(path, out.getvalue())
    return lines
