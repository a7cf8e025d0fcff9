"""`posbench reproduce golovneva2024`: CoPE's Table 3 (counting with 1, 3, 5 variables), its
published error rates retyped here, judged reproduced on the paper's own numbers and not on numbers
that break each claim, seed bands widening a tie, runs grouped by task and encoding, the
experiment's 27 jobs composing to the reference's three encodings, and the entry run at a toy
scale through the installed CLI."""
import json

import pytest
from omegaconf import OmegaConf

import posbench
from helpers import posbench_cli
from posbench.reproduce import NOT_COMPARABLE, NOT_REPRODUCED, REPRODUCED, Measured, registry

ENTRY = registry()["golovneva2024"].cls
ENCODINGS = ("learned", "shaw", "cope")
# Golovneva et al. 2024, Table 3: test error (%) by number of variables (1, 3, 5), the mean of
# 3 seeds, rows absolute PE, relative PE, CoPE
TABLE3 = {"learned": (5.3, 67.6, 71.5), "shaw": (1.1, 17.8, 22.4), "cope": (0.0, 1.2, 7.4)}
TASKS = ("counting_1", "counting_3", "counting_5")
CLAIMS = ("one_variable_learned", "cope_lowest_error", "relative_below_absolute",
          "more_variables_harder")


def accuracies(spread=None, **changed):
    """Table 3 as exact match (1 - error) at L/2 and L, a group's entries replaced by
    `changed` (`counting_3__cope=0.5`)."""
    values = {f"{t}/{e}": 1 - row[i] / 100 for e, row in TABLE3.items()
              for i, t in enumerate(TASKS)}
    values.update({k.replace("__", "/"): v for k, v in changed.items()})
    bands = {g: {0.5: spread, 1.0: spread} for g in values} if spread else {}
    return Measured({g: {0.5: v, 1.0: v} for g, v in values.items()}, at_paper_scale=False,
                    spread=bands)


def verdicts(measured):
    return {c.name: c.judge(measured) for c in ENTRY.claims}


def test_the_entry_holds_to_the_contract_with_table_3():
    ENTRY.check()
    assert ENTRY.metric == "accuracy" and ENTRY.axis == "score" and ENTRY.device == "cpu"
    assert {e: tuple(row.values()) for e, row in ENTRY.published.items()} == TABLE3
    assert all(tuple(row) == ("1 var", "3 var", "5 var") for row in ENTRY.published.values())
    assert ENTRY.groups == tuple(f"{t}/{e}" for t in TASKS for e in ENCODINGS)
    assert tuple(c.name for c in ENTRY.claims) == CLAIMS
    assert "counting_task.png" in ENTRY.source and "e6f051f" in ENTRY.source
    assert not ENTRY.at_paper_scale()


def test_the_papers_own_numbers_reproduce_every_claim():
    judged = verdicts(ENTRY.paper_measured())
    assert {n: v for n, (v, _) in judged.items()} == dict.fromkeys(CLAIMS, REPRODUCED)
    assert "counting_5/cope 0.926 against counting_5/shaw 0.776 (+0.150" in \
        judged["cope_lowest_error"][1]
    # the same at two lengths
    assert {n: v for n, (v, _) in verdicts(accuracies()).items()} == dict.fromkeys(CLAIMS,
                                                                                  REPRODUCED)


@pytest.mark.parametrize("claim, changed, verdict, shown", [
    # absolute PE that has not learnt one variable
    ("one_variable_learned", {"counting_1__learned": 0.85}, NOT_REPRODUCED,
     "lowest: counting_1/learned 0.850"),
    # CoPE behind relative PE at 5 variables; level with it at 3
    ("cope_lowest_error", {"counting_5__cope": 0.70}, NOT_REPRODUCED, "behind beyond the band"),
    ("cope_lowest_error", {"counting_3__cope": 0.83}, NOT_COMPARABLE, "a tie"),
    # relative PE behind absolute at 3 variables
    ("relative_below_absolute", {"counting_3__shaw": 0.25}, NOT_REPRODUCED,
     "counting_3/shaw 0.250 against counting_3/learned 0.324"),
    # CoPE as good with 5 variables as with 1, then better
    ("more_variables_harder", {"counting_5__cope": 0.99}, NOT_COMPARABLE, "a tie"),
    ("more_variables_harder", {"counting_1__cope": 0.90, "counting_5__cope": 0.99},
     NOT_REPRODUCED, "counting_1/cope 0.900 against counting_5/cope 0.990"),
])
def test_numbers_that_break_a_claim_do_not_reproduce_it(claim, changed, verdict, shown):
    judged = verdicts(accuracies(**changed))
    assert judged[claim][0] == verdict and shown in judged[claim][1], judged[claim]
    # the other claims stand
    others = {n: v for n, (v, _) in judged.items() if n != claim}
    assert set(others.values()) == {REPRODUCED}, others


def test_cope_is_compared_with_its_best_rival():
    # absolute PE ahead of both at 3 variables: CoPE is judged against it, not relative PE
    judged = verdicts(accuracies(counting_3__learned=0.95, counting_3__cope=0.9))
    assert judged["cope_lowest_error"][0] == NOT_REPRODUCED
    assert "counting_3/cope 0.900 against counting_3/learned 0.950 (-0.050, band ±0.030) " \
        "behind" in judged["cope_lowest_error"][1]
    assert judged["relative_below_absolute"][0] == NOT_REPRODUCED


