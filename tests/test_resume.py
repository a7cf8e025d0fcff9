"""Crash safety through the `posbench` command: a run killed with SIGKILL or stopped with Ctrl-C
resumes bit for bit (and continues its wandb run), finished runs are skipped, failed ones
resumed, a sweep goes on past a failing job, and a bad run dir or a full disk is refused in one
line with nothing overwritten."""
import json
import os
import random
import resource
import shutil
import shlex
import signal
import subprocess
import time

import pytest
import torch

from posbench.runs.checkpoint import load_checkpoint, save_checkpoint
from posbench.runs.train import check_finite
from posbench.runs.trainlog import read_metrics
from helpers import posbench_cli, results, run_in_process, wandb_history

POSBENCH = shutil.which("posbench")
# one thread: the same CPU kernels in every process, and no OpenMP spinning on shared cores
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# randomized draws its positions from torch's RNG at every step, so a resume that lost the RNG
# state would diverge; log_every=7 leaves a loss window open at most checkpoints
RUN = ["encoding=randomized", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
       "train.batch_size=2", "train.seq_len=32", "train.warmup_steps=10", "train.steps=300",
       "train.ckpt_every=5", "train.log_every=7", "eval.lengths=[32,64]", "eval.tokens=256",
       "device=cpu"]


def posbench_train(args, cwd, **kwargs):
    """`posbench train ARGS` on one thread; with ok (the default), it must exit 0."""
    return posbench_cli("train", *args, cwd=cwd, env=ENV, timeout=300, **kwargs)


def error_lines(proc):
    assert "Traceback" not in proc.stdout + proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith("posbench: error:")]


