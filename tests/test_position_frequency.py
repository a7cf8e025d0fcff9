"""STRING's position frequency f(i) (posbench/reports/position_frequency.py): against pairs
enumerated one by one, over a tiny dataset and over the batches, segments and positions that real
runs trained on (fixed windows, SkyLadder's schedule, packed documents, PoSE, and their
combinations); a packed run's count of segments across a resume; the report's drawing."""
import csv
import itertools
import json
from collections import Counter

import numpy as np
import pytest

import posbench
import posbench.runs.run
import posbench.runs.train
from posbench.data.tokens import TokenData
from posbench.reports.position_frequency import PLOT, TABLE, frequency
from posbench.reports.report import write_report
from posbench.runs.lengths import window_at, window_steps
from posbench.runs.run import RunFailed, train
from helpers import killed_in_step


def enumerated(rows):
    """Pairs (query q, key k <= q) of each row, one by one, counted at the distance between their
    positions (None: 0..n-1); `segments` (None: no cut) keep a pair only inside one segment. Up to
    the longest distance counted."""
    counts = Counter()
    for tokens, segments, positions in rows:
        positions = positions or range(tokens)
        for k, q in itertools.combinations_with_replacement(range(tokens), 2):
            if segments is None or segments[q] == segments[k]:
                counts[positions[q] - positions[k]] += 1
    return [counts[i] for i in range(max(counts) + 1)]


def test_f_counts_every_causal_pair_of_a_tiny_dataset():
    lengths = [3, 5, 1, 5, 2]
    record = {"train": {"seq_len": 5, "steps": 1,
                        "segment_lengths": {str(n): c for n, c in Counter(lengths).items()}},
              "config": {"seed": 0, "train": {"seq_len": 5, "batch_size": 1,
                                              "pack_documents": True}}}
    assert frequency(record) == enumerated([(n, None, None) for n in lengths])


@pytest.mark.parametrize("steps", [0, 1, 5, 700, 767, 768, 769, 5000])
def test_the_windows_are_counted_per_window_as_the_steps_take_them(steps):
    t = posbench.compose(["train.seq_len=128", "train.length_schedule=skyladder"]).train
    taken = [window_at(s, t) for s in range(steps)]
    counted = window_steps(steps, t)
    assert counted == Counter(taken) and list(counted) == sorted(set(taken))


RUN = ["encoding=rope", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
       "train.seq_len=16", "train.batch_size=3", "train.steps=4", "train.warmup_steps=1",
       "train.log_every=2", "train.ckpt_every=0", "train.val_every=0", "eval.lengths=[32]",
       "eval.tokens=64", "device=cpu"]
# the window grows from 5 tokens by one a step and reaches L = 16 at step 11
LADDER = ["train.steps=13", "train.length_schedule=skyladder", "train.length_start=5",
          "train.length_every=1"]
PACKED = ["train.pack_documents=true"]
POSE = ["train.pose_span=40"]


def short_documents(dataset_cfg):
    """Training documents of 1 to 24 tokens, so that packed rows of 16 hold several; one long
    validation document."""
    rng = np.random.default_rng(0)
    lengths = np.r_[rng.integers(1, 25, size=300), 4000]
    offsets = np.r_[0, np.cumsum(lengths)]
    return TokenData(rng.integers(0, 64, size=offsets[-1]), offsets[:-1], offsets[-2:],
                     vocab_size=64, fingerprint="sha256:short", name="short documents")


def recording(monkeypatch):
    """The rows train_step is given, (tokens, segments, positions) each, as lists; training on
    short_documents."""
    monkeypatch.setattr(posbench.runs.run, "prepare", short_documents)
    real, rows = posbench.runs.train.train_step, []

    def record(model, step_fn, optimizer, x, y, lr, grad_clip, pos=None, segments=None):
        rows.extend((x.shape[1], None if segments is None else segments[b].tolist(),
                     None if pos is None else pos[b].tolist()) for b in range(x.shape[0]))
        return real(model, step_fn, optimizer, x, y, lr, grad_clip, pos, segments)

    monkeypatch.setattr(posbench.runs.train, "train_step", record)
    return rows


def run(tmp_path, name, *overrides):
    cfg = posbench.compose([*RUN, *overrides])
    posbench.config.check(cfg)
    return train(cfg, tmp_path / name, group="test", name=name)


