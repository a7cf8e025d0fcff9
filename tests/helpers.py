"""Checks and runners shared by the tests (imported as `from helpers import ...`)."""
import contextlib
import copy
import functools
import io
import json
import logging
import math
import os
from pathlib import Path
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import posbench

from posbench.cli import main


def assert_matches_reference(out, ref, inputs, rtol=1e-5, atol=1e-5, grad_rtol=1e-4,
                             grad_atol=1e-5):
    """A fast path is only right if its output and its gradients both match the dense reference."""
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    grads = torch.autograd.grad(out.square().sum(), inputs)
    ref_grads = torch.autograd.grad(ref.square().sum(), inputs)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r.to(g.dtype), rtol=grad_rtol, atol=grad_atol)
    return grads


def assert_shift_invariant(model, idx, offsets=(1, 17, 1000), per_sequence=False, tol=1e-5):
    """A relative encoding must give the same logits when every position moves by the same c
    (within tol, relative to logits above 1; a float64 model holds to far less).
    per_sequence: also when each sequence has its own offset, 10^6 apart (lag tables must span
    one sequence, not the gap between them)."""
    B, T = idx.shape
    shifts = [torch.arange(T) + c for c in offsets]
    if per_sequence:
        shifts.append(torch.arange(T) + 10**6 * torch.arange(B).view(B, 1))
    with torch.no_grad():
        base = model(idx)
        for pos in shifts:
            shifted = model(idx, pos=pos)
            assert ((shifted - base).abs() <= tol * base.abs().clamp(min=1)).all(), pos[..., 0]
    return base


@functools.lru_cache(maxsize=None)
def _composition(overrides):
    return posbench.compose(list(overrides))


def composed(*overrides):
    """posbench.compose(overrides), composed once per test process and copied on each call:
    Hydra's composition is most of the cost of building a small model, and the registry-wide
    tests build every encoding many times (at collection too). Not for a test whose working
    directory or environment changes what composition finds."""
    return copy.deepcopy(_composition(overrides))


def registered_encoding(name, n_head=4):
    """Encoding `name` built from its registered config alone (two layers of width 32), without
    composing a run's config: about 0.2 ms where a composition takes 0.2 s, for the lists that
    parametrize tests at collection, which every pytest-xdist worker collects."""
    from posbench.encodings import registry
    from posbench.encodings.base import Dims

    entry = registry()[name]
    return entry.cls(entry.config, Dims(n_layer=2, n_head=n_head, d_model=32, train_len=32,
                                        max_len=64))


def random_encoding(name, n_head, n_layer=1, d_model=16, vocab=64):
    """A float64 encoding `name` as a small model builds it, its learned parameters drawn from a
    normal (they start at zero, where a learned bias would test nothing)."""
    cfg = composed(f"encoding={name}", f"model.n_layer={n_layer}", f"model.d_model={d_model}",
                   f"model.n_head={n_head}", "train.seq_len=32", "eval.lengths=[64]")
    torch.manual_seed(0)
    enc = posbench.build_model(cfg, vocab).encoding.double()
    for p in enc.parameters():
        torch.nn.init.normal_(p)
    return enc


def window_starts(data, length, tokens):
    """Where the nonoverlapping windows that evaluation scores at `length` start in data.tokens
    (eval.tokens=tokens)."""
    from posbench.evaluations.perplexity import eval_plan

    return eval_plan(data, length, {"lengths": [length], "tokens": tokens}).starts


# the toy run of the CLI tests (conftest's `toy`); device=cpu: with device=auto a visible GPU
# would train every CLI test on CUDA
TOY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "train.steps=3",
       "train.batch_size=2", "train.seq_len=32", "train.warmup_steps=1", "eval.lengths=[32,64]",
       "eval.tokens=256", "device=cpu"]


