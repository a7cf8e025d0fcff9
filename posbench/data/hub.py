"""Hub corpora: WikiText-103, PG-19 and OpenWebText through the `datasets` library, or from a local
copy in the hub's own formats (parquet, json lines, arrow) with the same "text" column.

Never waits on an unreachable network: offline, one line names the local alternatives."""
from __future__ import annotations

import hashlib
import json
import re
import socket
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional, Tuple
from urllib.parse import urlparse

from posbench.data.base import DatasetConfig, register
from posbench.data.corpus import TextCorpus
from posbench.data.documents import Document, Documents, file_digest, local_files
from posbench.core.errors import ConfigError, DataUnavailable

TABLES = (".parquet", ".jsonl", ".json", ".arrow")
# what `datasets`' save_to_disk writes beside the arrow files
SAVED_METADATA = {"dataset_dict.json", "dataset_info.json", "state.json"}
HUB_SPLITS = {"train": "train", "validation": "val"}  # the test split stays held out
# WikiText marks an article by its title line " = Title = "; sections are " = = Section = = "
WIKITEXT_TITLE = re.compile(r" = [^=].* = \n?$")


def wikitext_articles(lines: Iterable[str]) -> Iterator[str]:
    """WikiText rows are lines; an article runs from its title line to the next one."""
    article: List[str] = []
    for line in lines:
        if WIKITEXT_TITLE.match(line) and any(part.strip() for part in article):
            yield "".join(article)
            article = []
        article.append(line)
    if any(part.strip() for part in article):
        yield "".join(article)


def rows(texts: Iterable[str]) -> Iterator[str]:
    """PG-19 (a book a row) and OpenWebText (a web page a row)."""
    return (t for t in texts if t.strip())


def _split_of(relpath: str) -> Optional[str]:
    """A local file's split from the words of its name, as the hub names files
    (train-00000-of-00002.parquet, wiki.valid.jsonl, ...); None: split by document."""
    words = set(re.split(r"[^a-z]+", relpath.lower()))
    for names, split in (({"train"}, "train"), ({"validation", "valid", "val", "dev"}, "val"),
                         ({"test"}, "test")):
        if words & names:
            return split
    return None


def _need_text(path: Path, columns: List[str]) -> None:
    if "text" not in columns:
        raise ConfigError(f"dataset.path file {str(path)!r} is not accepted: it has no 'text' "
                          f"column (it has {columns}); expected the hub dataset's columns")


def _texts(path: Path) -> Iterator[str]:
    """The "text" column of a local parquet, arrow (the stream format `datasets` writes) or
    json-lines file, read in batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.name.endswith(".parquet"):
        table = pq.ParquetFile(path)
        _need_text(path, table.schema_arrow.names)
        batches = table.iter_batches(columns=["text"], batch_size=1024)
    elif path.name.endswith(".arrow"):
        reader = pa.ipc.open_stream(pa.memory_map(str(path)))
        _need_text(path, reader.schema.names)
        batches = reader
    else:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    _need_text(path, list(record))
                    yield record["text"]
        return
    for batch in batches:
        yield from batch.column("text").to_pylist()


def _documents(tables: List[Tuple[str, Optional[str], Callable[[], Iterable[str]]]],
               to_documents: Callable) -> Iterator[Document]:
    for name, split, texts in tables:
        for i, doc in enumerate(to_documents(texts())):
            yield f"{name}:{i}", split, doc.encode("utf-8")


def _local(dataset_cfg, to_documents) -> Documents:
    files, root = local_files(dataset_cfg.path, TABLES)
    named = [(p.relative_to(root).as_posix(), p) for p in files if p.name not in SAVED_METADATA]
    tables = [(key, _split_of(key), lambda p=p: _texts(p)) for key, p in named]
    tables = [t for t in tables if t[1] != "test"]
    if not tables:
        raise ConfigError(f"dataset.path={dataset_cfg.path!r} is not accepted: it holds test "
                          "files only; expected train and validation files (or unsplit ones)")
    identity = [(key, file_digest(p)) for key, p in named if _split_of(key) != "test"]
    return Documents(identity, lambda: _documents(tables, to_documents))


def _reachable(url: str) -> bool:
    parts = urlparse(url)
    try:
        socket.create_connection((parts.hostname, parts.port or 443), timeout=3).close()
        return True
    except OSError:
        return False


def _hub(dataset_cfg, to_documents) -> Documents:
    import datasets
    from huggingface_hub.constants import ENDPOINT

    name, hub = dataset_cfg.name, dataset_cfg.hub
    instead = (f"expected a local copy: dataset={name} dataset.path=FILE|DIR|GLOB of its parquet, "
               "jsonl or arrow files (a 'text' column), dataset=text dataset.path=... for plain "
               "text files, or HF_DATASETS_OFFLINE=1 to read a cached download")
    # without this check, `datasets` retries an unreachable hub for half a minute
    if not datasets.config.HF_HUB_OFFLINE and not _reachable(ENDPOINT):
        raise DataUnavailable(f"dataset={name} comes from the Hugging Face hub ({hub}), which cannot "
                          f"be reached from here; {instead}")
    try:
        loaded = datasets.load_dataset(hub, dataset_cfg.hub_config)
    except (ConnectionError, datasets.exceptions.DatasetNotFoundError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataUnavailable(f"dataset={name} could not be loaded from the Hugging Face hub "
                          f"({reason}); {instead}") from None
    splits = {HUB_SPLITS[s]: loaded[s] for s in loaded if s in HUB_SPLITS}
    if "val" not in splits:  # OpenWebText has a train split only: split it by document
        splits = {None: loaded["train"]}
    tables = [(f"{hub}/{split or 'train'}", split,
               lambda ds=ds: (t for b in ds.select_columns("text").iter(1024) for t in b["text"]))
              for split, ds in splits.items()]
    # `datasets` fingerprints a split by its source files: a cheap stand-in for the contents
    identity = [(f"hub:{hub}/{dataset_cfg.hub_config}/{split}",
                 hashlib.sha256(ds._fingerprint.encode()).digest()) for split, ds in splits.items()]
    return Documents(identity, lambda: _documents(tables, to_documents))


@register("pg19", "PG-19 books (a parquet copy of deepmind/pg19) from the hub, a book a document; "
          "dataset.path= reads a local copy", DatasetConfig(hub="emozilla/pg19"))
@register("openwebtext", "OpenWebText from the hub, one document per web page; dataset.path= "
          "reads a local copy", DatasetConfig(hub="Skylion007/openwebtext"))
class HubCorpus(TextCorpus):
    """A hub dataset, or its local copy when `dataset.path` names one; `to_documents` makes
    documents of the rows of its "text" column (one per row unless a subclass says otherwise)."""
    to_documents = staticmethod(rows)

    def documents(self) -> Documents:
        if self.cfg.path:
            return _local(self.cfg, self.to_documents)
        return _hub(self.cfg, self.to_documents)


@register("wikitext103", "WikiText-103 (raw) from the hub, one document per article; "
          "dataset.path= reads a local copy",
          DatasetConfig(hub="Salesforce/wikitext", hub_config="wikitext-103-raw-v1"))
class WikiText103(HubCorpus):
    to_documents = staticmethod(wikitext_articles)
