"""dataset=pystdlib: a real corpus on every machine with Python."""
from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path

from posbench.data.base import register
from posbench.data.corpus import TextCorpus
from posbench.data.documents import Documents, files_documents


SKIPPED = {"site-packages", "dist-packages", "__pycache__"}  # third-party packages; bytecode


@register("pystdlib", "the running interpreter's standard library source, byte level, split into "
          "train/val by file")
class PyStdlib(TextCorpus):
    """One document per .py file of the standard library; installed third-party packages are
    left out."""

    def documents(self) -> Documents:
        return stdlib_documents()


# the running interpreter's library does not change under it: walked and hashed once a process
# (0.16 s, which a sweep or test session run in one process paid at every run's start)
@functools.lru_cache(maxsize=1)
def stdlib_documents() -> Documents:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        # pruned, not walked and filtered (0.5 s as rglob)
        subfolders[:] = [s for s in subfolders if s not in SKIPPED]
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    return files_documents(sorted(files), root)
