"""Experiment presets (conf/experiment/, Hydra's `# @package _global_` pattern): what they set, and
that `-m +experiment=quick` sweeps the core encodings, and the rows of the encodings_2025 and
retrieval_2025 studies."""
import math
from pathlib import Path

import pytest
import torch

import posbench
from posbench.core.composing import composer
from posbench.encodings import registry
from posbench.reproduce import rescores
from posbench.runs.budget import plan
from helpers import posbench_cli

CORE = ["nope", "sinusoidal", "learned", "rope", "alibi", "t5"]


def with_hydra(experiment):
    """The experiment's config with Hydra's own, whose sweeper params list what it sweeps."""
    with composer() as compose:
        return compose([f"+experiment={experiment}"], hydra=True)


def swept_encodings(experiment):
    return with_hydra(experiment).hydra.sweeper.params.encoding.split(",")


def test_quick_preset_is_a_small_cpu_study_of_the_core_encodings():
    cfg = posbench.compose(["+experiment=quick"])
    assert cfg.device == "cpu" and cfg.model.d_model == 128 and cfg.dataset.name == "pystdlib"
    assert cfg.train.seq_len == min(cfg.eval.lengths) and max(cfg.eval.lengths) >= 16 * 64
    assert cfg.train.steps * cfg.train.batch_size * cfg.train.seq_len <= 250_000
    assert swept_encodings("quick") == CORE and set(CORE) <= set(registry())


def test_alibi_table2_preset_is_the_papers_setting():
    cfg = posbench.compose(["+experiment=alibi_table2"])
    assert cfg.train.seq_len == 512 and cfg.device == "cuda"
    assert list(cfg.eval.lengths) == [512, 1024, 2048, 4096, 8192, 16384]
    assert cfg.eval.protocol == "nonoverlapping"
    assert (cfg.dataset.name, cfg.dataset.tokenizer, cfg.dataset.val_stream) == \
        ("wikitext103", "gpt2", True)
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model) == (12, 12, 768)
    assert swept_encodings("alibi_table2") == ["sinusoidal", "rope", "t5", "alibi"]
    # the longest windows fit in WikiText-103's validation stream (~250k GPT-2 tokens)
    assert math.ceil(cfg.eval.tokens / 16384) * 16385 <= 200_000


def test_ladder_preset_sweeps_the_width_at_the_default_study_setting():
    cfg = with_hydra("ladder")
    params = cfg.hydra.sweeper.params
    assert params.encoding.split(",") == ["nope", "rope", "t5", "alibi"]
    widths = [int(w) for w in params["model.d_model"].split(",")]
    # each width 4x the parameters of the last; heads divide every width
    assert widths == [64, 128, 256, 512] and all(w % cfg.model.n_head == 0 for w in widths)
    assert (cfg.train.seq_len, cfg.train.steps, cfg.train.batch_size) == (128, 2000, 16)
    assert list(cfg.eval.lengths) == [128 * 2 ** k for k in range(5)]
    assert (cfg.dataset.name, cfg.device) == ("pystdlib", "cpu")


def test_quick_multirun_trains_every_core_encoding_and_reports(tmp_path, toy):
    posbench_cli("train", "-m", "+experiment=quick", *toy, "hydra.sweep.dir=sweep", cwd=tmp_path,
                 in_process=True)
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    for name in CORE:
        assert f"| {name} |" in summary


# +experiment=encodings_2025: each row and what it must compose into (encoding keys, model knobs)
ROWS_2025 = {
    "rope": ({"name": "rope"}, {}), "alibi": ({"name": "alibi", "heads": None}, {}),
    "nope": ({"name": "nope"}, {}), "hope": ({"name": "hope"}, {}),
    "clipped_rope": ({"name": "clipped_rope"}, {}), "rope_id": ({"name": "rope_id"}, {}),
    "neox_partial": ({"name": "p_rope", "p": 0.25, "variant": "partial"}, {}),
    "p_rope_reversed": ({"name": "p_rope", "p": 0.75, "variant": "reversed"}, {}),
    "fope": ({"name": "fope"}, {}), "selective_rope": ({"name": "selective_rope"}, {}),
    "dape": ({"name": "dape"}, {}), "dape_v2": ({"name": "dape_v2"}, {}),
    "rope_gated": ({"name": "rope"}, {"attn_gate": "elementwise"}),
    "rope_sinks": ({"name": "rope"}, {"attn_sinks": True}),
    "rope_mla": ({"name": "rope"}, {"decoupled_rope": True}),
    "alibi_half": ({"name": "alibi", "heads": 2}, {}),
}
KNOBS_OFF = {"attn_gate": "none", "attn_sinks": False, "decoupled_rope": False}


def assert_sweeps_every_row_file_over_3_seeds(experiment, group, rows, param=None):
    """The study sweeps each file of conf/<group> as a row (its sweep param `param`, default
    the group), and seeds 0, 1, 2."""
    params = with_hydra(experiment).hydra.sweeper.params
    files = Path(posbench.__file__).parent / "conf" / group
    assert sorted(params[param or group].split(",")) == \
        sorted(p.stem for p in files.glob("*.yaml")) == sorted(rows)
    assert params.seed == "0,1,2"


