import sysconfig
from pathlib import Path

import numpy as np
import pytest

import posbench
from posbench.core.errors import ConfigError
from posbench.data import build_dataset, prepare
from posbench.data.tokens import is_validation, read_token_dir
from helpers import window_starts


def test_stdlib_corpus_is_every_py_file_of_the_standard_library_and_no_installed_package():
    root = Path(sysconfig.get_paths()["stdlib"])
    expected = [p.relative_to(root).as_posix() for p in sorted(root.rglob("*.py"))
                if not {"site-packages", "dist-packages"} & set(p.parts)]
    keys = [key for key, _ in build_dataset(posbench.compose([]).dataset).documents().identity]
    assert keys == expected and len(keys) > 500


def test_stdlib_corpus_is_split_by_file_and_fingerprinted(stdlib_data):
    cfg = posbench.compose([]).dataset
    docs = [(key, doc) for key, _, doc in build_dataset(cfg).documents().read()]
    val = [d for k, d in docs if is_validation(k, cfg.val_fraction)]
    train = [d for k, d in docs if not is_validation(k, cfg.val_fraction)]
    assert len(stdlib_data.train_docs) - 1 == len(train) and len(stdlib_data.val_docs) - 1 == len(val)
    assert stdlib_data.train_docs[-1] == stdlib_data.val_docs[0] == sum(map(len, train))
    first_val = bytes(stdlib_data.tokens[stdlib_data.val_docs[0]:stdlib_data.val_docs[1]])
    assert first_val == val[0]
    assert 0.02 < len(val) / len(docs) < 0.10
    assert stdlib_data.fingerprint.startswith("sha256:") and stdlib_data.vocab_size == 256
    assert stdlib_data.longest("val") > 8192  # long validation documents exist


def test_preparation_is_cached_and_stable(stdlib_data):
    again = prepare(posbench.compose([]).dataset)
    assert again.fingerprint == stdlib_data.fingerprint
    assert again.tokens.filename == stdlib_data.tokens.filename


def test_corrupt_token_cache_is_refused(stdlib_data, tmp_path):
    import shutil
    from pathlib import Path

    copy = tmp_path / "cache"
    shutil.copytree(Path(stdlib_data.tokens.filename).parent, copy)
    with open(copy / "tokens.bin", "r+b") as f:
        f.seek(1000)
        f.write(b"\xff\xfe")
    with pytest.raises(ConfigError, match="corrupt"):
        read_token_dir(copy)
    (copy / "tokens.bin").write_bytes(b"short")
    with pytest.raises(ConfigError, match="corrupt"):
        read_token_dir(copy)


def test_train_batches_are_seeded_and_inside_one_document(stdlib_data):
    x1, y1 = stdlib_data.train_batch(64, 8, seed=3, step=10)
    x2, _ = stdlib_data.train_batch(64, 8, seed=3, step=10)
    x3, _ = stdlib_data.train_batch(64, 8, seed=3, step=11)
    assert x1.equal(x2) and not x1.equal(x3)
    assert x1[:, 1:].equal(y1[:, :-1])
    tokens = np.asarray(stdlib_data.tokens)
    docs = stdlib_data.train_docs
    for row in x1.numpy():
        hits = [s for s in range(len(docs) - 1)
                if bytes(row.astype(np.uint8)) in tokens[docs[s]:docs[s + 1]].tobytes()]
        assert hits, "a training window crosses a document boundary"


def test_eval_windows_are_deterministic_nonoverlapping_and_inside_validation(stdlib_data):
    length, tokens = 512, 8192
    starts = window_starts(stdlib_data, length, tokens)
    assert len(starts) == tokens // length
    assert np.array_equal(starts, window_starts(stdlib_data, length, tokens))
    assert np.all(np.diff(starts) >= length + 1)
    val = stdlib_data.val_docs
    doc = np.searchsorted(val, starts, side="right") - 1
    assert np.all(starts >= val[0]) and np.all(starts + length + 1 <= val[doc + 1])


def test_too_long_lengths_are_refused_with_the_numbers(stdlib_data):
    with pytest.raises(ConfigError, match=r"eval.lengths entry 10000000"):
        window_starts(stdlib_data, 10_000_000, 10_000_000)
    with pytest.raises(ConfigError, match=r"train.seq_len=10000000"):
        stdlib_data.check_train_len(10_000_000)
