"""Progress as a log file reads it, and posbench's own --help, through the installed command."""
import dataclasses
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import posbench
from posbench import data
from posbench.config import EvalConfig
from posbench.encodings import registry
from posbench.core.progress import Bar
from helpers import posbench_cli, results, run_in_process

CONF = Path(posbench.__file__).parent / "conf"
TIME = r"\d\d:\d\d"


def test_a_log_file_gets_one_plain_line_per_log_step_and_per_eval_length(tmp_path, toy):
    log = tmp_path / "train.log"
    with open(log, "w") as out:  # a file, as under SLURM or `> train.log 2>&1`
        proc = subprocess.run([shutil.which("posbench"), "train", *toy, "train.steps=10",
                               "train.log_every=4", "eval.lengths=[32,64]", "hydra.run.dir=run"],
                              cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "\r" not in text
    train = re.findall(rf"^train rope: step (\d+)/10 loss=(\S+) lr=\S+ tok_s=\d+ elapsed={TIME} "
                       rf"eta={TIME}$", text, flags=re.M)
    evals = re.findall(rf"^eval: length (\d+) \((\d)/2\) ppl=(\S+) elapsed={TIME} eta={TIME}$",
                       text, flags=re.M)
    assert [int(step) for step, _ in train] == [4, 8, 10]  # every log_every steps, and the last
    assert [(int(n), int(i)) for n, i, _ in evals] == [(32, 1), (64, 2)]
    record = results(tmp_path / "run")
    assert float(train[-1][1]) == round(record["train"]["final_loss"], 3)
    assert [float(ppl) for *_, ppl in evals] == [round(p["ppl"], 3) for p in record["eval"]["curve"]]
    # nothing else writes progress: those lines, then the closing table
    assert sum(1 for line in text.splitlines() if line.startswith(("train ", "eval:"))) == 5


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_keeps_tqdm_and_a_file_gets_lines(monkeypatch):
    for stream, tty in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        bar = Bar("train rope", 4, "step", initial=1)
        for _ in range(3):
            bar.update()
        bar.log(loss="1.250")
        bar.close()
        out = stream.getvalue()
        if tty:
            assert "\r" in out and "4/4" in out and "loss=1.250" in out and "eta=" not in out
        else:
            assert re.fullmatch(rf"train rope: step 4/4 loss=1.250 elapsed={TIME} eta=00:00\n", out)


def test_train_help_is_posbenchs_and_names_every_option(tmp_path):
    proc = posbench_cli("train", "--help", cwd=tmp_path)
    out = proc.stdout
    assert out.startswith("posbench train [overrides]:") and "powered by Hydra" not in out
    groups = dict(re.findall(r"^(\w+): (.+)$", out, flags=re.M))
    assert groups["encoding"].split(", ") == sorted(registry())
    assert groups["dataset"].split(", ") == sorted(data.registry())
    for group in ("model", "logger", "experiment"):
        assert groups[group].split(", ") == sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    for key in ("encoding", "model", "dataset", "seed", "device", "train.seq_len", "train.steps",
                "train.batch_size", "train.lr", "eval.lengths", "eval.tokens", "eval.protocol",
                "logger"):
        assert re.search(rf"^{re.escape(key)} +\S", out, flags=re.M), key
    assert "posbench train -m " in out and "posbench eval RUN_DIR" in out
    assert "posbench report " in out and "steps: 2000" in out  # examples, then the config
    assert not (tmp_path / "outputs").exists()


def test_eval_help_is_posbenchs_with_or_without_a_run_dir(tmp_path, monkeypatch, capsys):
    for args in (["--help"], [str(tmp_path), "-h"]):
        proc = run_in_process(["eval", *args], monkeypatch, capsys)
        out = proc.stdout
        assert proc.returncode == 0 and out.startswith("posbench eval RUN_DIR [overrides]:")
        for field in dataclasses.fields(EvalConfig):
            assert re.search(rf"^eval\.{field.name}\s+\S", out, flags=re.M), field.name
