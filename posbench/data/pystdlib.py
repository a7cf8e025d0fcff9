"""dataset=pystdlib: a real corpus on every machine with Python."""
from __future__ import annotations

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
        root = Path(sysconfig.get_paths()["stdlib"])
        files = []
        for folder, subfolders, names in os.walk(root):
            # pruned, not walked and filtered: the walk is every run's start (0.5 s as rglob)
            subfolders[:] = [s for s in subfolders if s not in SKIPPED]
            files += [Path(folder, name) for name in names if name.endswith(".py")]
        return files_documents(sorted(files), root)
