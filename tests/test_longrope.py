"""LongRoPE (eval.rope_scaling=longrope, posbench/encodings/longrope.py) and its evolutionary
search (`posbench longrope`, posbench/runs/longrope_search.py): the factors' special cases
against PI, YaRN and NTK computed by posbench's own scalings and by the formulas written here, the
magnitude factor against Hugging Face's `longrope` default, the search's constraints,
determinism, resume and refusals, and the factors results.json records re-creating its curve."""
import json
import math
import re
import shutil

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import posbench
from posbench.data.windows import share_tokens
from posbench.encodings import Dims
from posbench.encodings.longrope import LongRoPE, magnitude
from posbench.encodings.p_rope import PRoPE
from posbench.encodings.rope import RoPE, rope_inv_freq
from posbench.evaluations.perplexity import plans
from posbench.runs import longrope_search
from posbench.runs.longrope_search import (STEP, crossover, initial_factors, key, monotone,
                                           mutate, run_search, sizes)
from helpers import posbench_cli

F64 = torch.float64
D, L, BASE = 64, 512, 1e4


def rope(scaling="none", factor=None, longrope=None, cls=RoPE):
    enc = cls(cls.Config(name="rope", base=BASE), Dims(1, 1, D, L, 8 * L))
    enc.set_eval_options(scaling, rope_scaling_factor=factor, longrope_factors=longrope)
    return enc


def factors_file(tmp_path, factors, length=4 * L, **extra):
    path = tmp_path / "factors.json"
    path.write_text(json.dumps({"factors": list(factors), "length": length, **extra}))
    return str(path)


def rotated(enc, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 2, n, D, generator=g, dtype=F64)
    pos = torch.arange(n).unsqueeze(0)
    return enc.rotate(q, k, pos, 0)


