"""Atomic writes: a temporary file in the same folder, fsync, rename. A crash leaves the old file
or the new one, never half of either; a failed write (a full disk) removes its temporary file,
keeps the old file and says so in one line. And the lock file that keeps a run dir to one
process."""
from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional


class WriteError(OSError):
    """A write that failed, in one line naming the file and saying what is left in its place."""


def write_failed(path: Path, err: OSError) -> WriteError:
    """`err` (raised while writing `path`, not yet renamed into place) as a WriteError."""
    if isinstance(err, WriteError):  # a nested write already said which file failed
        return err
    left = (f"the previous {path.name} is unchanged" if path.exists()
            else f"no partial {path.name} was left")
    error = WriteError(f"could not write {path} ({err.strerror or err}); {left}")
    error.errno = err.errno
    return error


@contextmanager
def atomic_path(path: os.PathLike):
    """Yields a temporary path to write; renamed onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # a full disk may only show here, when the data is flushed
        os.chmod(tmp, 0o644)  # mkstemp makes it private; results are for everyone to read
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise write_failed(path, err) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2) + "\n")


class LockHeld(Exception):
    """The lock file is held by a live process: str() is its owner ("pid N on host H")."""


class FileLock:
    """An exclusive flock on `path`, a file that names its owner (pid and host), until release().
    The kernel drops a flock when its process dies, so a killed owner leaves a stale file that
    the next FileLock takes over (`stale_owner` then names the dead owner), never a lock."""

    def __init__(self, path: os.PathLike):
        self.path = Path(path)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.read(fd, 256).decode(errors="replace").strip()
                os.close(fd)
                # empty: its owner has locked it and not yet written itself
                raise LockHeld(owner or "another process") from None
            if self._is_current(fd):
                break
            os.close(fd)  # its owner released (removed) it between our open and flock: again
        self.fd: Optional[int] = fd
        self.stale_owner = os.read(fd, 256).decode(errors="replace").strip() or None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)

    def _is_current(self, fd: int) -> bool:
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            return False

    def release(self) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)  # first: a process that opens it after sees a new file
        os.close(self.fd)
        self.fd = None
