"""Tests for leanstep.training.data: corpus loading and split, the sampler, held-out batches, errors."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from leanstep.training.data import (
    DEFAULT_CORPUS_BYTES,
    EXCLUDED_DIRS,
    BatchSampler,
    default_corpus_paths,
    heldout_batches,
    load_corpus,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def stdlib_corpus():
    return load_corpus()


def write(root: Path, name: str, content: bytes) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)


# ---------------------------------------------------------------- default corpus
def test_default_corpus_paths_are_sorted_capped_and_exclude_tests():
    paths = default_corpus_paths()
    names = [p.relative_to(STDLIB).as_posix() for p in paths]
    assert len(names) > 100 and names == sorted(names)
    assert all(n.endswith(".py") for n in names)
    assert not any(EXCLUDED_DIRS.intersection(n.split("/")[:-1]) for n in names)
    assert "os.py" in names or "os.py" > names[-1]
    assert sum(p.stat().st_size for p in paths) <= DEFAULT_CORPUS_BYTES
    small = default_corpus_paths(max_bytes=200_000)
    assert small == paths[: len(small)] and sum(p.stat().st_size for p in small) <= 200_000
    # The cap stops at the first file that does not fit, so the next one would overflow.
    assert sum(p.stat().st_size for p in paths[: len(small) + 1]) > 200_000


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_default_corpus_paths_rejects_bad_cap(bad):
    with pytest.raises(ValueError, match="max_bytes must be a positive int"):
        default_corpus_paths(max_bytes=bad)


def test_stdlib_corpus_split_is_by_file_deterministic_and_recorded(stdlib_corpus):
    c = stdlib_corpus
    names = [p.relative_to(STDLIB).as_posix() for p in default_corpus_paths()]
    assert c.split == "files"
    assert sorted(c.train_files + c.heldout_files) == names
    assert not set(c.train_files) & set(c.heldout_files)
    assert len(c.heldout_files) == round(0.1 * len(names))
    assert c.train.dtype == np.uint8 and c.heldout.dtype == np.uint8
    train_bytes = b"".join((STDLIB / n).read_bytes() for n in c.train_files)
    assert c.train.tobytes() == train_bytes
    info = c.describe()
    assert info["train_files"] == len(c.train_files) and info["heldout_bytes"] == c.heldout.size
    assert info["source"] == f"stdlib:{STDLIB}"
    again = load_corpus().describe()
    assert again == info and len(info["files_sha256"]) == 64


# ---------------------------------------------------------------- folders and files
def test_folder_is_read_sorted_skipping_binary_hidden_and_empty(tmp_path):
    for i in range(10):
        write(tmp_path, f"d{i % 3}/f{i}.txt", f"file {i}\n".encode())
    write(tmp_path, "blob.bin", b"abc\0def")
    write(tmp_path, ".hidden.txt", b"secret")
    write(tmp_path, ".git/config", b"[core]")
    write(tmp_path, "empty.txt", b"")
    c = load_corpus(tmp_path)
    expected = sorted(f"d{i % 3}/f{i}.txt" for i in range(10))
    assert sorted(c.train_files + c.heldout_files) == expected
    assert c.train_files == tuple(sorted(c.train_files))
    assert len(c.heldout_files) == 1 and c.split == "files"
    assert c.train.tobytes() == b"".join((tmp_path / n).read_bytes() for n in c.train_files)
    assert c.heldout.tobytes() == (tmp_path / c.heldout_files[0]).read_bytes()
    assert load_corpus(tmp_path).describe() == c.describe()
    # What was left out is counted, as config.json records it (hidden entries are left out by design).
    skipped = {"a binary file (a NUL byte)": 1, "an empty file": 1}
    assert c.skipped == skipped and c.describe()["skipped_entries"] == skipped
    # Adding a file changes the recorded file list hash.
    write(tmp_path, "zz.txt", b"more\n")
    assert load_corpus(tmp_path).describe()["files_sha256"] != c.describe()["files_sha256"]


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(n=st.integers(2, 60), fraction=st.floats(0.01, 0.9))
def test_heldout_file_count_and_spread(tmp_path_factory, n, fraction):
    root = tmp_path_factory.mktemp("c")
    for i in range(n):
        write(root, f"{i:03d}.txt", b"x" * 5)
    c = load_corpus(root, heldout_fraction=fraction)
    assert len(c.heldout_files) == min(n - 1, max(1, round(n * fraction)))
    assert len(c.train_files) + len(c.heldout_files) == n
    assert c.train.size == 5 * len(c.train_files)


def test_single_file_is_split_by_bytes(tmp_path):
    content = bytes(range(1, 201)) * 5
    write(tmp_path, "one.dat", content)
    c = load_corpus(tmp_path / "one.dat", heldout_fraction=0.25)
    assert c.split == "bytes" and c.train_files == c.heldout_files == ("one.dat",)
    assert c.train.tobytes() == content[:750] and c.heldout.tobytes() == content[750:]
    # A folder with one text file is split the same way.
    assert load_corpus(tmp_path).heldout.tobytes() == content[900:]


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        (lambda root: root / "missing", "does not exist"),
        (lambda root: (write(root, "e.txt", b""), root / "e.txt")[1], "is empty"),
        (lambda root: root, "holds no readable, non-empty text file"),
        (
            lambda root: (write(root, "a.bin", b"\0\1"), write(root, "b.bin", b"x\0"), root)[2],
            r"no readable, non-empty text file \(skipped: 2 x binary file \(a NUL byte\)\)",
        ),
    ],
    ids=["missing", "empty-file", "empty-folder", "binary-only"],
)
def test_load_corpus_errors_name_the_path(tmp_path, setup, match):
    path = setup(tmp_path)
    with pytest.raises(ValueError, match=match) as info:
        load_corpus(path)
    assert "--data" in str(info.value) and str(path) in str(info.value)
    assert "expected a text file or a folder of text files" in str(info.value)


def test_load_corpus_rejects_too_small_parts_and_bad_fraction(tmp_path):
    write(tmp_path, "a.txt", b"a" * 100)
    write(tmp_path, "b.txt", b"b" * 10)
    with pytest.raises(ValueError, match=r"held-out part has 10 bytes, fewer than the 17"):
        load_corpus(tmp_path, seq_len=16)
    assert load_corpus(tmp_path, seq_len=9).heldout.size == 10
    for bad in (0.0, 1.0, -0.1, "0.1"):
        with pytest.raises(ValueError, match="heldout_fraction must be in"):
            load_corpus(tmp_path, heldout_fraction=bad)


# ---------------------------------------------------------------- sampler
DATA = (np.arange(5000) % 251).astype(np.uint8)  # consecutive windows are easy to recognise


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    seed=st.integers(0, 2**32 - 1), step=st.integers(0, 10**9),
    batch_size=st.integers(1, 8), seq_len=st.integers(1, 64),
)  # fmt: skip
def test_sampler_batches_are_pure_contiguous_windows(seed, step, batch_size, seq_len):
    sampler = BatchSampler(DATA, batch_size, seq_len, seed)
    tokens = sampler.batch_at(step)["tokens"]
    assert tokens.shape == (batch_size, seq_len + 1) and tokens.dtype == np.int32
    assert tokens.min() >= 0 and tokens.max() < 251
    np.testing.assert_array_equal(np.diff(tokens, axis=1) % 251, 1)  # contiguous slices of DATA
    # A fresh sampler (a resumed run) gives the same batch at the same step.
    np.testing.assert_array_equal(BatchSampler(DATA.copy(), batch_size, seq_len, seed).batch_at(step)["tokens"], tokens)


def test_sampler_matches_documented_formula_and_varies_with_step_and_seed():
    sampler = BatchSampler(DATA, 4, 8, seed=3)
    rng = np.random.default_rng([3, 11])
    offsets = rng.integers(0, DATA.size - 8, size=4)
    np.testing.assert_array_equal(sampler.batch_at(11)["tokens"], np.stack([DATA[o : o + 9] for o in offsets]))
    batches = [sampler.batch_at(s)["tokens"] for s in range(5)]
    assert all(not np.array_equal(a, b) for i, a in enumerate(batches) for b in batches[i + 1 :])
    assert not np.array_equal(BatchSampler(DATA, 4, 8, seed=4).batch_at(0)["tokens"], batches[0])


def test_sampler_reaches_the_last_window():
    data = np.arange(10, dtype=np.uint8)
    tokens = BatchSampler(data, 256, 8, seed=0).batch_at(0)["tokens"]
    assert {int(row[0]) for row in tokens} == {0, 1}  # both possible offsets, no overrun


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(batch_size=0), "batch_size must be a positive int"),
        (dict(seq_len=0), "seq_len must be a positive int"),
        (dict(batch_size=True), "batch_size must be a positive int"),
        (dict(seed=-1), "seed must be a non-negative int"),
        (dict(data=np.zeros(8, np.uint8)), "training data has 8 tokens, fewer than seq_len \\+ 1 = 9"),
        (dict(data=np.zeros((4, 4), np.uint8)), "1-D integer array"),
    ],
)
def test_sampler_rejects_bad_arguments(kwargs, match):
    args = dict(data=DATA, batch_size=2, seq_len=8, seed=0) | kwargs
    with pytest.raises(ValueError, match=match):
        BatchSampler(**args)


def test_sampler_rejects_negative_step():
    with pytest.raises(ValueError, match="step must be >= 0; got -1"):
        BatchSampler(DATA, 2, 8, 0).batch_at(-1)


# ---------------------------------------------------------------- held-out batches
@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(size=st.integers(2, 400), batch_size=st.integers(1, 6), seq_len=st.integers(1, 20))
def test_heldout_batches_predict_each_byte_once(size, batch_size, seq_len):
    hypothesis.assume(size >= seq_len + 1)
    data = np.random.default_rng(size).integers(0, 256, size=size).astype(np.uint8)
    batches = heldout_batches(data, batch_size, seq_len)
    rows = np.concatenate([b["tokens"] for b in batches])
    n_windows = (size - 1) // seq_len
    assert len(rows) == (n_windows if n_windows < batch_size else n_windows // batch_size * batch_size)
    assert all(b["tokens"].shape == batches[0]["tokens"].shape and b["tokens"].dtype == np.int32 for b in batches)
    # Targets are data[1:], in order, each byte once (up to the dropped tail).
    np.testing.assert_array_equal(rows[:, 1:].ravel(), data[1 : 1 + len(rows) * seq_len])
    np.testing.assert_array_equal(rows[:, 0], data[np.arange(len(rows)) * seq_len])


def test_heldout_batches_respects_max_batches_and_errors():
    data = np.arange(200, dtype=np.uint8)
    assert len(heldout_batches(data, 2, 9)) == 11 and len(heldout_batches(data, 2, 9, max_batches=3)) == 3
    with pytest.raises(ValueError, match="held-out data has 5 tokens, fewer than seq_len \\+ 1 = 9"):
        heldout_batches(data[:5], 2, 8)
    with pytest.raises(ValueError, match="max_batches must be a positive int; got 0"):
        heldout_batches(data, 2, 8, max_batches=0)


def test_a_limited_heldout_sample_is_spread_over_all_of_the_data():
    data = (np.arange(2000) % 251).astype(np.uint8)
    batches = heldout_batches(data, 4, 10, max_batches=2)  # 8 of the 199 windows
    starts = [10 * (j * 199 // 8) for j in range(8)]  # window i starts at byte 10 i
    assert starts[-1] > 1700  # the sample reaches the end of the held-out data, not only its start
    np.testing.assert_array_equal(
        np.concatenate([b["tokens"] for b in batches]), np.stack([data[s : s + 11] for s in starts])
    )
