"""Datasets from local files: text, hub datasets' own formats, GPT-2 BPE, the prose corpus, and the
one-line refusal when the hub cannot be reached. Nothing here touches the network."""
import collections
import hashlib
import itertools
import json
import os
import random
import runpy
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import posbench
from posbench.core.errors import ConfigError, DataUnavailable
from posbench.data import build_dataset, prepare, tokenize
from posbench.data.hub import wikitext_articles
from posbench.data.tokenize import TIKTOKEN_URL, GPT2BPE, gpt2_files
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
    with pytest.raises(DataUnavailable, match="cannot be reached.*dataset.path=") as err:
        prepare(dataset_cfg(tmp_path, "dataset=wikitext103"))
    assert "\n" not in str(err.value) and "dataset=text" in str(err.value)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataUnavailable, match="could not be loaded.*dataset.path="):
        prepare(dataset_cfg(tmp_path, "dataset=pg19", "dataset.hub=posbench-tests/absent"))


def test_offline_cli_exits_with_one_line_and_no_traceback(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = posbench_cli("train", "dataset=openwebtext", "dataset.hub=posbench-tests/absent",
                        "hydra.run.dir=run", cwd=tmp_path, env=env, timeout=300, ok=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "dataset.path=" in errors[0]


# ---- GPT-2 BPE, checked against a reference written here from GPT-2's definition: its split
# regex read as a scanner, its merge loop, and a small vocabulary learned by plain BPE training.

# Unicode's White_Space property: what GPT-2's \s matches (U+001C-U+001F are not in it)
WHITE_SPACE = set("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | {
    chr(c) for c in range(0x2000, 0x200B)}
CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")
# GPT-2 spells byte b as chr(b) where that is printable Latin-1 other than the space, and gives
# the other bytes U+0100 onwards, in byte order
KEPT = [b for b in range(256) if chr(b).isprintable() and b != 0x20]
BYTE_CHARS = {b: chr(b) if b in KEPT else chr(256 + sorted(set(range(256)) - set(KEPT)).index(b))
              for b in range(256)}


def char_class(c: str) -> str:
    if c in WHITE_SPACE:
        return "space"
    category = unicodedata.category(c)[0]
    return category if category in "LN" else "other"


def gpt2_split(text: str) -> list:
    """GPT-2's pre-tokenizer: a contraction; else an optional space and a run of letters, of
    digits, or of other non-space; else a whitespace run, minus its last character when a word
    follows (that one goes with the word, or alone)."""
    pieces, i = [], 0
    while i < len(text):
        start = i
        contraction = next((c for c in CONTRACTIONS if text.startswith(c, i)), None)
        if contraction:
            i += len(contraction)
        else:
            if text[i] == " " and i + 1 < len(text) and char_class(text[i + 1]) != "space":
                i += 1
            kind = char_class(text[i])
            i += 1
            while i < len(text) and char_class(text[i]) == kind:
                i += 1
            if kind == "space" and i < len(text) and i - start > 1:
                i -= 1
        pieces.append(text[start:i])
    return pieces


def merge_pair(parts: list, pair: tuple) -> list:
    merged, i = [], 0
    while i < len(parts):
        if tuple(parts[i:i + 2]) == pair:
            merged.append(parts[i] + parts[i + 1])
            i += 2
        else:
            merged.append(parts[i])
            i += 1
    return merged


def reference_bpe(word: str, ranks: dict) -> list:
    """GPT-2's merge loop: merge the adjacent pair listed first in merges.txt, everywhere, until
    no adjacent pair is listed."""
    parts = list(word)
    while True:
        listed = [(ranks[pair], pair) for pair in zip(parts, parts[1:]) if pair in ranks]
        if not listed:
            return parts
        parts = merge_pair(parts, min(listed)[1])


def as_chars(piece: str) -> str:
    return "".join(BYTE_CHARS[b] for b in piece.encode("utf-8"))


def learn_merges(texts, n: int) -> list:
    """Plain BPE training: merge the most frequent adjacent pair, n times."""
    words = collections.Counter(as_chars(p) for t in texts for p in gpt2_split(t))
    words = collections.Counter({tuple(w): c for w, c in words.items()})
    merges = []
    for _ in range(n):
        pairs = collections.Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        merged = collections.Counter()
        for word, count in words.items():
            merged[tuple(merge_pair(list(word), best))] += count
        words = merged
    return merges


def write_bpe(folder: Path, merges: list, names=("vocab.json", "merges.txt")) -> dict:
    """vocab.json and merges.txt as GPT-2 writes them, with ids shuffled: an id must come from
    vocab.json, not from a token's rank."""
    tokens = list(dict.fromkeys([*BYTE_CHARS.values(), *(a + b for a, b in merges)]))
    ids = list(range(len(tokens)))
    random.Random(0).shuffle(ids)
    vocab = dict(zip(tokens, ids))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / names[0]).write_text(json.dumps(vocab), encoding="utf-8")
    (folder / names[1]).write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                   encoding="utf-8")
    return vocab


