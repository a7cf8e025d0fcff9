"""The user guide's examples of a new encoding, dataset, task and evaluation (docs/guide.md, "Add
an encoding, a dataset, a task or an evaluation"), run as the files they say they are, each held
to its contract with numbers from an oracle written here."""
import os
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.core.config_store import ConfigStore

import posbench
from posbench import data as datasets
from posbench import evaluations
from posbench.config import register_schemas
from posbench.data import prepare
from posbench.data.tasks import BOS, FIRST, PAD, SEP
from posbench.encodings import base as encodings
from posbench.core.errors import ConfigError
from posbench.runs.results import results_record
from helpers import posbench_cli, results, window_starts

# the page that holds the examples (the README before they moved to the guide)
GUIDE = (Path(__file__).parents[1] / "docs" / "guide.md").read_text()


def example(path: str) -> str:
    """The guide's python block that starts with `# <path>`."""
    blocks = re.findall(r"```python\n(# (\S+)\n.*?)```", GUIDE, flags=re.S)
    return next(code for code, named in blocks if named == path)


@pytest.fixture
def module(monkeypatch):
    """Runs a guide example as the module its first line names; the registries, the ConfigStore
    and the schema are as they were afterwards."""
    registries = [encodings._REGISTRY, datasets.base._REGISTRY, evaluations.base._REGISTRY]
    saved = [dict(r) for r in registries]
    repo = ConfigStore.instance().repo
    groups = {g: dict(repo[g]) for g in ("encoding", "dataset") if g in repo}

    def load(path: str):
        name = path.removesuffix(".py").replace("/", ".")
        mod = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mod)
        exec(compile(example(path), path, "exec"), mod.__dict__)
        register_schemas()  # a new section's keys join the schema
        return mod

    yield load
    for registry, before in zip(registries, saved):
        registry.clear()
        registry.update(before)
    for group, before in groups.items():
        repo[group].clear()
        repo[group].update(before)
    register_schemas()


def test_the_encoding_example_subtracts_lag_to_the_alpha(module):
    module("posbench/encodings/power_bias.py")
    cfg = posbench.compose(["encoding=power_bias", "encoding.alpha=0.7", "model.n_layer=1",
                            "model.d_model=32", "model.n_head=2"])
    model = posbench.build_model(cfg, vocab_size=256)
    pos = torch.arange(6).view(1, 6)
    fn = model.encoding.score_mod(None, None, pos, 0)
    i, j = torch.arange(6).view(6, 1), torch.arange(6).view(1, 6)
    got = fn(torch.zeros(6, 6), torch.zeros(1, dtype=torch.long), 0, i, j)
    want = [[-(float(a - b) ** 0.7) if a >= b else 0.0 for b in range(6)] for a in range(6)]
    causal = i >= j  # future keys are masked after the hook
    assert torch.allclose(got[causal], torch.tensor(want)[causal])
    assert torch.isfinite(model(torch.zeros(1, 8, dtype=torch.long))).all()
    with pytest.raises(ConfigError, match="encoding.alpha=3.0"):
        posbench.compose(["encoding=power_bias", "encoding.alpha=3"])


def test_the_dataset_example_reads_the_markdown_files_only(module, tmp_path):
    module("posbench/data/markdown.py")
    notes = tmp_path / "notes"
    notes.mkdir()
    texts = {f"note{i}.md": f"# note {i}\n" + "words " * (40 + i) for i in range(12)}
    for name, text in texts.items():
        (notes / name).write_text(text)
    (notes / "skip.txt").write_text("not markdown")
    cfg = posbench.compose(["dataset=markdown", f"dataset.path={notes}", "dataset.val_fraction=0.3",
                            f"dataset.cache_dir={tmp_path / 'cache'}"])
    data = prepare(cfg.dataset)
    docs = sorted(bytes(data.tokens[a:b]) for offsets in (data.train_docs, data.val_docs)
                  for a, b in zip(offsets[:-1], offsets[1:]))
    assert docs == sorted(text.encode() for text in texts.values())  # byte level, .md only
    assert len(data.val_docs) > 1 and len(data.train_docs) > 1
    with pytest.raises(ConfigError, match="dataset.path=None"):
        posbench.compose(["dataset=markdown"])
    with pytest.raises(Exception, match="suffix"):  # typed: an int is no suffix
        posbench.compose(["dataset=markdown", f"dataset.path={notes}", "dataset.suffix=[1]"])


