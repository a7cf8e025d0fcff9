"""STRING's position frequency f(i) (posbench/reports/position_frequency.py): against pairs
enumerated one by one, over a tiny dataset and over the batches a real run trained on."""
import csv
import itertools
import json
from collections import Counter

import posbench
import posbench.runs.train
from posbench.reports.position_frequency import PLOT, TABLE, pair_frequency, trained_sequences
from posbench.reports.report import write_report
from posbench.runs.run import train


def enumerated(rows, longest):
    """Pairs (query q, key k <= q) of each row at each distance q - k, one by one; `segments`
    (one label per token, or None) keep a pair only inside one segment."""
    counts = [0] * longest
    for tokens, segments in rows:
        for k, q in itertools.combinations_with_replacement(range(tokens), 2):
            if segments is None or segments[q] == segments[k]:
                counts[q - k] += 1
    return counts


def test_pair_frequency_counts_every_causal_pair_of_a_tiny_dataset():
    lengths = [3, 5, 1, 5, 2]
    assert pair_frequency(Counter(lengths)) == enumerated([(n, None) for n in lengths], 5)
    # past the longest sequence no pair was trained
    assert pair_frequency(Counter(lengths), 8)[5:] == [0, 0, 0]


RUN = ["encoding=rope", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
       "train.seq_len=16", "train.batch_size=3", "train.steps=4", "train.warmup_steps=1",
       "train.log_every=2", "train.ckpt_every=0", "train.val_every=0", "eval.lengths=[32]",
       "eval.tokens=64", "device=cpu"]


def test_a_runs_f_is_the_pairs_of_the_batches_it_trained_on(tmp_path, monkeypatch):
    real, rows = posbench.runs.train.train_step, []

    def recording(model, step_fn, optimizer, x, y, *args, **kwargs):
        # (lr, grad_clip, pos, segments): segments, where training cuts its rows, keep a pair
        # only within one
        segments = kwargs.get("segments", args[3] if len(args) > 3 else None)
        rows.extend((x.shape[1], None if segments is None else segments[b].tolist())
                    for b in range(x.shape[0]))
        return real(model, step_fn, optimizer, x, y, *args, **kwargs)

    monkeypatch.setattr(posbench.runs.train, "train_step", recording)
    cfg = posbench.compose(RUN)
    posbench.config.check(cfg)
    record = train(cfg, tmp_path / "run", group="test", name="run")
    assert len(rows) == 4 * 3
    assert pair_frequency(trained_sequences(record), 16) == enumerated(rows, 16)


def record(name, seed, steps=10, **train_config):
    return {"encoding": name, "seed": seed, "status": "ok",
            "train": {"seq_len": 8, "steps": steps},
            "eval": {"protocol": "nonoverlapping",
                     "curve": [{"length": n, "loss": 1.0 + n / 64, "ppl": 2.7 + n / 16}
                               for n in (8, 16, 32)]},
            "config": {"encoding": {"name": name}, "seed": seed,
                       "train": {"seq_len": 8, "batch_size": 2, **train_config}}}


def test_the_report_draws_f_beside_the_curves_and_names_the_runs_it_cannot_derive(tmp_path):
    for name, rec in [("rope", record("rope", 0)), ("alibi", record("alibi", 0, steps=5)),
                      ("nope", record("nope", 0, pack_documents=True))]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(rec))
    write_report(tmp_path)
    assert (tmp_path / PLOT).stat().st_size > 0
    by_label = {}
    for row in csv.DictReader(open(tmp_path / TABLE)):
        by_label.setdefault(row["label"].split()[0], []).append(int(row["pairs"]))
    # packed windows of L = 8: N (L - i), N = steps x batch
    assert by_label == {"rope": [20 * (8 - i) for i in range(8)],
                        "alibi": [10 * (8 - i) for i in range(8)]}
    summary = (tmp_path / "summary.md").read_text()
    assert ("- nope [pack_documents=true]: train.pack_documents=True: its sequences are not "
            "yet read") in summary
