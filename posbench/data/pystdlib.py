"""dataset=pystdlib: a real corpus on every machine with Python."""
from __future__ import annotations

import sysconfig
from pathlib import Path

from posbench.data.base import register
from posbench.data.corpus import TextCorpus
from posbench.data.documents import Documents, files_documents


@register("pystdlib", "the running interpreter's standard library source, byte level, split into "
          "train/val by file")
class PyStdlib(TextCorpus):
    """One document per .py file of the standard library; installed third-party packages are
    left out."""

    def documents(self) -> Documents:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*.py")
                       if "site-packages" not in p.parts and "dist-packages" not in p.parts)
        return files_documents(files, root)
