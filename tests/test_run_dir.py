"""A run dir from Python and under contention: posbench.load_run gives the trained model, its
config and results; checkpoint.pt is a plain torch file with its digest beside it; one process at
a time trains a run dir (a killed owner's stale lock is taken over); a full disk leaves the
previous file in place and says so in one line."""
import errno
import hashlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import posbench
from posbench.runs.checkpoint import load_checkpoint, save_checkpoint
from posbench.cli import main
from posbench.core.errors import CheckpointError, ConfigError
from posbench.data.tokens import write_token_dir
from posbench.core.io import write_json
from conftest import TOY
from helpers import results, run_in_process

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def files(run_dir):
    return {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def error_lines(proc):
    assert "Traceback" not in proc.stdout + proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith("posbench: error:")]


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, stdlib_data):
    """A finished toy run, trained through the console script's own function."""
    root = tmp_path_factory.mktemp("load_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["posbench", "train", *TOY, f"hydra.run.dir={root / 'run'}"])
        main()
    return root / "run"


def test_load_run_gives_the_trained_model_its_config_and_results(run_dir):
    before = files(run_dir)
    run = posbench.load_run(run_dir)
    assert run.results == results(run_dir)
    assert OmegaConf.to_container(run.config) == run.results["config"]
    assert not run.model.training
    assert {p.device.type for p in run.model.parameters()} == {"cpu"}

    # the model posbench eval scores: the run's config, the checkpoint's weights
    reference = posbench.build_model(posbench.compose(TOY))
    reference.load_state_dict(torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"])
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(run.model(idx), reference.eval()(idx))
    assert next(posbench.load_run(str(run_dir), device="meta").model.parameters()).is_meta
    assert files(run_dir) == before


def test_checkpoint_pt_is_a_plain_torch_file_with_its_sha256_beside_it(run_dir):
    blob = (run_dir / "checkpoint.pt").read_bytes()
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert state["step"] == 3 and state["config"]["train"]["steps"] == 3
    assert (run_dir / "checkpoint.pt.sha256").read_text() == \
        f"{hashlib.sha256(blob).hexdigest()}  checkpoint.pt\n"  # `sha256sum -c` reads this


def test_load_run_refuses_an_unfinished_run_or_a_corrupt_checkpoint_in_one_line(run_dir,
                                                                                tmp_path):
    copy = shutil.copytree(run_dir, tmp_path / "run")
    blob = bytearray((copy / "checkpoint.pt").read_bytes())
    blob[-100] ^= 0xFF
    (copy / "checkpoint.pt").write_bytes(bytes(blob))
    before = files(copy)
    with pytest.raises(CheckpointError) as err:
        posbench.load_run(copy)
    assert str(err.value).startswith(f"checkpoint {copy / 'checkpoint.pt'} is corrupt")
    assert "sha256 mismatch" in str(err.value) and "\n" not in str(err.value)
    (copy / "results.json").unlink()
    with pytest.raises(ConfigError, match=r"holds no finished results.json \(status none\)"):
        posbench.load_run(copy)
    assert files(copy) == {k: v for k, v in before.items() if k.name != "results.json"}


class Killed(BaseException):
    """The process dying at one point of a checkpoint write."""


@pytest.mark.parametrize("dies_at", [0, 1, 2, None])
def test_a_checkpoint_write_killed_at_any_point_leaves_a_checkpoint_that_loads(tmp_path,
                                                                               monkeypatch,
                                                                               dies_at):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"step": 1})
    renames, real_replace = [], os.replace

    def replace(src, dst):
        if len(renames) == dies_at:
            raise Killed
        renames.append(pathlib.Path(dst).name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    try:
        save_checkpoint(path, {"step": 2})
    except Killed:
        pass
    monkeypatch.undo()
    assert renames == ["checkpoint.pt.sha256.next", "checkpoint.pt", "checkpoint.pt.sha256"][
        :dies_at]  # the new digest, the new checkpoint, the new digest as the checkpoint's
    assert load_checkpoint(path)["step"] == (1 if dies_at in (0, 1) else 2)
    if dies_at is None:
        assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt", "checkpoint.pt.sha256"]


def test_a_full_disk_during_training_keeps_the_last_checkpoint_byte_identical(
        tmp_path, monkeypatch, capsys, stdlib_data):
    run_dir = tmp_path / "run"
    kept, real_write = {}, pathlib.Path.write_bytes

    def write_bytes(self, data):  # the disk fills halfway through the second checkpoint
        if not self.name.startswith(".checkpoint.pt.") or not (run_dir / "checkpoint.pt").exists():
            return real_write(self, data)
        kept.update(files(run_dir))
        real_write(self, bytes(data)[:len(data) // 2])
        enospc()

    monkeypatch.setattr(pathlib.Path, "write_bytes", write_bytes)
    args = [*TOY, "train.steps=10", "train.ckpt_every=5", f"hydra.run.dir={run_dir}"]
    proc = run_in_process(["train", *args], monkeypatch, capsys)
    assert proc.returncode == 1
    [line] = error_lines(proc)
    assert "at step 10 of 10" in line
    assert (f"could not write {run_dir / 'checkpoint.pt'} (No space left on device); the previous "
            "checkpoint.pt is unchanged") in line
    for name in ("checkpoint.pt", "checkpoint.pt.sha256"):
        assert (run_dir / name).read_bytes() == kept[pathlib.Path(name)]
    assert load_checkpoint(run_dir / "checkpoint.pt")["step"] == 5
    assert results(run_dir)["train"]["checkpoint_step"] == 5
    assert not list(run_dir.glob(".*.*")) and not (run_dir / "run.lock").exists()


@pytest.mark.parametrize("fails", ["write", "fsync"])
def test_a_full_disk_keeps_the_previous_results_json(tmp_path, monkeypatch, fails):
    path = tmp_path / "results.json"
    write_json(path, {"status": "ok"})
    before = path.read_bytes()
    real_write_text = pathlib.Path.write_text

    def write_text(self, text):  # half of it reaches the disk
        real_write_text(self, text[:len(text) // 2])
        enospc()

    monkeypatch.setattr(*((pathlib.Path, "write_text", write_text) if fails == "write"
                          else (os, "fsync", enospc)))
    with pytest.raises(OSError) as err:
        write_json(path, {"status": "failed", "error": "x" * 1000})
    assert str(err.value) == (f"could not write {path} (No space left on device); the previous "
                              "results.json is unchanged")
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["results.json"]


def test_a_full_disk_while_caching_tokens_leaves_no_partial_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", enospc)
    target = tmp_path / "corpus-0123"
    docs = [np.arange(10, dtype=np.uint8)]
    with pytest.raises(OSError) as err:
        write_token_dir(target, docs, docs, 256, "sha256:0", "corpus")
    assert str(err.value) == (f"could not write {target} (No space left on device); no partial "
                              "corpus-0123 was left")
    assert os.listdir(tmp_path) == []


def test_two_processes_caching_the_same_corpus_both_succeed(tmp_path):
    """The second writer finds the first's finished cache in place of its rename: it keeps
    that one (identical by fingerprint) and leaves no temporary folder."""
    target = tmp_path / "corpus-0123"
    docs = [np.arange(10, dtype=np.uint8)]
    write_token_dir(target, docs, docs, 256, "sha256:0", "corpus")
    first = (target / "meta.json").read_bytes()
    write_token_dir(target, [np.arange(5, dtype=np.uint8)], docs, 256, "sha256:0", "corpus")
    assert (target / "meta.json").read_bytes() == first
    assert os.listdir(tmp_path) == ["corpus-0123"]


def test_a_second_process_on_a_run_dir_is_refused_and_a_killed_owners_lock_taken_over(
        tmp_path, monkeypatch, capsys, stdlib_data):
    run_dir = tmp_path / "run"
    args = [*TOY, "train.steps=40", "train.ckpt_every=5", f"hydra.run.dir={run_dir}"]
    owner = subprocess.Popen([shutil.which("posbench"), "train", *args], cwd=tmp_path, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoint.pt").exists():
            assert owner.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.005)
        owner.send_signal(signal.SIGSTOP)  # alive, holding the run dir, until killed below
        lock = (run_dir / "run.lock").read_text()
        assert lock == f"pid {owner.pid} on host {socket.gethostname()}\n"
        before = files(run_dir)
        second = run_in_process(["train", *args], monkeypatch, capsys)
        assert second.returncode == 2
        assert error_lines(second) == [
            f"posbench: error: run dir {str(run_dir)!r} is not accepted: pid {owner.pid} on host "
            f"{socket.gethostname()} is running it (its run.lock); expected one process per run "
            "dir: wait for that one to end, or stop it (nothing was overwritten)"]
        assert files(run_dir) == before
    finally:
        owner.kill()
        owner.wait()
    killed_at = load_checkpoint(run_dir / "checkpoint.pt")["step"]

    third = run_in_process(["train", *args], monkeypatch, capsys)
    assert third.returncode == 0, third.stderr
    assert (f"posbench: took over the stale lock of run dir {str(run_dir)!r}: pid {owner.pid} on "
            f"host {socket.gethostname()} is gone") in third.stdout.splitlines()
    record = results(run_dir)
    assert record["status"] == "ok" and record["train"]["resumed_from_step"] == killed_at > 0
    assert not (run_dir / "run.lock").exists()