def reference_ids(text: str, vocab: dict, merges: list) -> list:
    ranks = {pair: r for r, pair in enumerate(merges)}
    return [vocab[t] for p in gpt2_split(text) for t in reference_bpe(as_chars(p), ranks)]


BPE_TEXTS = [
    "the theme of the thesis: they're there, isn't it? I'd say we'll see what you've got. 'S 'X",
    "Ünïcödé naïve café — 日本語のテキスト, 한국어, العربية, עברית, Ελληνικά;"
    " e\u0301 a\u0308 ﬁ",
    "digits 0 12 345 6789 3.14159 1,000,000 -42 x2 ½ ² Ⅻ ٣٤٥ 12345678901234567890",
    "emoji 😀👍🏽 👨\u200d👩\u200d👧 🇫🇷 ✨✨ a😀b 😀's",
    "  leading\n\n\n  trailing   \t\ttabs\r\nnbsp\u00a0ideo\u3000gap\u2028line \u2003 em   ",
    "separators\x1c\x1d\x1e\x1f's are no white space to GPT-2 \x1f \x1f\x1fx\x00\x07\x7f",
    "def f(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n" * 3,
]
# a long document: every piece above, reshuffled, about 200 KB
LONG_TEXT = "".join(random.Random(1).choices(
    [p for t in BPE_TEXTS for p in gpt2_split(t)] + ["\n", "  ", "'", "'ll"], k=40_000))
MERGES = learn_merges(BPE_TEXTS + [LONG_TEXT[:20_000]], 400)


def test_the_reference_splits_and_merges_as_gpt2():
    assert gpt2_split("I'm  here\n\n 12ab😀 's x\x1f'd") == [
        "I", "'m", " ", " here", "\n\n", " 12", "ab", "😀", " '", "s", " x", "\x1f'", "d"]
    assert gpt2_split("end  \n") == ["end", "  \n"]
    assert (BYTE_CHARS[ord(" ")], BYTE_CHARS[ord("\n")], BYTE_CHARS[0xAD]) == ("Ġ", "Ċ", "Ń")
    assert len(set(BYTE_CHARS.values())) == 256
    ranks = {("h", "e"): 0, ("Ġ", "t"): 1, ("Ġt", "he"): 2, ("t", "h"): 3}
    assert reference_bpe("Ġthe", ranks) == ["Ġthe"] and reference_bpe("the", ranks) == ["t", "he"]
    assert len(MERGES) == 400 and any(len(a + b) > 4 for a, b in MERGES)


def test_gpt2_bpe_gives_the_reference_ids(tmp_path):
    vocab = write_bpe(tmp_path, MERGES)
    bpe = GPT2BPE(tmp_path / "vocab.json", tmp_path / "merges.txt")
    texts = BPE_TEXTS + ["", LONG_TEXT]
    got = bpe.encode_batch(texts)
    for text, ids in zip(texts, got):
        assert ids.tolist() == reference_ids(text, vocab, MERGES), text[:60]
    assert len(got[-1]) > 20_000 and bpe.vocab_size == len(vocab)


