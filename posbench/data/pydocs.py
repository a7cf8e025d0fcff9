"""dataset=pydocs: English prose without a network, from Debian's python3-doc package."""
from __future__ import annotations

import glob
import re
from pathlib import Path

from posbench.data.base import register
from posbench.data.corpus import TextCorpus
from posbench.data.documents import Documents, files_documents
from posbench.core.errors import ConfigError

PYDOCS = "/usr/share/doc/python3*/html/_sources"


@register("pydocs", "English prose: the Python manuals as reStructuredText, byte level "
          "(scripts/install_prose_corpus.sh)")
class PyDocs(TextCorpus):
    """The Python manuals (tutorial, how-tos, library and language reference, what's new) as
    plain reStructuredText, one document per file; `dataset.path` names another copy."""

    def documents(self) -> Documents:
        if self.cfg.path:
            roots = [Path(self.cfg.path)]
        else:  # the newest Python's manuals where several are installed
            version = lambda p: [int(n) for n in re.findall(r"\d+", p.parent.parent.name)]
            roots = sorted((Path(p) for p in glob.glob(PYDOCS)), key=version)[-1:]
        files = sorted(roots[0].rglob("*.txt")) if roots and roots[0].is_dir() else []
        if not files:
            raise ConfigError(f"dataset=pydocs needs the Python manuals, found none under "
                              f"{self.cfg.path or PYDOCS}; expected them installed by "
                              "scripts/install_prose_corpus.sh (Debian package python3-doc), or "
                              "dataset.path=DIR of their .rst.txt sources")
        return files_documents(files, roots[0])