@pytest.mark.parametrize("overrides", [[], LADDER, PACKED, [*LADDER, *PACKED], POSE,
                                       [*LADDER, *POSE]],
                         ids=["windows", "skyladder", "packed", "skyladder+packed", "pose",
                              "skyladder+pose"])
def test_a_runs_f_is_the_pairs_of_the_batches_it_trained_on(tmp_path, monkeypatch, overrides):
    rows = recording(monkeypatch)
    record = run(tmp_path, "run", *overrides)
    assert len(rows) == record["train"]["steps"] * 3
    assert frequency(record) == enumerated(rows)
    cut = any(segments is not None and len(set(segments)) > 1 for _, segments, _ in rows)
    skipped = any(positions is not None and positions[-1] > 15 for *_, positions in rows)
    # each case trains what it names: cut rows, and positions past L under PoSE
    assert cut == (overrides not in ([], POSE)) and skipped == ("train.pose_span=40" in overrides)
    assert ("segment_lengths" in record["train"]) == ("train.pack_documents=true" in overrides)


def test_a_packed_run_killed_and_resumed_counts_its_segments_as_an_uninterrupted_one(
        tmp_path, monkeypatch):
    options = [*LADDER, *PACKED, "train.ckpt_every=2"]
    rows = recording(monkeypatch)
    whole = run(tmp_path, "whole", *options)
    recorded = killed_in_step(monkeypatch, 4)  # the third step counted, not saved
    with pytest.raises(RunFailed, match="checkpoint at step 2"):
        run(tmp_path, "resumed", *options)
    monkeypatch.setattr(posbench.runs.train, "train_step", recorded)
    resumed = run(tmp_path, "resumed", *options)
    assert resumed["train"]["resumed_from_step"] == 2
    assert resumed["train"]["segment_lengths"] == whole["train"]["segment_lengths"]
    assert frequency(resumed) == enumerated(rows[:13 * 3])  # the uninterrupted run's batches


def record(name, seed, steps=10, **train):
    """results.json of a run at L = 8 with train.batch_size=2, written by hand."""
    return {"encoding": name, "seed": seed, "status": "ok",
            "train": {"seq_len": 8, "steps": steps,
                      **({"segment_lengths": train.pop("segment_lengths")}
                         if "segment_lengths" in train else {})},
            "eval": {"protocol": "nonoverlapping",
                     "curve": [{"length": n, "loss": 1.0 + n / 64, "ppl": 2.7 + n / 16}
                               for n in (8, 16, 32)]},
            "config": {"encoding": {"name": name}, "seed": seed,
                       "train": {"seq_len": 8, "batch_size": 2, **train}}}


def test_the_report_draws_f_beside_the_curves_and_names_the_runs_it_cannot_derive(tmp_path):
    ladder = {"length_schedule": "skyladder", "length_start": 5, "length_every": 2}
    packed = {"pack_documents": True, "segment_lengths": {"8": 12, "3": 4, "5": 4}}
    for name, rec in [("rope", record("rope", 0)), ("alibi", record("alibi", 0, steps=5)),
                      ("t5", record("t5", 0, **ladder)), ("fire", record("fire", 0, **packed)),
                      ("nope", record("nope", 0, pack_documents=True))]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(rec))
    write_report(tmp_path)
    assert (tmp_path / PLOT).stat().st_size > 0
    by_label = {}
    for row in csv.DictReader(open(tmp_path / TABLE)):
        by_label.setdefault(row["label"].split()[0], []).append(int(row["pairs"]))
    # SkyLadder's published windows w(t) = min(L, 5 + floor(t / 2)), each row cut into them
    windows = [min(8, 5 + t // 2) for t in range(10)]
    cut = [(8, [i // w for i in range(8)], None) for w in windows for _ in range(2)]
    # packed windows of L = 8: N (L - i), N = steps x batch
    assert by_label == {"rope": [20 * (8 - i) for i in range(8)],
                        "alibi": [10 * (8 - i) for i in range(8)],
                        "t5": enumerated(cut),
                        "fire": enumerated([(n, None, None) for n in [8] * 12 + [3, 5] * 4])}
    summary = (tmp_path / "summary.md").read_text()
    left_out = summary.split(f"({PLOT}) not drawn for:")[1].strip().splitlines()
    assert len(left_out) == 1 and left_out[0].startswith("- nope [")
    assert ("pack_documents=true]: train.pack_documents=True: results.json holds no "
            "train.segment_lengths") in left_out[0]
