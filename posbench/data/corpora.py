"""Corpora: each returns a sorted list of (document key, bytes)."""
from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Callable, Dict, List, Tuple

Documents = List[Tuple[str, bytes]]


def pystdlib(dataset_cfg) -> Documents:
    """The running interpreter's standard library source: a real corpus on every machine with
    Python. One document per .py file; installed third-party packages are left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    return [(str(p.relative_to(root)), p.read_bytes()) for p in files]


CORPORA: Dict[str, Callable[..., Documents]] = {"pystdlib": pystdlib}
