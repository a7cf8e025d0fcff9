"""Datasets from local files: text, hub datasets' own formats, GPT-2 BPE, the prose corpus, and the
one-line refusal when the hub cannot be reached. Nothing here touches the network."""
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import posbench
from posbench.config import ConfigError
from posbench.data import prepare
from posbench.data.hub import wikitext_articles
from posbench.data.tokenize import TIKTOKEN_URL, GPT2BPE, _bytes_to_unicode, gpt2_files
from helpers import posbench_cli


def dataset_cfg(tmp_path, *overrides):
    return posbench.compose([*overrides, f"dataset.cache_dir={tmp_path / 'cache'}"]).dataset


def docs_of(data, split):
    offsets = data.train_docs if split == "train" else data.val_docs
    return [bytes(data.tokens[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]


def write_text_files(folder: Path, n: int) -> dict:
    folder.mkdir(parents=True)
    texts = {f"doc{i:02d}.txt": f"Document {i}. " * (50 + i) for i in range(n)}
    for name, body in texts.items():
        (folder / name).write_text(body)
    (folder / ".hidden.txt").write_text("left out")
    return texts


def test_text_dataset_reads_a_folder_or_a_glob_one_document_per_file(tmp_path):
    texts = write_text_files(tmp_path / "corpus", 40)
    data = prepare(dataset_cfg(tmp_path, "dataset=text", f"dataset.path={tmp_path / 'corpus'}",
                               "dataset.val_fraction=0.2"))
    train, val = docs_of(data, "train"), docs_of(data, "val")
    assert len(train) + len(val) == 40 and 0 < len(val) < 20
    assert sorted(train + val) == sorted(t.encode() for t in texts.values())
    globbed = prepare(dataset_cfg(tmp_path, "dataset=text", "dataset.val_fraction=0.2",
                                  f"dataset.path={tmp_path / 'corpus'}/*.txt"))
    assert globbed.fingerprint == data.fingerprint  # same files, same keys


def test_text_dataset_refusals_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="dataset.path"):
        posbench.compose(["dataset=text"])
    with pytest.raises(ConfigError, match="names no files"):
        prepare(dataset_cfg(tmp_path, "dataset=text", f"dataset.path={tmp_path}/none*.txt"))
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(ConfigError, match="val_fraction"):
        prepare(dataset_cfg(tmp_path, "dataset=text", f"dataset.path={tmp_path / 'one.txt'}"))


def wikitext_lines(titles, body_lines=20):
    lines = [""]
    for title in titles:
        lines += [f" = {title} = \n", " \n"]
        lines += [f" {title} sentence {i} , with a @-@ hyphen . \n" for i in range(body_lines)]
        lines += [" = = Section = = \n", f" The end of {title} . \n"]
    return lines


def test_wikitext_articles_split_at_title_lines_not_sections():
    articles = list(wikitext_articles(wikitext_lines(["A", "B"])))
    assert len(articles) == 2
    assert articles[0].startswith(" = A = \n")
    assert " = = Section = = " in articles[1] and articles[1].startswith(" = B = ")


def test_wikitext_local_parquet_keeps_the_hub_splits_and_holds_out_test(tmp_path):
    folder = tmp_path / "wikitext" / "wikitext-103-raw-v1"
    folder.mkdir(parents=True)
    splits = {"train": ["A", "B", "C"], "validation": ["D", "E"], "test": ["F"]}
    for split, titles in splits.items():
        pq.write_table(pa.table({"text": wikitext_lines(titles)}),
                       folder / f"{split}-00000-of-00001.parquet")
    data = prepare(dataset_cfg(tmp_path, "dataset=wikitext103",
                               f"dataset.path={tmp_path / 'wikitext'}"))
    val = docs_of(data, "val")
    assert len(docs_of(data, "train")) == 3 and len(val) == 2
    assert val[1].startswith(b" = E = \n") and b" F sentence" not in bytes(data.tokens)
    joined = prepare(dataset_cfg(tmp_path, "dataset=wikitext103", "dataset.val_stream=true",
                                 f"dataset.path={tmp_path / 'wikitext'}"))
    assert len(joined.val_docs) == 2 and joined.longest("val") == sum(map(len, val))


def test_pg19_and_openwebtext_read_jsonl_and_arrow_copies(tmp_path):
    import datasets

    books = [f"Book {i}: " + "a long sentence of a book. " * (40 + i) for i in range(30)]
    (tmp_path / "pg19").mkdir()
    with open(tmp_path / "pg19" / "books.jsonl", "w") as f:
        for i, book in enumerate(books):
            f.write(json.dumps({"short_book_title": f"b{i}", "text": book}) + "\n")
    data = prepare(dataset_cfg(tmp_path, "dataset=pg19", f"dataset.path={tmp_path / 'pg19'}",
                               "dataset.val_fraction=0.2"))
    assert sorted(docs_of(data, "train") + docs_of(data, "val")) == sorted(b.encode() for b in books)
    # the layout `datasets` saves a DatasetDict in: <split>/data-*.arrow
    pages = {"train": books[:20], "validation": books[20:]}
    datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": t}) for s, t in pages.items()}
                         ).save_to_disk(str(tmp_path / "owt"))
    data = prepare(dataset_cfg(tmp_path, "dataset=openwebtext", f"dataset.path={tmp_path / 'owt'}"))
    assert docs_of(data, "val") == [b.encode() for b in books[20:]]


