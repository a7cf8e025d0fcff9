"""Corpora: where a dataset's documents come from (the contract is in posbench/data/documents.py).
"""
from __future__ import annotations

import glob
import re
import sysconfig
from pathlib import Path
from typing import Callable, Dict

from posbench.errors import ConfigError
from posbench.data.documents import Corpus, files_corpus, local_files
from posbench.data.hub import openwebtext, pg19, wikitext103
from posbench.data.tasks import TASKS


def pystdlib(dataset_cfg) -> Corpus:
    """The running interpreter's standard library source: a real corpus on every machine with
    Python. One document per .py file; installed third-party packages are left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    return files_corpus(files, root)


PYDOCS = "/usr/share/doc/python3*/html/_sources"


def pydocs(dataset_cfg) -> Corpus:
    """English prose: the Python manuals (tutorial, how-tos, library and language reference,
    what's new) as plain reStructuredText, from Debian's python3-doc package."""
    if dataset_cfg.path:
        roots = [Path(dataset_cfg.path)]
    else:  # the newest Python's manuals where several are installed
        version = lambda p: [int(n) for n in re.findall(r"\d+", p.parent.parent.name)]
        roots = sorted((Path(p) for p in glob.glob(PYDOCS)), key=version)[-1:]
    files = sorted(roots[0].rglob("*.txt")) if roots and roots[0].is_dir() else []
    if not files:
        raise ConfigError(f"dataset=pydocs needs the Python manuals, found none under "
                          f"{dataset_cfg.path or PYDOCS}; expected them installed by "
                          "scripts/install_prose_corpus.sh (Debian package python3-doc), or "
                          "dataset.path=DIR of their .rst.txt sources")
    return files_corpus(files, roots[0])


def text(dataset_cfg) -> Corpus:
    """Any local text files: `dataset.path` is a file, a folder or a glob; each file is one
    document."""
    return files_corpus(*local_files(dataset_cfg.path))


def _task_source(task):
    return lambda dataset_cfg: task


# every dataset=NAME: a corpus of documents, or a generated task (posbench/data/tasks.py)
CORPORA: Dict[str, Callable] = {
    "pystdlib": pystdlib, "pydocs": pydocs, "text": text,
    "wikitext103": wikitext103, "pg19": pg19, "openwebtext": openwebtext,
    **{name: _task_source(task) for name, task in TASKS.items()},
}