def test_seed_bands_widen_a_tie_and_missing_groups_say_nothing():
    # CoPE 0.05 ahead of relative PE at 3 variables: ahead beyond 0.03, a tie with seeds'
    # 95% bands of ±0.04 each (0.03 + 0.057)
    close = {"counting_3__cope": 0.872}
    assert verdicts(accuracies(**close))["cope_lowest_error"][0] == REPRODUCED
    verdict, detail = verdicts(accuracies(spread=0.04, **close))["cope_lowest_error"]
    assert verdict == NOT_COMPARABLE and "band ±0.087" in detail
    partial = accuracies()
    del partial.values["counting_5/shaw"]
    verdict, detail = verdicts(partial)["cope_lowest_error"]
    assert verdict == NOT_COMPARABLE and "not measured: counting_5/shaw" in detail
    assert {n: v for n, (v, _) in verdicts(Measured({}, False)).items()} == dict.fromkeys(
        CLAIMS, NOT_COMPARABLE)


def record(task, enc, seed, curve, seq_len=128):
    return {"encoding": enc, "seed": seed, "dataset": {"name": f"task_{task}"},
            "train": {"seq_len": seq_len},
            "model": {"params": 1, "n_layer": 1, "n_head": 1, "d_model": 8},
            "eval": {"curve": [{"length": n, "ppl": 1.0, "accuracy": a} for n, a in curve]}}


def test_runs_are_grouped_by_task_and_encoding_and_tabled_as_error():
    runs = [record("counting_3", "cope", 0, [(64, 1.0), (128, 0.9)]),
            record("counting_3", "cope", 1, [(64, 0.8), (128, 0.7)]),
            record("counting_1", "learned", 0, [(32, 1.0), (128, 0.5)])]
    measured = ENTRY.measure(runs)
    want = {"counting_3/cope": {0.5: 0.9, 1.0: 0.8}, "counting_1/learned": {0.25: 1.0, 1.0: 0.5}}
    assert set(measured.values) == set(want)
    for group, row in want.items():
        assert measured.values[group] == pytest.approx(row)
    assert ENTRY.owns(runs) == []
    assert ENTRY.owns([record("counting_3", "rope", 0, [(128, 1.0)])]) == ["counting_3/rope"]
    text = "\n".join(ENTRY.tables(measured, 128))
    # error = 1 - the mean exact match up to L: 15.0% for CoPE at 3 variables, 25.0% learned at 1
    assert "| CoPE | cope | 0.0 | — | 1.2 | 15.0 | 7.4 | — |" in text
    assert "| Absolute PE | learned | 5.3 | 25.0 | 67.6 | — | 71.5 | — |" in text
    assert "## counting_3: exact match by length over L" in text


def test_the_experiment_composes_the_references_three_encodings_for_each_task():
    seen = set()
    for task in TASKS:
        for pe, name in (("absolute", "learned"), ("relative", "shaw"), ("cope", "cope")):
            cfg = posbench.compose(["+experiment=golovneva2024", f"golovneva2024/task={task}",
                                    f"golovneva2024/pe={pe}"])
            posbench.config.check(cfg)
            encoding = OmegaConf.to_container(cfg.encoding, resolve=True)
            assert (cfg.dataset.name, encoding["name"]) == (f"task_{task}", name)
            seen.add((task, name))
            if name == "shaw":  # the reference's RelPosEmb: keys only, one for all heads, unclipped
                assert (encoding["values"], encoding["share_heads"], encoding["k"]) == (
                    False, True, cfg.train.seq_len)
            if name == "cope":  # every count a window reaches, as the reference's block + 1
                assert encoding["p_max"] == cfg.train.seq_len
            assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model) == (4, 4, 128)
            assert (cfg.train.seq_len, cfg.train.steps, cfg.train.batch_size) == (128, 1500, 32)
            assert list(cfg.eval.lengths) == [32, 64, 96, 128] and cfg.device == "cpu"
    assert len(seen) == 9
    # a larger L moves shaw's k and CoPE's P_max with it
    cfg = posbench.compose(["+experiment=golovneva2024", "golovneva2024/pe=relative",
                            "train.seq_len=512"])
    assert cfg.encoding.k == 512


def test_the_entry_runs_at_a_toy_scale_through_the_cli(tmp_path):
    sweep = tmp_path / "sweep"
    done = posbench_cli(
        "reproduce", "golovneva2024", "hydra/launcher=basic", "golovneva2024/task=counting_3",
        "golovneva2024/pe=absolute,cope", "seed=0", "model.n_layer=1", "model.d_model=32",
        "model.n_head=2", "train.steps=2", "train.batch_size=2", "train.warmup_steps=1",
        "train.log_every=1", "train.seq_len=32", "eval.lengths=[16,32]", "eval.tokens=64",
        f"hydra.sweep.dir={sweep}", cwd=tmp_path, in_process=True)
    record_ = json.loads((sweep / "reproduction.json").read_text())
    assert set(record_["measured"]) == {"counting_3/learned", "counting_3/cope"}
    assert list(record_["measured"]["counting_3/cope"]) == ["0.5", "1"]
    assert {c["name"]: c["verdict"] for c in record_["claims"]} == dict.fromkeys(
        CLAIMS, NOT_COMPARABLE)  # nothing at 1 or 5 variables, no relative PE
    assert "| CoPE | cope | 0.0 | — | 1.2 |" in done.stdout
