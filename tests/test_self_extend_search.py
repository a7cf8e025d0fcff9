"""Self-Extend's (G, W) chosen per length from a grid of re-scores (posbench/reports/
self_extend.py): the grid's table and self_extend_grid.csv hold each pair's perplexity as its
re-scores recorded it (mean over seeds), and the best pair of each length is the argmin the test
takes itself over those records."""
import csv
import json
import math

from helpers import run_in_process
from posbench.reports.report import write_report
from posbench.reports.self_extend import CSV


def write_records(root, seed, grid, plain, lengths=(32, 128), tokens=256):
    """A run (plain RoPE's ppl by length) and a self_extend re-score per (G, W) of `grid`,
    {(G, W): ppls by length}."""
    run = root / f"rope_seed{seed}"
    run.mkdir(parents=True, exist_ok=True)
    config = {"encoding": {"name": "rope"}, "seed": seed, "train": {"seq_len": 32},
              "eval": {"rope_scaling": "none", "rope_scaling_factor": None, "rope_window": None,
                       "lengths": list(lengths), "tokens": tokens}}

    def record(ppls, eval_keys, remap=None):
        curve = [{"length": n, "loss": math.log(p), "ppl": p} for n, p in zip(lengths, ppls)]
        return {"encoding": "rope", "seed": seed, "status": "ok", "train": {"seq_len": 32},
                "eval": {"protocol": "nonoverlapping", "curve": curve,
                         "rope_scaling": eval_keys["rope_scaling"], "rope_remap": remap},
                "config": {**config, "eval": eval_keys}}

    (run / "results.json").write_text(json.dumps(record(plain, config["eval"])))
    for (g, w), ppls in grid.items():
        keys = {**config["eval"], "rope_scaling": "self_extend", "rope_scaling_factor": g,
                "rope_window": w}
        changes = {k: v for k, v in keys.items() if config["eval"][k] != v}
        rescore = record(ppls, keys, {"near": w, "window": w, "shift": None, "factor": g})
        rescore["rescore"] = {"tag": f"g{g}_w{w}", "label": ", ".join(
            f"{k}={v}" for k, v in changes.items()), "changes": changes}
        (run / f"results.eval-g{g}_w{w}.json").write_text(json.dumps(rescore))


def grid_rows(root):
    with open(root / CSV) as f:
        return {(r["group_size"], int(r["window"]), int(r["length"])): r
                for r in csv.DictReader(f)}


def test_the_best_pair_per_length_is_the_lowest_mean_over_seeds(tmp_path):
    grids = {0: {(2, 8): (3.0, 9.0), (4, 8): (3.4, 5.0), (None, 16): (3.1, 7.0)},
             1: {(2, 8): (3.2, 8.0), (4, 8): (3.3, 6.0), (None, 16): (2.9, 7.5)}}
    for seed, grid in grids.items():
        write_records(tmp_path, seed, grid, plain=(3.0 + seed / 10, 40.0))
    write_report(tmp_path)
    rows = grid_rows(tmp_path)
    for (g, w) in grids[0]:
        for i, n in enumerate((32, 128)):
            row = rows["dynamic" if g is None else str(g), w, n]
            mean = (grids[0][g, w][i] + grids[1][g, w][i]) / 2
            assert float(row["ppl_mean"]) == float(f"{mean:.6g}") and row["seeds"] == "2"
            best = min(grids[0], key=lambda p: grids[0][p][i] + grids[1][p][i])
            assert row["best"] == str(int(best == (g, w)))
    assert float(rows["4", 8, 128]["plain_rope_ppl"]) == 40.0
    text = (tmp_path / "summary.md").read_text()
    # at 32: (G dynamic, W 16) 3.0 against 3.1 and 3.35; at 128: (4, 8) 5.5 against 8.5 and 7.25
    assert "Best (G, W) per length: 32: G=dynamic, W=16; 128: G=4, W=8." in text
    assert "| 4 | 8 | 3.350 | **5.500** |" in text and "seeds 0, 1" in text


def test_grids_of_other_eval_keys_are_chosen_apart_and_one_pair_is_no_grid(tmp_path):
    write_records(tmp_path / "a", 0, {(2, 8): (3.0, 9.0), (4, 8): (3.5, 5.0)}, (3.0, 40.0))
    write_records(tmp_path / "b", 0, {(2, 8): (3.0, 4.0), (4, 8): (3.5, 5.0)}, (3.0, 40.0),
                  tokens=512)
    write_report(tmp_path)
    text = (tmp_path / "summary.md").read_text()
    assert text.count("Best (G, W) per length") == 2
    assert "128: G=4, W=8." in text and "128: G=2, W=8." in text
    alone = tmp_path / "alone"
    write_records(alone, 0, {(2, 8): (3.0, 9.0)}, (3.0, 40.0))
    write_report(alone)
    assert "Self-Extend" not in (alone / "summary.md").read_text()
    assert not (alone / CSV).exists()


def test_a_grid_swept_with_posbench_eval_is_reported_from_its_rescores(toy_run_copy,
                                                                        monkeypatch, capsys):
    run = toy_run_copy  # L = 32, scored at 32 and 64
    proc = run_in_process(["eval", str(run), "-m", "eval.rope_scaling=self_extend",
                           "eval.rope_scaling_factor=2,4", "eval.rope_window=4,8"],
                          monkeypatch, capsys)
    assert proc.returncode == 0, proc.stderr
    ppl = {}
    for path in run.glob("results.eval-*.json"):
        record = json.loads(path.read_text())
        remap = record["eval"]["rope_remap"]
        for point in record["eval"]["curve"]:
            ppl[str(int(remap["factor"])), remap["window"], point["length"]] = point["ppl"]
    assert len(ppl) == 8 and len(set(ppl.values())) == 8  # every pair scores differently
    write_report(run)
    rows = grid_rows(run)
    assert rows.keys() == ppl.keys()
    for key, row in rows.items():
        assert float(row["ppl_mean"]) == float(f"{ppl[key]:.6g}")
    for n in (32, 64):
        best = min((k for k in ppl if k[2] == n), key=ppl.get)
        assert [k for k, row in rows.items() if row["best"] == "1" and k[2] == n] == [best]
