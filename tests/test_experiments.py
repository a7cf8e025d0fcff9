"""Experiment presets (conf/experiment/, Hydra's `# @package _global_` pattern): what they set, and
that `-m +experiment=quick` sweeps the core encodings."""
import math

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

import posbench
from posbench.encodings import registry
from helpers import posbench_cli

CORE = ["nope", "sinusoidal", "learned", "rope", "alibi", "t5"]


def swept_encodings(experiment):
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="posbench.conf", version_base=None):
        cfg = compose(config_name="config", overrides=[f"+experiment={experiment}"],
                      return_hydra_config=True)
    return cfg.hydra.sweeper.params.encoding.split(",")


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
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="posbench.conf", version_base=None):
        cfg = compose(config_name="config", overrides=["+experiment=ladder"],
                      return_hydra_config=True)
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