def posbench_cli(*args, cwd, env=None, timeout=600, ok=True, in_process=False, **kwargs):
    """The installed `posbench ARGS` in a subprocess; with ok, it must exit 0. in_process: through
    run_in_process instead (no start-up of its own, about 2 s of imports), for a test whose point
    is not the installed command or the process boundary; env and kwargs are for a subprocess."""
    if in_process:
        assert env is None and not kwargs, "a subprocess's env and options"
        proc = run_in_process(list(args), cwd=cwd)
    else:
        proc = subprocess.run([shutil.which("posbench"), *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout, **kwargs)
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def run_in_process(argv, monkeypatch=None, capsys=None, cwd=None):
    """`posbench ARGV` through the console script's own function, in this process, as a
    CompletedProcess (returncode: its exit status). From a test, with its monkeypatch and capsys;
    from a fixture of any scope, without them: sys.argv is then patched for the call alone, and
    stdout and stderr are read as a subprocess's would be, with what its own child processes
    write (`posbench reproduce` runs `posbench train`). cwd: the folder it runs in, the caller's
    restored after (relative run dirs, conf/). The root logger's handlers are restored after too:
    a run's Hydra points them at the stdout it ran under, which the caller's logs must not reach."""
    root = logging.getLogger()
    handlers, level, here = root.handlers[:], root.level, os.getcwd()
    with contextlib.ExitStack() as stack:
        if monkeypatch is None:
            monkeypatch = stack.enter_context(pytest.MonkeyPatch.context())
        if capsys is None:
            captured = stack.enter_context(_output_in_files())
        monkeypatch.setattr(sys, "argv", ["posbench", *argv])
        try:
            if cwd is not None:
                os.chdir(cwd)
            main()
            code = 0
        except SystemExit as exit:
            code = exit.code
        finally:
            os.chdir(here)
            root.handlers[:] = handlers
            root.setLevel(level)
    out, err = capsys.readouterr() if capsys is not None else captured
    return subprocess.CompletedProcess(argv, code, out, err)


@contextlib.contextmanager
def _output_in_files():
    """sys.stdout and sys.stderr, and file descriptors 1 and 2 that child processes inherit,
    written to two temporary files, in the order written; the yielded list holds their text once
    the block has ended."""
    texts = []
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        files = (out, err)
        streams = [io.TextIOWrapper(io.FileIO(f.fileno(), "w", closefd=False), encoding="utf-8",
                                    write_through=True) for f in files]
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        try:
            for fd, f in zip((1, 2), files):
                os.dup2(f.fileno(), fd)
            with contextlib.redirect_stdout(streams[0]), contextlib.redirect_stderr(streams[1]):
                yield texts
        finally:
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)
            for stream in streams:  # closed: a stream still held somewhere fails, never writes
                stream.close()      # into whatever file reuses the descriptor
        for f in files:
            f.seek(0)
            texts.append(f.read().decode("utf-8", errors="replace"))


def cpuinfo_model():
    """The processor's model name as /proc/cpuinfo gives it (read here, apart from
    posbench.core.device), or None off Linux."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return None
    return next(line.split(":", 1)[1].strip() for line in cpuinfo.open()
                if line.startswith("model name"))


def results(run_dir):
    """The results.json a run wrote into run_dir."""
    return json.loads((run_dir / "results.json").read_text())


def wandb_records(run_file):
    """The protobuf records of an offline wandb run file (run-*.wandb): a 7-byte W&B header, then
    LevelDB's log format (32 KiB blocks; each chunk: crc32, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, parts = Path(run_file).read_bytes(), 32768, 7, []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def finished_wandb_records(run_file, timeout=30):
    """The records of an offline run file once its exit record is in: wandb's service process
    may still be writing the file's tail when run.finish() returns."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(wandb_records(run_file))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{run_file} has no exit record"
        time.sleep(0.2)


def wandb_summary(run_dir):
    """The final summary of the one offline wandb run below run_dir, read from its run file."""
    (run_file,) = Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")
    return wandb_file_summary(run_file)


def wandb_file_summary(run_file):
    """The final summary of an offline wandb run file (run-*.wandb)."""
    summary = {}
    for record in finished_wandb_records(run_file):
        if record.WhichOneof("record_type") == "summary":
            summary.update({item.key: json.loads(item.value_json)
                            for item in record.summary.update})
    return summary


def wandb_history(run_file):
    """The history rows ({key: value}, `_step` among them) of an offline wandb run file."""
    rows = []
    for record in finished_wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def tiny_model(*extra, name, seed=0):
    """The GPT with encoding `name` at 2 layers of 64 wide, 4 heads, vocabulary 64, in eval mode."""
    cfg = posbench.compose([f"encoding={name}", "model.n_layer=2", "model.d_model=64",
                            "model.n_head=4", *extra])
    torch.manual_seed(seed)
    return posbench.build_model(cfg, vocab_size=64).eval()


def assert_position_ids_are_never_read(model):
    """The logits stay the same whatever position ids come with the tokens."""
    idx = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(idx)
        for pos in (torch.arange(48) + 10**4, torch.randperm(48), torch.zeros(48).long()):
            assert torch.equal(model(idx, pos=pos), base)


def plane_rotations(d, planes, positions):
    """The float64 d x d rotation M(t) of each position t (a 1-D sequence): in each plane
    (a, b, omega), x_a' = x_a cos(t omega) - x_b sin(t omega) and x_b' = x_a sin + x_b cos; the
    identity elsewhere. Stacked (T, d, d): the oracle of the rotary encodings' tests."""
    mats = []
    for t in [float(t) for t in positions]:
        m = torch.eye(d, dtype=torch.float64)
        for a, b, omega in planes:
            c, s = math.cos(t * omega), math.sin(t * omega)
            m[a, a], m[a, b], m[b, a], m[b, b] = c, -s, s, c
        mats.append(m)
    return torch.stack(mats)