def test_gpt2_files_that_do_not_match_are_one_line(tmp_path):
    write_bpe(tmp_path, MERGES)
    (tmp_path / "merges.txt").write_text("#version: 0.2\nĠ t\nQ Z\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not accepted: vocab.json has no id for 'QZ'"):
        GPT2BPE(tmp_path / "vocab.json", tmp_path / "merges.txt")
    (tmp_path / "merges.txt").write_text("#version: 0.2\nĠ t x\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="merges line 2 .* not a pair; expected GPT-2's"):
        GPT2BPE(tmp_path / "vocab.json", tmp_path / "merges.txt")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n▁ t\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="spells '▁t' in characters that stand for no byte"):
        GPT2BPE(tmp_path / "vocab.json", tmp_path / "merges.txt")


def test_gpt2_files_come_from_a_folder_or_the_tiktoken_cache_never_the_network(tmp_path,
                                                                              monkeypatch):
    write_bpe(tmp_path / "mine", MERGES)
    assert gpt2_files(str(tmp_path / "mine"))[0] == tmp_path / "mine" / "vocab.json"
    with pytest.raises(ConfigError, match="tokenizer_path=.* not accepted.*nothing is downloaded"):
        gpt2_files(str(tmp_path / "empty"))
    sha1 = lambda name: hashlib.sha1((TIKTOKEN_URL + name).encode()).hexdigest()
    write_bpe(tmp_path / "tiktoken", MERGES, names=(sha1("encoder.json"), sha1("vocab.bpe")))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    assert gpt2_files(None)[1].name == sha1("vocab.bpe")


def test_gpt2_preparation_gives_every_document_the_reference_ids(tmp_path, monkeypatch):
    (tmp_path / "corpus").mkdir()
    texts = BPE_TEXTS + [LONG_TEXT]
    for i, text in enumerate(texts):
        (tmp_path / "corpus" / f"doc{i}.txt").write_bytes(text.encode("utf-8"))
    vocab = write_bpe(tmp_path / "bpe", MERGES)
    monkeypatch.setattr(tokenize, "BATCH_BYTES", 300)  # several batches, one document alone
    cfg = dataset_cfg(tmp_path, "dataset=text", f"dataset.path={tmp_path / 'corpus'}",
                      "dataset.tokenizer=gpt2", f"dataset.tokenizer_path={tmp_path / 'bpe'}",
                      "dataset.val_fraction=0.3")
    data = prepare(cfg)
    assert data.vocab_size == len(vocab) and data.tokens.dtype == np.uint16
    got = [np.frombuffer(b, np.uint16).tolist() for b in
           docs_of(data, "train") + docs_of(data, "val")]
    assert sorted(got) == sorted(reference_ids(t, vocab, MERGES) for t in texts)
    assert prepare(dataset_cfg(tmp_path, "dataset=text", f"dataset.path={tmp_path / 'corpus'}",
                               "dataset.val_fraction=0.3")).fingerprint != data.fingerprint


def test_tokenizer_bench_counts_the_reference_tokens(tmp_path, capsys):
    vocab = write_bpe(tmp_path / "bpe", MERGES)
    bench = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "bench_tokenizer.py"))
    result = bench["main"](["--tokenizer-path", str(tmp_path / "bpe"), "--megabytes", "0.05"])
    cfg = posbench.compose([]).dataset
    docs = itertools.islice((d for _, _, d in build_dataset(cfg).documents().read()),
                            result["documents"])
    texts = [d.decode("utf-8", errors="replace") for d in docs]
    assert result["bytes"] == sum(len(t.encode()) for t in texts) >= 50_000
    assert result["tokens"] == sum(len(reference_ids(t, vocab, MERGES)) for t in texts)
    assert json.loads(capsys.readouterr().out) == result


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
