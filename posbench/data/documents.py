"""Documents: what every text corpus gives (posbench/data/corpus.py), and the local files a
`dataset.path` names.

A corpus's documents have an `identity`, (name, sha256 digest) pairs that change whenever the
documents do and are cheap to get (file contents, a hub dataset's fingerprint): they name the
token cache. And `read()`, which streams (key, split, bytes): split is "train" or "val" where the
source fixes it (a hub dataset's own splits), None where posbench splits by the key
(posbench/data/tokens.py).
"""
from __future__ import annotations

import glob
import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

from posbench.core.errors import ConfigError

Document = Tuple[str, Optional[str], bytes]


@dataclass
class Documents:
    identity: List[Tuple[str, bytes]]
    read: Callable[[], Iterator[Document]]


def file_digest(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.digest()


def files_documents(files: List[Path], root: Path) -> Documents:
    """One document per file, keyed by its path below `root`, split by that key."""
    keys = [p.relative_to(root).as_posix() for p in files]
    identity = [(k, file_digest(p)) for k, p in zip(keys, files)]
    return Documents(identity, lambda: ((k, None, p.read_bytes()) for k, p in zip(keys, files)))


def local_files(path: str, suffixes: Tuple[str, ...] = ()) -> Tuple[List[Path], Path]:
    """The files a `dataset.path` names: one file, every file below a folder, or a glob; and
    the folder their keys are relative to. Hidden files are left out."""
    given = Path(path).expanduser()
    if given.is_file():
        files, root = [given], given.parent
    elif given.is_dir():
        files, root = [p for p in given.rglob("*") if p.is_file()], given
    else:
        files = [Path(p) for p in glob.glob(str(given), recursive=True) if Path(p).is_file()]
        root = Path(*itertools.takewhile(lambda part: not glob.has_magic(part), given.parts))
    files = sorted(p for p in files if not any(part.startswith(".") for part in
                                                p.relative_to(root).parts)
                   and (not suffixes or p.name.endswith(suffixes)))
    if not files:
        kinds = f" ({', '.join(suffixes)})" if suffixes else ""
        raise ConfigError(f"dataset.path={path!r} is not accepted: it names no files{kinds}; "
                          "expected a file, a folder or a glob")
    return files, root