def test_the_task_example_answers_with_the_sorted_symbols(module):
    module("posbench/data/task_sort.py")
    data = prepare(posbench.compose(["dataset=task_sort"]).dataset)
    tokens, answers = data.eval_instances(40, 400)
    assert tokens.shape == (10, 41) and data.vocab_size == FIRST + 16
    for row, answer in zip(tokens, answers):
        k = (41 - 2) // 2
        seq = row[:2 * k + 2]  # from position 0, padded after
        assert seq[0] == BOS and seq[k + 1] == SEP and (row[2 * k + 2:] == PAD).all()
        assert np.array_equal(seq[k + 2:], np.sort(seq[1:k + 1]))
        assert np.array_equal(np.flatnonzero(answer), np.arange(k + 2, 2 * k + 2))
    with pytest.raises(ConfigError, match="eval.protocol"):
        posbench.compose(["dataset=task_sort", "eval.protocol=sliding", "eval.stride=8"])


class Repeat(torch.nn.Module):
    """Predicts that the next token is the current one."""

    def __init__(self):
        super().__init__()
        self.encoding = type("NoEncoding", (), {"set_eval_options": lambda *a: None})()
        self.blocks = torch.nn.ModuleList()  # no attention layer to set eval options on

    def forward(self, x):
        return torch.nn.functional.one_hot(x, 256).float()


def test_the_evaluation_example_counts_right_top_predictions(module, toy, stdlib_data):
    module("posbench/evaluations/top1.py")
    with pytest.raises(ConfigError, match="eval.top1.windows=0"):
        posbench.compose(["eval.top1.windows=0"])
    cfg = posbench.compose([*toy, "eval.top1.enabled=true", "eval.top1.windows=3"])
    top1 = next(e for e in evaluations.plan(cfg, stdlib_data) if e.key == "top1")
    points = top1.run(Repeat(), torch.device("cpu"))
    tokens = np.asarray(stdlib_data.tokens)
    for point, n in zip(points, [32, 64]):
        rows = np.stack([tokens[s:s + n + 1] for s in window_starts(stdlib_data, n, 3 * n)])
        assert point["length"] == n
        assert point["top1"] == pytest.approx(np.mean(rows[:, 1:] == rows[:, :-1]), rel=1e-6)
    model = posbench.build_model(cfg, stdlib_data.vocab_size)  # the run's own evaluations too
    scores = evaluations.run(evaluations.plan(cfg, stdlib_data), model, torch.device("cpu"))
    record = results_record(cfg, model, stdlib_data, scores["curve"], train={"seq_len": 32},
                            sections=scores)
    assert record["eval"]["top1"] == scores["top1"] and len(scores["top1"]) == 2
    assert record["eval"]["retrieval"] is None  # a section that did not run


def test_the_encoding_example_outside_the_package_runs_as_the_guide_says(tmp_path, toy):
    """The guide's recipe verbatim: the example's class as mypkg.py, the config file its prose
    names with the two keys it names, `posbench train encoding=power_bias` from that folder."""
    recipe = re.search(r"outside the package plugs in through Hydra's `_target_`: put\s+"
                       r"`(_target_: mypkg\.PowerBias)` and `(name: power_bias)` in\s+"
                       r"`(conf/encoding/power_bias\.yaml)`", GUIDE)
    (tmp_path / "mypkg.py").write_text(example("posbench/encodings/power_bias.py"))
    (tmp_path / recipe[3]).parent.mkdir(parents=True)
    (tmp_path / recipe[3]).write_text(f"{recipe[1]}\n{recipe[2]}\n")
    env = {**os.environ, "PYTHONPATH": "."}
    args = ["train", "encoding=power_bias", *toy]
    proc = posbench_cli(*args, "encoding.alpha=0.7", "hydra.run.dir=run", cwd=tmp_path, env=env)
    assert "deprecated" not in proc.stderr
    assert results(tmp_path / "run")["config"]["encoding"] == {
        "_target_": "mypkg.PowerBias", "name": "power_bias", "alpha": 0.7}
    bad = posbench_cli(*args, "encoding.alpha=3", "hydra.run.dir=bad", cwd=tmp_path, env=env,
                       ok=False)
    assert bad.returncode == 2 and bad.stderr == (
        "posbench: error: encoding.alpha=3.0 is not accepted; expected 0 < alpha <= 2\n")
    assert not (tmp_path / "bad").exists()