def test_a_table_without_a_text_column_is_refused(tmp_path):
    pq.write_table(pa.table({"content": ["x" * 100] * 10}), tmp_path / "train.parquet")
    with pytest.raises(ConfigError, match="no 'text' column"):
        prepare(dataset_cfg(tmp_path, "dataset=pg19", f"dataset.path={tmp_path}/train.parquet"))


def test_unreachable_hub_is_one_line_naming_the_local_alternative(tmp_path, monkeypatch):
    import datasets

    from posbench.data import hub

    monkeypatch.setattr(hub, "_reachable", lambda url: False)
    with pytest.raises(ConfigError, match="cannot be reached.*dataset.path=") as err:
        prepare(dataset_cfg(tmp_path, "dataset=wikitext103"))
    assert "\n" not in str(err.value) and "dataset=text" in str(err.value)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="could not be loaded.*dataset.path="):
        prepare(dataset_cfg(tmp_path, "dataset=pg19", "dataset.hub=posbench-tests/absent"))


def test_offline_cli_exits_with_one_line_and_no_traceback(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = posbench_cli("train", "dataset=openwebtext", "dataset.hub=posbench-tests/absent",
                        "hydra.run.dir=run", cwd=tmp_path, env=env, timeout=300, ok=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "dataset.path=" in errors[0]


def toy_bpe(folder: Path, names=("vocab.json", "merges.txt")) -> None:
    """256 byte tokens, then three merges: "he", "Ġt", "Ġthe" (Ġ is GPT-2's space)."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {c: b for b, c in _bytes_to_unicode().items()}
    vocab.update({"he": 256, "Ġt": 257, "Ġthe": 258})
    (folder / names[0]).write_text(json.dumps(vocab))
    (folder / names[1]).write_text("#version: 0.2\nh e\nĠ t\nĠt he\n")


def test_gpt2_bpe_merges_by_rank_and_round_trips(tmp_path):
    toy_bpe(tmp_path)
    bpe = GPT2BPE(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert bpe.encode("the the") == [ord("t"), 256, 258]
    text = "Ünïcödé, the 3 themes' 12.5 — ok\n\n  done"
    assert bpe.decode(bpe.encode(text)) == text


def test_gpt2_files_come_from_a_folder_or_the_tiktoken_cache_never_the_network(tmp_path,
                                                                              monkeypatch):
    toy_bpe(tmp_path / "mine")
    assert gpt2_files(str(tmp_path / "mine"))[0] == tmp_path / "mine" / "vocab.json"
    with pytest.raises(ConfigError, match="tokenizer_path=.*nothing is downloaded"):
        gpt2_files(str(tmp_path / "empty"))
    sha1 = lambda name: hashlib.sha1((TIKTOKEN_URL + name).encode()).hexdigest()
    toy_bpe(tmp_path / "tiktoken", names=(sha1("encoder.json"), sha1("vocab.bpe")))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    assert gpt2_files(None)[1].name == sha1("vocab.bpe")


def test_gpt2_preparation_tokenizes_every_document_in_parallel(tmp_path):
    texts = write_text_files(tmp_path / "corpus", 12)
    toy_bpe(tmp_path / "bpe")
    cfg = dataset_cfg(tmp_path, "dataset=text", f"dataset.path={tmp_path / 'corpus'}",
                      "dataset.tokenizer=gpt2", f"dataset.tokenizer_path={tmp_path / 'bpe'}",
                      "dataset.val_fraction=0.3")
    data = prepare(cfg)
    assert data.vocab_size == 259 and data.tokens.dtype == np.uint16
    bpe = GPT2BPE(tmp_path / "bpe" / "vocab.json", tmp_path / "bpe" / "merges.txt")
    decoded = [bpe.decode(d) for d in (np.frombuffer(b, np.uint16) for b in
                                       docs_of(data, "train") + docs_of(data, "val"))]
    assert sorted(decoded) == sorted(texts.values())
    assert prepare(dataset_cfg(tmp_path, "dataset=text", f"dataset.path={tmp_path / 'corpus'}",
                               "dataset.val_fraction=0.3")).fingerprint != data.fingerprint


@pytest.mark.skipif(not list(Path("/usr/share/doc").glob("python3*/html/_sources")),
                    reason="prose corpus not installed (scripts/install_prose_corpus.sh)")
def test_prose_corpus_is_long_english_documents(tmp_path):
    data = prepare(dataset_cfg(tmp_path, "dataset=pydocs"))
    assert len(data.train_docs) > 300 and len(data.val_docs) > 5
    assert data.longest("val") > 16384
    text = bytes(data.tokens[:200_000]).decode("utf-8", errors="replace")
    assert text.count(" the ") > 500


def test_missing_prose_corpus_names_the_install_script(tmp_path):
    with pytest.raises(ConfigError, match="install_prose_corpus.sh"):
        prepare(dataset_cfg(tmp_path, "dataset=pydocs", f"dataset.path={tmp_path / 'absent'}"))