def files(run_dir):
    return {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def same_training(a, b):
    assert a["eval"]["curve"] == b["eval"]["curve"]  # floats compared exactly
    assert a["train"]["final_loss"] == b["train"]["final_loss"]


def same_log(run_dir, reference):
    """metrics.csv of a resumed run: the rows of an uninterrupted one, none twice (tokens per
    second aside, which times the sitting that wrote the row)."""
    rows = [{k: v for k, v in row.items() if k != "tokens_per_second"}
            for row in read_metrics(run_dir / "metrics.csv")]
    assert rows == [{k: v for k, v in row.items() if k != "tokens_per_second"}
                    for row in read_metrics(reference / "metrics.csv")]
    assert any(row["val_loss"] is not None for row in rows)  # train.val_every's default, 250


@pytest.fixture(scope="module")
def finished(tmp_path_factory, stdlib_data):
    """An uninterrupted run: the reference every resumed run must equal."""
    cwd = tmp_path_factory.mktemp("finished")
    posbench_train([*RUN, "hydra.run.dir=run"], cwd)
    return cwd / "run"


def copy_of(run_dir, tmp_path):
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


def test_a_run_killed_at_a_random_step_resumes_bit_for_bit(finished, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([POSBENCH, "train", *RUN, f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoint.pt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.005)
    time.sleep(random.uniform(0, 0.3))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "results.json").exists(), "the run finished before it was killed"
    killed_at = load_checkpoint(run_dir / "checkpoint.pt")["step"]

    proc = posbench_train([*RUN, f"hydra.run.dir={run_dir}"], tmp_path)
    assert f"took over the stale lock of run dir {str(run_dir)!r}: pid " in proc.stdout
    assert f"posbench: resuming from step {killed_at} of 300 (checkpoint.pt)" in proc.stdout
    record = results(run_dir)
    assert record["status"] == "ok"
    assert record["train"]["resumed_from_step"] == killed_at > 0
    same_training(record, results(finished))
    same_log(run_dir, finished)
    assert not list(run_dir.glob(".*.*")), "a temporary file was left behind"


def interrupted_after_a_checkpoint(args, run_dir, cwd, signum=signal.SIGINT):
    """`posbench train` stopped with Ctrl-C (SIGINT, or `signum`) once it saved a checkpoint: its
    output. run_dir None: no hydra.run.dir, the run's own dir under cwd/outputs/."""
    where = [] if run_dir is None else [f"hydra.run.dir={run_dir}"]
    checkpoints = "outputs/*/*/checkpoint.pt" if run_dir is None else \
        str((run_dir / "checkpoint.pt").relative_to(cwd))
    # SIGINT back to its default in the child: a shell without job control starts background
    # jobs (CI, perhaps) with it ignored, and the child would inherit that
    proc = subprocess.Popen([POSBENCH, "train", *args, *where], cwd=cwd, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not list(cwd.glob(checkpoints)):
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.005)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    return out, err


def test_ctrl_c_says_what_it_kept_and_the_command_that_resumes_in_one_line_and_it_does(
        finished, tmp_path):
    """With no hydra.run.dir given, the same command again would start a new timestamped dir:
    the line names the command with this run's dir, and that command resumes bit for bit."""
    out, err = interrupted_after_a_checkpoint(RUN, None, tmp_path)
    assert "Traceback" not in out + err
    (run_dir,) = tmp_path.glob("outputs/*/*")
    (line,) = [line for line in err.splitlines() if line.startswith("posbench: interrupted")]
    record = results(run_dir)
    assert record["status"] == "interrupted" and record["error"] == "KeyboardInterrupt"
    kept = record["train"]["checkpoint_step"]
    assert f"its checkpoint at step {kept} is kept" in line and "stopped at step" in line
    assert load_checkpoint(run_dir / "checkpoint.pt")["step"] == kept > 0
    command = line.split("`")[1]
    assert command == shlex.join(["posbench", "train", *RUN, f"hydra.run.dir={run_dir}"])
    subprocess.run(shlex.split(command), cwd=tmp_path, env=ENV, check=True, capture_output=True,
                   timeout=300)
    assert results(run_dir)["train"]["resumed_from_step"] == kept
    same_training(results(run_dir), results(finished))
    assert list(tmp_path.glob("outputs/*/*")) == [run_dir]


def test_sigterm_stops_a_run_as_ctrl_c_does_and_the_resumed_run_continues_its_wandb_run(
        tmp_path):
    """SLURM's preemption and `docker stop` send SIGTERM: the run records that it was
    interrupted, releases its lock and resumes, in the same wandb run."""
    args, run_dir = [*RUN, "logger=wandb"], tmp_path / "run"
    _, err = interrupted_after_a_checkpoint(args, run_dir, tmp_path, signal.SIGTERM)
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("posbench: interrupted")]
    assert "stopped at step" in line and "SIGTERM" in line
    record = results(run_dir)
    assert record["status"] == "interrupted" and record["error"] == "KeyboardInterrupt: SIGTERM"
    assert not (run_dir / "run.lock").exists()
    proc = posbench_train([*args, f"hydra.run.dir={run_dir}"], tmp_path)
    assert "stale lock" not in proc.stdout
    assert results(run_dir)["train"]["resumed_from_step"] == record["train"]["checkpoint_step"]

    def wandb_ids(run_dir):
        return [p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")]

    run_id = (tmp_path / "run" / "wandb_run_id").read_text()
    # one wandb run, in two sittings (that each run dir has its own: test_cli's multirun)
    assert wandb_ids(tmp_path / "run") == [run_id, run_id]
    # the second sitting continues the first's step count, so that `wandb sync` of both
    # folders merges them into one run: its training rows start past the checkpoint's step
    first, second = (wandb_history(f) for f in sorted(
        (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")))
    resumed = results(tmp_path / "run")["train"]["resumed_from_step"]
    assert [row["_step"] for row in second if "train/step" in row][0] > resumed > 0
    for rows in (first, second):
        steps = [row["_step"] for row in rows]
        assert steps == sorted(set(steps))
        assert all(row["_step"] == row["train/step"] for row in rows if "train/step" in row)
    assert min(row["_step"] for row in second if "eval/length" in row) > 300  # after training


def test_a_finished_run_is_skipped_and_a_failed_one_resumed(finished, tmp_path, monkeypatch,
                                                            capsys):
    run_dir = copy_of(finished, tmp_path)
    before = files(run_dir)
    proc = run_in_process(["train", *RUN, f"hydra.run.dir={run_dir}"], monkeypatch, capsys)
    assert proc.returncode == 0 and "skipped" in proc.stdout, proc.stderr[-2000:]
    assert files(run_dir) == before

    record = results(run_dir)
    (run_dir / "results.json").write_text(json.dumps({**record, "status": "failed"}))
    posbench_train([*RUN, "hydra.run.dir=run"], tmp_path)
    resumed = results(run_dir)
    assert resumed["status"] == "ok" and resumed["train"]["resumed_from_step"] == 300
    same_training(resumed, record)


def corrupt(path):
    blob = bytearray(path.read_bytes())
    blob[-100] ^= 0xFF
    path.write_bytes(bytes(blob))


def truncate(path):
    path.write_bytes(path.read_bytes()[:-1000])


def other_version(path):
    save_checkpoint(path, {**load_checkpoint(path), "posbench": "0.0.1"})


def without_digest(path):
    (path.parent / "checkpoint.pt.sha256").unlink()


REFUSED = {
    "corrupt": ([], corrupt, "sha256 mismatch with checkpoint.pt.sha256"),
    "truncated": ([], truncate, "sha256 mismatch with checkpoint.pt.sha256"),
    "no digest": ([], without_digest, "no checkpoint.pt.sha256 beside it"),
    "other version": ([], other_version, "posbench 0.0.1"),
    "other config": (["train.lr=0.01"], None, "train.lr=0.01"),
    "resume=false": (["train.resume=false"], None, "train.resume=false"),
}


@pytest.mark.parametrize("extra,damage,needle", REFUSED.values(), ids=REFUSED.keys())
def test_a_run_dir_that_cannot_be_resumed_is_refused_in_one_line(finished, tmp_path, monkeypatch,
                                                                  capsys, extra, damage, needle):
    run_dir = copy_of(finished, tmp_path)
    (run_dir / "results.json").unlink()  # a run killed after its last checkpoint
    if damage:
        damage(run_dir / "checkpoint.pt")
    before = files(run_dir)
    proc = run_in_process(["train", *RUN, *extra, f"hydra.run.dir={run_dir}"], monkeypatch, capsys)
    assert proc.returncode == 2
    assert error_lines(proc) == proc.stderr.strip().splitlines(), proc.stderr
    assert len(error_lines(proc)) == 1 and needle in proc.stderr
    assert files(run_dir) == before


def test_a_non_finite_loss_names_its_step_and_the_last_good_loss():
    losses = torch.tensor([2.0, 1.5, float("inf"), float("nan")])
    with pytest.raises(FloatingPointError, match=r"inf at step 13; last good loss 1.5000$"):
        check_finite(losses, 10, None)
    with pytest.raises(FloatingPointError, match=r"nan at step 11; last good loss 3.0000$"):
        check_finite(losses[3:], 10, 3.0)
    assert check_finite(losses[:2], 10, None) == 1.5


def test_a_sweep_goes_on_past_a_failed_job_and_resumes_it_when_started_again(tmp_path,
                                                                             stdlib_data):
    sweep = ["-m", *RUN, "train.steps=20", "train.ckpt_every=1", "eval.lengths=[32]",
             "train.lr=1e-3,1e30", "hydra.sweep.dir=sweep"]
    proc = posbench_cli("train", *sweep, cwd=tmp_path, ok=False, in_process=True)
    assert proc.returncode == 1 and len(error_lines(proc)) == 1
    jobs = {results(p.parent)["config"]["train"]["lr"]: p.parent
            for p in (tmp_path / "sweep").rglob("results.json")}
    assert results(jobs[1e-3])["status"] == "ok"
    failed = results(jobs[1e30])
    assert failed["status"] == "failed" and "non-finite training loss" in failed["error"]
    saved = load_checkpoint(jobs[1e30] / "checkpoint.pt")  # the last good one, kept
    assert 0 < saved["step"] == failed["train"]["checkpoint_step"] == failed["train"]["steps_done"]
    assert all(torch.isfinite(p).all() for p in saved["model"].values())
    assert "Failed, interrupted or refused runs" in (tmp_path / "sweep" / "summary.md").read_text()

    ok_before = files(jobs[1e-3])
    proc = posbench_cli("train", *sweep, "train.resume=true", cwd=tmp_path, ok=False,
                        in_process=True)  # same job dirs
    assert proc.returncode == 1 and len(error_lines(proc)) == 1
    assert "skipped" in proc.stdout and files(jobs[1e-3]) == ok_before
    again = results(jobs[1e30])
    assert again["status"] == "failed" and again["train"]["resumed_from_step"] == saved["step"]


def limit_file_size():
    limit = 64 * 1024  # room for .hydra/ and results.json, not for a checkpoint
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_full_disk_fails_in_one_line_and_leaves_no_partial_file(tmp_path, stdlib_data):
    proc = posbench_train([*RUN, "hydra.run.dir=run"], tmp_path, ok=False,
                          preexec_fn=limit_file_size)
    assert proc.returncode == 1
    [line] = error_lines(proc)
    assert "at step 5 of 300" in line
    assert (f"could not write {tmp_path / 'run' / 'checkpoint.pt'} (File too large); no partial "
            "checkpoint.pt was left") in line
    run_dir = tmp_path / "run"
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "metrics.csv", "results.json"]
    record = results(run_dir)
    assert record["status"] == "failed" and "File too large" in record["error"]