# --- the scaling ---------------------------------------------------------------------------------
def test_factors_of_one_without_magnitude_are_plain_rope_exactly(tmp_path):
    enc = rope("longrope", longrope=factors_file(tmp_path, [1] * (D // 2), attention_factor=1.0))
    inv_freq, factor = enc.frequencies(4 * L)
    assert torch.equal(inv_freq, rope_inv_freq(D, BASE)) and factor == 1.0
    for got, want in zip(rotated(enc, 4 * L), rotated(rope(), 4 * L)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("s", [2.0, 4.0, 8.0])
def test_factors_of_s_without_magnitude_are_pi_at_factor_s_exactly(tmp_path, s):
    enc = rope("longrope", longrope=factors_file(tmp_path, [s] * (D // 2), attention_factor=1.0))
    pi = rope("pi", s)
    for n in (L + 1, 2 * L, 8 * L):
        assert torch.equal(enc.frequencies(n)[0], pi.frequencies(n)[0])
    for got, want in zip(rotated(enc, 2 * L), rotated(pi, 2 * L)):
        assert torch.equal(got, want)


def test_the_default_magnitude_is_hf_longrope_attention_factor_and_scales_logits_by_its_square():
    # HF _compute_longrope_parameters: sqrt(1 + log(factor) / log(original_max_position_embeddings))
    assert magnitude(4 * L, L) == pytest.approx(math.sqrt(1 + math.log(4) / math.log(L)),
                                                rel=1e-15)
    assert magnitude(4 * L, L) ** 2 == pytest.approx(11 / 9, rel=1e-14)  # ln 4 / ln 512 = 2/9
    assert magnitude(L, L) == 1.0
    enc = rope("longrope", longrope=LongRoPE.at([4.0] * (D // 2), 4 * L, L))
    q, k = rotated(enc, 4 * L)
    q0, k0 = rotated(rope("pi", 4.0), 4 * L)
    torch.testing.assert_close(q @ k.transpose(-2, -1), 11 / 9 * (q0 @ k0.transpose(-2, -1)),
                               rtol=1e-12, atol=1e-10)


def test_up_to_the_training_length_longrope_is_plain_rope(tmp_path):
    enc = rope("longrope", longrope=factors_file(tmp_path, np.linspace(1, 4, D // 2).tolist()))
    for n in (1, L // 2, L):
        inv_freq, factor = enc.frequencies(n)
        assert torch.equal(inv_freq, rope_inv_freq(D, BASE)) and factor == 1.0
    inv_freq, factor = enc.frequencies(L + 1)
    torch.testing.assert_close(inv_freq, rope_inv_freq(D, BASE) / torch.linspace(1, 4, D // 2,
                                                                                 dtype=F64),
                               rtol=1e-15, atol=0)
    assert factor == magnitude(4 * L, L)


def test_a_model_trained_with_the_factors_takes_them_at_every_length(tmp_path):
    """train.rope_scaling=longrope (Dims.train_scaling): at n <= L too, theta_p / lambda_p and
    the magnitude, as the reference's LongRoPEScaledRotaryEmbedding applies them."""
    factors = np.linspace(1, 4, D // 2)
    enc = RoPE(RoPE.Config(name="rope", base=BASE), Dims(1, 1, D, L, 8 * L,
                                                         train_scaling="longrope"))
    enc.set_eval_options("longrope", longrope_factors=factors_file(tmp_path, factors.tolist()))
    want = BASE ** (-np.arange(0, D, 2) / D) / factors
    for n in (1, L // 2, L, L + 1, 4 * L):
        inv_freq, factor = enc.frequencies(n)
        np.testing.assert_allclose(inv_freq.numpy(), want, rtol=1e-14, atol=0)
        assert factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(L)), rel=1e-14)


def test_pairs_that_do_not_rotate_stay_at_zero():
    enc = rope("longrope", longrope=LongRoPE.at([2.0] * (D // 2), 4 * L, L), cls=PRoPE)
    base = rope(cls=PRoPE).inv_freq
    inv_freq, _ = enc.frequencies(2 * L)
    assert (base == 0).any() and torch.equal(inv_freq == 0, base == 0)
    assert torch.equal(inv_freq[base > 0], base[base > 0] / 2)


# --- the initial candidates ----------------------------------------------------------------------
def test_initial_candidates_are_pi_ntk_and_yarn_frequencies():
    s = 4.0
    start = initial_factors(D, BASE, L, s)
    theta = rope_inv_freq(D, BASE)
    for name, scaling in (("pi", "pi"), ("ntk", "ntk"), ("yarn", "yarn")):
        got = LongRoPE(tuple(start[name]), 4 * L, 1.0).inv_freq(theta)
        torch.testing.assert_close(got, rope(scaling, s).frequencies(4 * L)[0], rtol=1e-14,
                                   atol=0, msg=name)
    # NTK: b' = b s^(d/(d-2)) turns pair i at theta_i s^(-2i/(d-2))
    ntk = [s ** (2 * i / (D - 2)) for i in range(D // 2)]
    np.testing.assert_allclose(start["ntk"], ntk, rtol=1e-13)
    assert start["ntk"][0] == 1.0 and start["ntk"][-1] == pytest.approx(s, rel=1e-13)
    # YaRN at d = 64, L = 512: pairs up to 3 kept, from 16 on divided by s (its paper's example)
    assert (start["yarn"][:4] == 1).all()
    np.testing.assert_allclose(start["yarn"][16:], s, rtol=1e-14)
    for factors in start.values():
        assert monotone(factors) and (factors >= 1).all() and (factors <= 1 + s).all()


# --- mutation and crossover ----------------------------------------------------------------------
def test_mutations_and_crossovers_stay_non_decreasing_within_1_and_1_plus_s_and_new():
    s, top = 4.0, 5.0
    start = initial_factors(D, BASE, L, s)
    tried = {key(f) for f in start.values()}
    rng = np.random.default_rng(0)
    children = []
    for trial in range(200):
        parent = list(start.values())[trial % 3]
        child = mutate(parent, top, rng, tried)
        assert monotone(child) and child[0] >= 1 and child[-1] <= top
        assert key(child) not in tried
        assert (child != parent).any()
        tried.add(key(child))
        children.append(child)
    for a, b in zip(children[::2], children[1::2]):
        child = crossover(a, b, 20, rng, tried)
        if child is not None:
            assert monotone(child) and key(child) not in tried
            assert all(c in (x, y) for c, x, y in zip(child, a, b))
    assert crossover(children[0], children[0].copy(), 20, rng, tried) is None


def test_a_mutated_pair_takes_a_grid_value_between_its_neighbours():
    parent = np.array([1.0, 1.5, 2.0, 3.0])
    rng = np.random.default_rng(1)
    for _ in range(100):
        child = mutate(parent, 5.0, rng, {key(parent)})
        for i in np.flatnonzero(child != parent):
            low = child[i - 1] if i else 1.0
            assert (child[i] - low) / STEP == pytest.approx(round((child[i] - low) / STEP),
                                                            abs=1e-6)


def test_the_reference_sizes_scale_down_as_its_evo_scale():
    assert sizes(1.0) == {"population": 64, "iterations": 40, "mutations": 16, "crossovers": 16,
                          "parents": 32, "crossover_tries": 20}
    assert sizes(0.25) == {"population": 16, "iterations": 10, "mutations": 4, "crossovers": 4,
                           "parents": 8, "crossover_tries": 5}


# --- the search on the toy run -------------------------------------------------------------------
SCALE = 0.0625  # 4 candidates, then 2 iterations of 2


@pytest.fixture(scope="module")
def searched(toy_run, tmp_path_factory):
    """The toy run (L = 32) searched at 64, seed 0, in a copy."""
    run_dir = tmp_path_factory.mktemp("searched") / "run"
    shutil.copytree(toy_run[0], run_dir)
    return run_dir, run_search(run_dir, 64, seed=0, scale=SCALE)


def test_the_search_never_ends_worse_than_its_best_initial_candidate(searched):
    run_dir, result = searched
    n = sizes(SCALE)
    assert len(result["tried"]) == n["population"] + n["iterations"] * (n["mutations"]
                                                                        + n["crossovers"])
    initial = [ppl for _, ppl in result["tried"][:n["population"]]]
    best = [h["best_ppl"] for h in result["history"]]
    assert best[0] == min(initial) and result["ppl"] == best[-1] == min(p for _, p in
                                                                        result["tried"])
    assert all(a >= b for a, b in zip(best, best[1:]))
    assert result["initial_ppl"] == dict(zip(("pi", "ntk", "yarn"), initial[:3]))
    factors = np.array(result["factors"])
    assert monotone(factors) and factors[0] >= 1 and factors[-1] <= 1 + 64 / 32
    assert result["attention_factor"] == magnitude(64, 32)
    assert [f for f, p in result["tried"] if p == result["ppl"]][0] == result["factors"]


def test_the_search_windows_share_no_token_with_the_curves(searched):
    run_dir, result = searched
    cfg = posbench.load_run(run_dir).config
    from posbench.data import prepare

    data = prepare(cfg.dataset)
    scored = plans(data, OmegaConf.merge(cfg.eval, {"lengths": [32, 64]}))
    windows = result["windows"]
    assert windows["length"] == 64 and len(windows["starts"]) == math.ceil(256 / 64)
    assert not share_tokens(windows["starts"], 65,
                            [(p.starts, p.length + 1) for p in scored]).any()


def test_the_search_is_deterministic_for_a_seed_and_resumes_as_if_uninterrupted(
        searched, tmp_path, monkeypatch):
    run_dir, result = searched
    again = tmp_path / "run"
    shutil.copytree(run_dir, again)
    path = again / "longrope-64-seed0.json"
    path.unlink()
    iterate = longrope_search.Search.iterate

    def stop_at_two(self, iteration):
        if iteration == 2:
            raise KeyboardInterrupt
        iterate(self, iteration)

    monkeypatch.setattr(longrope_search.Search, "iterate", stop_at_two)
    with pytest.raises(KeyboardInterrupt):
        run_search(again, 64, seed=0, scale=SCALE)
    cut = json.loads(path.read_text())
    assert "factors" not in cut and [h["iteration"] for h in cut["history"]] == [0, 1]
    monkeypatch.setattr(longrope_search.Search, "iterate", iterate)
    resumed = run_search(again, 64, seed=0, scale=SCALE)
    same = {k: v for k, v in result.items() if k != "run"}
    assert {k: v for k, v in resumed.items() if k != "run"} == same
    # another seed searches otherwise
    other = run_search(again, 64, seed=1, scale=SCALE)
    assert other["tried"][3:] != result["tried"][3:] and other["tried"][:3] == result["tried"][:3]


def test_a_finished_search_is_skipped_and_another_settings_file_is_refused(searched, capsys):
    run_dir, result = searched
    before = (run_dir / "longrope-64-seed0.json").read_bytes()
    assert run_search(run_dir, 64, seed=0, scale=SCALE) == result
    assert "holds this search, finished" in capsys.readouterr().out
    with pytest.raises(posbench.ConfigError, match=r"holds a search with scale=0.0625, not "
                                                   r"0.125; expected the same settings"):
        run_search(run_dir, 64, seed=0, scale=0.125)
    assert (run_dir / "longrope-64-seed0.json").read_bytes() == before


def test_the_recorded_factors_recreate_the_curve(searched, tmp_path):
    run_dir, result = searched
    factors = run_dir / "longrope-64-seed0.json"
    posbench_cli("eval", str(run_dir), "eval.rope_scaling=longrope",
                 f"eval.longrope_factors={factors}", cwd=tmp_path, in_process=True)
    (written,) = run_dir.glob("results.eval-rope_scaling-longrope*.json")
    record = json.loads(written.read_text())
    longrope = record["eval"]["longrope"]
    assert longrope == {"path": str(factors), "factors": result["factors"], "length": 64,
                        "attention_factor": result["attention_factor"],
                        "search_windows_scored": 0}
    original = json.loads((run_dir / "results.json").read_text())["eval"]["curve"]
    at_l, past_l = record["eval"]["curve"]
    assert at_l["loss"] == original[0]["loss"] and past_l["loss"] != original[1]["loss"]
    # the values alone, in a file of their own
    copy = tmp_path / "recorded.json"
    copy.write_text(json.dumps({k: longrope[k] for k in ("factors", "length",
                                                         "attention_factor")}))
    other = tmp_path / "other"
    shutil.copytree(run_dir, other, ignore=shutil.ignore_patterns("*.eval-*"))
    posbench_cli("eval", str(other), "eval.rope_scaling=longrope",
                 f"eval.longrope_factors={copy}", cwd=tmp_path, in_process=True)
    (again,) = other.glob("results.eval-rope_scaling-longrope*.json")
    again = json.loads(again.read_text())
    assert [p["loss"] for p in again["eval"]["curve"]] == [p["loss"] for p in
                                                           record["eval"]["curve"]]
    assert again["eval"]["longrope"]["search_windows_scored"] is None  # no search windows named


# --- refusals ------------------------------------------------------------------------------------
def refusal(overrides, match):
    with pytest.raises(posbench.ConfigError, match=match) as err:
        posbench.compose(["model.d_model=32", "model.n_head=2", *overrides])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("content, match", [
    ({"factors": [1.0] * 7, "length": 512}, r"8 factors, one per rotary pair of the "
                                            r"head's 16 dimensions; the file holds 7"),
    ({"factors": [1.0] * 7 + [0.5], "length": 512}, r"factors that are finite and >= 1 .*"
                                                    r"the file holds 0.5"),
    ({"factors": [1.0] * 8, "length": 128}, r"a `length` above the training length 128"),
    ({"factors": [1.0] * 8}, r"a `length` above the training length 128.*holds None"),
    ({"factors": "1.0", "length": 512}, r"a JSON object whose `factors` is a list of numbers"),
    ({"factors": [1.0] * 8, "length": 512, "attention_factor": 0}, r"an `attention_factor` > 0"),
])
def test_bad_factor_files_are_refused_in_one_line(tmp_path, content, match):
    path = tmp_path / "f.json"
    path.write_text(json.dumps(content))
    refusal(["eval.rope_scaling=longrope", f"eval.longrope_factors={path}"],
            rf"^eval.longrope_factors='{path}' is not accepted; expected {match}")


def test_missing_and_unreadable_files_and_misplaced_keys_are_refused_in_one_line(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"factors": [1.0] * 8, "length": 512}))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for overrides, match in (
            ([f"eval.longrope_factors={tmp_path}/none.json"],
             r"^eval.longrope_factors='.*none.json' is not accepted; expected null unless "
             r"eval.rope_scaling=longrope$"),
            ([f"eval.longrope_factors={tmp_path}/none.json", "eval.rope_scaling=longrope"],
             r"^eval.longrope_factors='.*none.json' is not accepted \(No such file or "
             r"directory\); expected a JSON file of LongRoPE factors"),
            ([f"eval.longrope_factors={bad}", "eval.rope_scaling=longrope"],
             r"is not accepted \(not JSON\); expected a JSON file"),
            (["eval.rope_scaling=longrope"], r"^eval.longrope_factors=None is not accepted; "
                                             r"expected the path of a JSON file"),
            ([f"eval.longrope_factors={good}", "eval.rope_scaling=longrope",
              "eval.rope_scaling_factor=4"], r"^eval.rope_scaling_factor=4.0 is not accepted; "
                                             r"expected null for longrope"),
            ([f"eval.longrope_factors={good}", "eval.rope_scaling=longrope", "encoding=alibi"],
             r"^eval.rope_scaling='longrope' is not accepted; expected 'none' for "
             r"encoding=alibi, which does not rotate q and k$")):
        refusal(overrides, match)
    # the good file composes, for RoPE and for the other rotary encodings
    for encoding in ("rope", "p_rope", "xpos"):
        posbench.compose(["model.d_model=32", "model.n_head=2", f"encoding={encoding}",
                          "eval.rope_scaling=longrope", f"eval.longrope_factors={good}"])


def test_the_search_refuses_in_one_line_before_any_work(searched, tmp_path):
    run_dir, _ = searched
    for args, match in (
            (["--length", "32"], r"^--length 32 is not accepted; expected a length above the "
                                 r"training length 32"),
            (["--length", "64", "--scale", "0.05"], r"^--scale 0.05 is not accepted; expected a "
                                                    r"number >= 0.0625"),
            (["--length", "300000"], r"^--length 300000 is not accepted: the validation "
                                     r"documents of pystdlib hold 0 windows of 300001 tokens"),
            (["--lenght", "64"], r"is not accepted; expected `posbench longrope RUN_DIR "
                                 r"--length N"),
            ([], r"is not accepted; expected `posbench longrope"),
    ):
        bad = posbench_cli("longrope", str(run_dir), *args, cwd=tmp_path, ok=False,
                           in_process=True)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        (line,) = [x for x in bad.stderr.splitlines() if x.startswith("posbench: error:")]
        assert re.search(match, line.removeprefix("posbench: error: ")), line
    for overrides, match in ((["encoding=alibi"], r"^encoding=alibi is not accepted by posbench "
                                                  r"longrope; expected a run whose encoding "
                                                  r"rotates q and k"),
                             (["dataset=task_copy"], r"^dataset=task_copy is not accepted by posbench "
                                                r"longrope; expected a text corpus")):
        with pytest.raises(posbench.ConfigError, match=match):
            longrope_search.check_args(posbench.compose(overrides), 1024, 0.25)