def assert_turned_by(mats, q, k, got_q, got_k):
    """got_q, got_k are q, k turned by the rotations `mats` (plane_rotations), and the gradient
    into q (which requires grad) is turned back by their transposes; float64, to 1e-10."""
    for got, x in ((got_q, q), (got_k, k)):
        torch.testing.assert_close(got, torch.einsum("tij,bhtj->bhti", mats, x), rtol=1e-10,
                                   atol=1e-10)
    g = torch.randn_like(q)
    (grad,) = torch.autograd.grad((got_q * g).sum(), q)
    torch.testing.assert_close(grad, torch.einsum("tji,bhtj->bhti", mats, g), rtol=1e-10,
                               atol=1e-10)


def finite_at_16l(*overrides):
    """Whether model=tiny with these overrides, trained length 128, gives finite logits over a
    window of 2048 tokens (16L), at a seeded init."""
    cfg = posbench.compose([*overrides, "model=tiny", "train.seq_len=128", "eval.lengths=[2048]"])
    torch.manual_seed(0)
    model = posbench.build_model(cfg, vocab_size=64).eval()
    idx = torch.randint(0, 64, (1, 2048), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return bool(torch.isfinite(model(idx)).all())


class Copier(torch.nn.Module):
    """Oracle: at each of the `last` positions (all when None), predicts the token that followed
    the longest earlier match of the context's suffix (an ideal induction head), with
    probability 0.99; `hidden` returns the logits over 256 byte tokens."""
    head = torch.nn.Identity()

    def __init__(self, last=None):
        super().__init__()
        self.last = last

    def hidden(self, x):
        B, T = x.shape
        logits = torch.zeros(B, T, 256)
        for b, row in enumerate(x.tolist()):
            for t in range(T - (self.last or T), T):
                best, pick = 0, None
                for s in range(t):
                    n = 0
                    while n <= s and row[s - n] == row[t - n]:
                        n += 1
                    if n >= best and n > 0:
                        best, pick = n, row[s + 1]
                if pick is not None:
                    logits[b, t, pick] = math.log(99 * 255)  # probability 0.99
        return logits


class Blind(torch.nn.Module):
    """Oracle that ignores the context: the same distribution over 256 tokens everywhere."""
    head = torch.nn.Identity()

    def hidden(self, x):
        return torch.linspace(0, 1, 256).expand(*x.shape, 256)


def off_init(model):
    """The model's learned position values moved off their init, so that a check sees them act:
    the encoding's parameters (T5's bias and CoPE's table start at 0) by N(0, 0.3^2), and the
    attention sinks (N(0, 0.02^2) at init) by a few logits."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.encoding.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
        for block in model.blocks:
            if block.attn.sinks is not None:
                block.attn.sinks.add_(torch.randn(block.attn.sinks.shape, generator=gen) * 2)
    return model


def killed_in_step(monkeypatch, n):
    """Training's step raises in its n-th call from now on (a kill mid-run); the step it wraps is
    returned, for the test to put back."""
    import posbench.runs.train

    real, calls = posbench.runs.train.train_step, []

    def dies(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(posbench.runs.train, "train_step", dies)
    return real