def test_encodings_2025_sweeps_every_row_file_at_the_default_study_setting():
    assert_sweeps_every_row_file_over_3_seeds("encodings_2025", "encodings_2025", ROWS_2025,
                                              param="+encodings_2025")
    default, study = posbench.compose([]), posbench.compose(["+experiment=encodings_2025"])
    for key in ("model", "dataset", "train", "eval"):  # the default study's budget and lengths
        assert study[key] == default[key]


@pytest.mark.parametrize("row", list(ROWS_2025))
def test_each_encodings_2025_row_is_its_encoding_with_only_its_knob(row):
    cfg = posbench.compose(["+experiment=encodings_2025", f"+encodings_2025={row}"])
    encoding, knobs = ROWS_2025[row]
    assert {k: cfg.encoding.get(k) for k in encoding} == encoding
    assert {k: cfg.model[k] for k in KNOBS_OFF} == {**KNOBS_OFF, **knobs}
    model = posbench.build_model(cfg, 256)  # the row passes its checks and builds
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape[-1] == 256


# +experiment=retrieval_2025: each row and what it must compose into (encoding, model, switch)
ROWS_RETRIEVAL = {**{name: (name, False, None) for name in CORE + ["irope", "rnope_swa"]},
                  "drope": ("rope", False, 0.875)}  # the paper's from-scratch models: no QK-norm


def test_retrieval_2025_sweeps_every_row_file_at_the_ruler_budget():
    assert_sweeps_every_row_file_over_3_seeds("retrieval_2025", "retrieval_2025", ROWS_RETRIEVAL)
    cfg, ruler = posbench.compose(["+experiment=retrieval_2025"]), posbench.compose([]).eval.ruler
    # every task trained is scored, the aggregation tasks beside RULER's ten default ones
    tasks = list(ruler.tasks) + ["cwe", "fwe"]
    assert list(cfg.train.ruler_tasks) == list(cfg.eval.ruler.tasks) == tasks
    assert cfg.train.ruler_mix == 0.5 and cfg.eval.ruler.enabled
    # past the 6000 steps of 16 at L = 128 that taught the tiny model every task (results.md)
    assert (cfg.train.seq_len, cfg.train.batch_size, cfg.model.d_model) == (128, 16, 128)
    assert cfg.train.steps > 6000
    assert max(cfg.eval.lengths) == 16 * 128 and max(cfg.eval.ruler.lengths) == 4 * 128


@pytest.mark.parametrize("row", list(ROWS_RETRIEVAL))
def test_each_retrieval_2025_row_is_its_encoding_and_only_drope_switches(row):
    cfg = posbench.compose(["+experiment=retrieval_2025", f"retrieval_2025={row}"])
    name, qk_norm, switch = ROWS_RETRIEVAL[row]
    assert (cfg.encoding.name, cfg.model.qk_norm, cfg.train.switch_encoding_at) == \
        (name, qk_norm, switch)
    model = posbench.build_model(cfg, 256)  # the row passes its checks and builds
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape[-1] == 256


def sweep_jobs(experiment, arguments=()):
    """The jobs `posbench train -m +experiment=EXPERIMENT ARGUMENTS` launches, each a dict."""
    jobs = rescores.sweep_jobs([f"+experiment={experiment}", *arguments])
    return [dict(o.split("=", 1) for o in job) for job in jobs]


def test_budgets_and_rates_is_the_default_study_over_rates_and_budgets():
    default, study = posbench.compose([]), posbench.compose(["+experiment=budgets_and_rates"])
    for key in ("model", "dataset", "train", "eval"):  # the default study's setting
        assert study[key] == default[key]
    jobs = sweep_jobs("budgets_and_rates")
    # each core encoding, five seeds, at the shared rate and one either side of it
    assert len(jobs) == 6 * 3 * 5
    assert {j["encoding"] for j in jobs} == set(CORE)
    assert sorted({float(j["train.lr"]) for j in jobs}) == [default.train.lr / 2, default.train.lr,
                                                         default.train.lr * 2]
    assert {j["seed"] for j in jobs} == {"0", "1", "2", "3", "4"}
    # its FLOPs arm, as the file's second command writes it: the shared rate only
    flops = sweep_jobs("budgets_and_rates", ["train.budget=flops", "train.lr=2e-3"])
    assert len(flops) == 6 * 5
    assert {(j["train.budget"], float(j["train.lr"])) for j in flops} == \
        {("flops", default.train.lr)}
    text = (Path(posbench.__file__).parent / "conf" / "experiment" /
            "budgets_and_rates.yaml").read_text()
    assert "+experiment=budgets_and_rates train.budget=flops train.lr=2e-3" in text
    # as its file says: at this setting the six cost alike per token, RoPE the most
    steps = {name: plan(posbench.compose(["+experiment=budgets_and_rates", f"encoding={name}",
                                          "train.budget=flops"])).steps for name in CORE}
    assert steps["rope"] == default.train.steps == min(steps.values())
    assert max(steps.values()) <= default.train.steps * 1.002
