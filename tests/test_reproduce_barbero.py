"""`posbench reproduce barbero2024`: the seven rows of p-RoPE's Table 2, each a config that composes
into the encoding the row names, and the claims that compare two rows, paired on the same windows
and seeds (or by their seeds' bands for runs without per-window losses), judged on the paper's
numbers and on numbers that break them."""
import math

import pytest

import posbench
from posbench.reproduce import NOT_COMPARABLE, NOT_REPRODUCED, REPRODUCED, Measured, registry

ENTRY = registry()["barbero2024"].cls
# Barbero et al. 2024, Table 2, the Wiki column (Gemma 2B, 8k context)
TABLE2_WIKI = {"nope": 4.8594, "rope_10k": 4.4627, "rope_500k": 4.4485, "p_rope_0.25": 4.5302,
               "p_rope_0.75": 4.4414, "reversed_0.75": 4.4592, "partial_0.75": 4.4537}
ROW_ENCODINGS = {"nope": {"name": "nope"},
                 "rope_10k": {"name": "rope", "base": 10000.0},
                 "rope_500k": {"name": "rope", "base": 500000.0},
                 "p_rope_0.25": {"name": "p_rope", "p": 0.25, "variant": "p_rope"},
                 "p_rope_0.75": {"name": "p_rope", "p": 0.75, "variant": "p_rope"},
                 "reversed_0.75": {"name": "p_rope", "p": 0.75, "variant": "reversed"},
                 "partial_0.75": {"name": "p_rope", "p": 0.75, "variant": "partial"}}


def table(values, band):
    """Perplexity at L by row, each with the same relative 95% band."""
    return Measured({g: {1.0: v} for g, v in values.items()}, at_paper_scale=False,
                    spread={g: {1.0: v * band} for g, v in values.items()})


def verdicts(measured):
    return {c.name: c.judge(measured)[0] for c in ENTRY.claims}


def test_the_entry_holds_the_papers_wiki_column():
    ENTRY.check()
    assert {g: row[8192] for g, row in ENTRY.published.items()} == TABLE2_WIKI
    assert ENTRY.groups == tuple(TABLE2_WIKI)


@pytest.mark.parametrize("row", list(ROW_ENCODINGS))
def test_each_rows_config_composes_into_the_encoding_it_names(row):
    cfg = posbench.compose(["+experiment=barbero2024", f"+barbero2024={row}"])
    encoding = {k: v for k, v in cfg.encoding.items() if k in ROW_ENCODINGS[row]}
    assert encoding == ROW_ENCODINGS[row]
    record = {"config": {"encoding": dict(cfg.encoding)}, "encoding": cfg.encoding.name}
    assert ENTRY.group_of(record) == row


def test_the_papers_numbers_reproduce_every_claim_when_the_bands_are_narrow():
    assert set(verdicts(table(TABLE2_WIKI, 0.0005)).values()) == {REPRODUCED}


def test_a_gap_inside_the_seeds_bands_is_a_tie_and_beyond_them_the_other_way_is_not_reproduced():
    # bands of 1% each: combined sqrt(2) * 1% = 1.41%; the paper's sub-1% gaps become ties
    judged = verdicts(table(TABLE2_WIKI, 0.01))
    assert judged["nope_behind"] == judged["quarter_behind"] == REPRODUCED
    assert judged["prope_ahead_of_rope"] == judged["partial_behind"] == NOT_COMPARABLE

    # RoPE 3% ahead of 0.75-RoPE: beyond the band the other way
    flipped = dict(TABLE2_WIKI, rope_10k=TABLE2_WIKI["p_rope_0.75"] / 1.03)
    claim = next(c for c in ENTRY.claims if c.name == "prope_ahead_of_rope")
    verdict, detail = claim.judge(table(flipped, 0.01))
    assert verdict == NOT_REPRODUCED
    assert "rope_10k -2.9% against p_rope_0.75 at 1L" in detail and "±1.4%" in detail

    # one seed: no band to judge by
    one_seed = Measured({g: {1.0: v} for g, v in TABLE2_WIKI.items()}, at_paper_scale=False)
    assert set(verdicts(one_seed).values()) == {NOT_COMPARABLE}


def record(row, seed, ppl, windows=None):
    enc = ROW_ENCODINGS[row]
    point = {"length": 128, "ppl": ppl}
    if windows is not None:
        point["windows"] = {"loss": list(windows), "tokens": [128] * len(windows)}
    return {"encoding": enc["name"], "seed": seed, "config": {"encoding": enc},
            "train": {"seq_len": 128}, "dataset": {"fingerprint": "sha256:x"},
            "model": {"params": 822_000, "n_layer": 4, "n_head": 4, "d_model": 128},
            "eval": {"protocol": "nonoverlapping", "tokens_per_length": 16384, "stride": None,
                     "curve": [point]}}


def test_runs_with_per_window_losses_are_judged_paired_where_the_bands_cannot_tell():
    """0.75-RoPE 0.5% ahead of RoPE in both seeds, on every window: the seeds' bands (the seeds
    differ by 6%) hold that as a tie, the paired interval does not."""
    windows = [1.0 + 0.01 * i for i in range(64)]
    ppl = lambda shift: math.exp(sum(windows) / 64 + shift)
    runs = [record("p_rope_0.75", seed, ppl(shift), [w + shift for w in windows])
            for seed, shift in ((0, 0.0), (1, 0.06))]
    runs += [record("rope_10k", seed, ppl(shift + 0.005), [w + shift + 0.005 for w in windows])
             for seed, shift in ((0, 0.0), (1, 0.06))]
    claim = next(c for c in ENTRY.claims if c.name == "prope_ahead_of_rope")
    verdict, detail = claim.judge(ENTRY.measure(runs))
    assert verdict == REPRODUCED, detail
    assert "rope_10k +0.5% against p_rope_0.75 at 1L, paired over 2 seeds and 64 windows" in detail
    # the same means without per-window losses: judged by the bands, a tie
    for run in runs:
        del run["eval"]["curve"][0]["windows"]
    verdict, detail = claim.judge(ENTRY.measure(runs))
    assert verdict == NOT_COMPARABLE and "no per-window losses to pair" in detail


def test_runs_are_measured_by_row_with_their_seeds_band():
    runs = [record("rope_10k", 0, 3.5), record("rope_10k", 1, 3.7),
            record("rope_500k", 0, 3.6), record("p_rope_0.75", 0, 3.4)]
    measured = ENTRY.measure(runs)
    assert measured.values == {"rope_10k": {1.0: pytest.approx(3.6)}, "rope_500k": {1.0: 3.6},
                               "p_rope_0.75": {1.0: 3.4}}
    # two seeds: t(0.975, 1 df) = 12.706 times the standard error sd / sqrt(2)
    sd = math.sqrt(((3.5 - 3.6) ** 2 + (3.7 - 3.6) ** 2) / 1)
    assert measured.spread["rope_10k"][1.0] == pytest.approx(12.706 * sd / math.sqrt(2), rel=1e-3)
    assert measured.spread["rope_500k"][1.0] == 0.0
    assert ENTRY.owns(runs) == []
