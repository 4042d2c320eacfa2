"""Real bytes to train on without a download, split by file, and deterministic batches.

The default corpus is this machine's Python standard library source (``*.py`` under
``sysconfig.get_paths()["stdlib"]``), which every Python install carries. Batches are a pure
function of ``(seed, step)``, so the only data position a checkpoint needs is the step number.

Size: the corpus (what is read, how it is split, how it is described) and the batches cut from
it are one concern: both define which bytes a run trains and is scored on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import os
import stat
import sysconfig
from pathlib import Path

import numpy as np

from leanstep.common.checks import is_int
from leanstep.common.files import describe_skipped, expand_path, read_regular_file, stat_path, walk_regular_files
from leanstep.training.installed_corpus import INSTALLED_PYTHON, package_files, package_roots, sha256_hex

#: Cap on the default corpus, so that loading it takes a fraction of a second.
DEFAULT_CORPUS_BYTES = 8_000_000
#: The most bytes ``--data`` may hold (one file, or all regular files of a folder): 1 GiB. The
#: corpus is held in memory about twice over (the bytes read, then the train/held-out arrays).
MAX_CORPUS_BYTES = 1 << 30
#: The most entries (files, folders, anything) a ``--data`` folder may hold, so that pointing
#: ``--data`` at ``/`` ends in an error rather than an hour-long walk.
MAX_CORPUS_ENTRIES = 1_000_000
#: How :attr:`Corpus.skipped` counts a file of a ``--data`` folder that holds a NUL byte.
BINARY_FILE = "a binary file (a NUL byte)"
#: Folder names left out of the default corpus: installed packages and the stdlib's own tests
#: (huge, repetitive generated data files that would dominate the sample).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def default_corpus_paths(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path, up to ``max_bytes`` in all.

    Files under any folder named in :data:`EXCLUDED_DIRS` are left out. Files are taken in
    sorted order of their POSIX relative path while the running total stays within
    ``max_bytes``, so the list depends only on the Python installation.

    Raises:
      ValueError: ``max_bytes`` is not a positive int.
    """
    if not is_int(max_bytes) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive int; got {max_bytes!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates = []
    for folder, dirs, files in os.walk(root):
        # Pruning here, not filtering afterwards: site-packages can hold 10x the stdlib.
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        candidates += [Path(folder, name) for name in files if name.endswith(".py")]
    candidates.sort(key=lambda p: p.relative_to(root).as_posix())
    chosen, total = [], 0
    for path in candidates:
        try:
            info = path.stat()
        except OSError:  # a broken link or a symlink loop in a damaged install: not source
            continue
        if not stat.S_ISREG(info.st_mode):
            continue
        if total + info.st_size > max_bytes:
            break
        chosen.append(path)
        total += info.st_size
    return chosen


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """A byte corpus split into training and held-out parts.

    Attributes:
      source: what was loaded (``"stdlib:<dir>"`` or the path given).
      split: ``"files"`` (whole files held out) or ``"bytes"`` (the last bytes of one file).
      heldout_fraction: the fraction asked for.
      train, heldout: the concatenated bytes, ``uint8`` arrays.
      train_files, heldout_files: relative names of the files in each part.
      skipped: entries of a ``--data`` folder passed over because they are not regular files,
        cannot be read, are binary (:data:`BINARY_FILE`) or empty, by kind
        (``{"a FIFO (named pipe)": 1}``); empty for a file.
      file_sha256: ``{"train": {name: sha256}, "heldout": {...}}`` of every file, recorded by
        ``--data @python`` (:mod:`leanstep.training.installed_corpus`); empty otherwise.
    """

    source: str
    split: str
    heldout_fraction: float
    train: np.ndarray
    heldout: np.ndarray
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    file_sha256: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)

    def describe(self) -> dict[str, object]:
        """A JSON-ready record of the data and its split, for ``config.json``.

        ``files_sha256`` hashes the file list with each file's part; ``data_sha256`` hashes the
        bytes of both parts, so two runs agree on data exactly when both hashes match.
        ``skipped_entries`` appears only when a folder held entries that were not read, and
        ``file_sha256`` (every file's hash) with ``--data @python``.
        """
        listing = "".join(f"train\t{n}\n" for n in self.train_files)
        listing += "".join(f"heldout\t{n}\n" for n in self.heldout_files)
        data_hash = hashlib.sha256(self.train.tobytes())
        data_hash.update(self.heldout.tobytes())
        return {
            "source": self.source,
            "split": self.split,
            "heldout_fraction": self.heldout_fraction,
            "train_files": len(self.train_files),
            "heldout_files": len(self.heldout_files),
            "train_bytes": int(self.train.size),
            "heldout_bytes": int(self.heldout.size),
            "files_sha256": hashlib.sha256(listing.encode()).hexdigest(),
            "data_sha256": data_hash.hexdigest(),
            **({"skipped_entries": dict(sorted(self.skipped.items()))} if self.skipped else {}),
            **({"file_sha256": self.file_sha256} if self.file_sha256 else {}),
        }


def _read_text_files(root: Path, what: str) -> tuple[list[tuple[str, bytes]], dict[str, int]]:
    """Every non-empty text file under ``root`` as ``(relative posix name, bytes)``, sorted.

    Read by :func:`leanstep.common.files.walk_regular_files` within :data:`MAX_CORPUS_BYTES` and
    :data:`MAX_CORPUS_ENTRIES`: hidden files and folders (``.git``) are left out; FIFOs, sockets,
    devices, symlink loops, symlinked folders and unreadable entries are skipped and counted
    (the second value), never opened in a way that blocks. Files containing a NUL byte are taken
    as binary, and left out and counted; so are empty files. Raises ValueError (see
    ``walk_regular_files``).
    """
    found = walk_regular_files(root, what=what, max_bytes=MAX_CORPUS_BYTES, max_entries=MAX_CORPUS_ENTRIES)
    for name, _ in found.files:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # undecodable bytes in the name: the listing is hashed and recorded as UTF-8
            raise ValueError(
                f"--data folder {str(root)!r} holds a file whose name is not UTF-8: {name!r}; rename it or "
                "move it out of --data"
            ) from None
    skipped = dict(found.skipped)
    texts = []
    for name, content in found.files:
        kind = "an empty file" if not content else BINARY_FILE if b"\0" in content else None
        if kind is None:
            texts.append((name, content))
        else:
            skipped[kind] = skipped.get(kind, 0) + 1
    return texts, skipped


def _heldout_indices(n_files: int, fraction: float) -> set[int]:
    """``min(n - 1, max(1, round(n * fraction)))`` indices spread evenly over ``range(n)``."""
    n_heldout = min(n_files - 1, max(1, round(n_files * fraction)))
    return {int((k + 0.5) * n_files / n_heldout) for k in range(n_heldout)}


def _as_array(chunks: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()


def load_corpus(
    path: str | os.PathLike[str] | None = None,
    *,
    heldout_fraction: float = 0.1,
    seq_len: int | None = None,
) -> Corpus:
    """Loads a byte corpus and splits it deterministically into train and held-out parts.

    - ``None``: the standard library corpus of :func:`default_corpus_paths`.
    - ``"@python"``: the same, plus every installed package's ``.py`` files for training
      (:mod:`leanstep.training.installed_corpus`); its held-out files are ``None``'s.
    - a folder: every text file under it (see ``_read_text_files``), sorted by relative path.
    - a regular file: its bytes, whatever they are.

    With two or more files, whole files are held out: ``round(n * heldout_fraction)`` of them,
    but at least one and at most ``n - 1``, at evenly spread positions of the sorted list
    (``split="files"``), so no held-out text was seen in training. With one file, its last
    ``heldout_fraction`` of bytes are held out (``split="bytes"``).

    Args:
      path: the ``--data`` argument.
      heldout_fraction: in ``(0, 1)``.
      seq_len: if given, both parts must hold at least one window of ``seq_len + 1`` bytes.

    Returns:
      A :class:`Corpus`.

    ``~`` in ``path`` is expanded. Only regular files are read (see :mod:`leanstep.common.files`):
    a FIFO, socket or device named by ``path`` is refused, one inside a folder is skipped and
    counted in :attr:`Corpus.skipped`; a file or folder of more than :data:`MAX_CORPUS_BYTES`
    bytes, or a folder of more than :data:`MAX_CORPUS_ENTRIES` entries, is refused.

    Raises:
      ValueError: naming ``--data`` and the path: it is missing, a symlink loop, not a regular
        file or folder (a FIFO, a device), unreadable, empty, over a limit, has no readable text,
        or a part is too small; ``heldout_fraction`` is outside ``(0, 1)``.
    """
    if not isinstance(heldout_fraction, (int, float)) or not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1); got {heldout_fraction!r}")
    expected = "expected a text file or a folder of text files"
    skipped: dict[str, int] = {}
    if path is None or path == INSTALLED_PYTHON:
        root = Path(sysconfig.get_paths()["stdlib"])
        source = f"stdlib:{root}"
        files = [
            (
                p.relative_to(root).as_posix(),
                read_regular_file(p, what=f"standard library file {str(p)!r}", limit=DEFAULT_CORPUS_BYTES),
            )
            for p in default_corpus_paths()
        ]
    else:
        root = expand_path(path)
        source = str(root)
        try:
            if stat.S_ISDIR(stat_path(root, what=f"--data path {source!r}").st_mode):
                files, skipped = _read_text_files(root, f"--data folder {source!r}")
            else:
                files = [(root.name, read_regular_file(root, what=f"--data file {source!r}", limit=MAX_CORPUS_BYTES))]
        except ValueError as error:
            if str(path).startswith("@") and not os.path.lexists(root):  # a name, not a path: say the one there is
                raise ValueError(
                    f"{error}; the one corpus named with @ is {INSTALLED_PYTHON}, in lower case (the installed "
                    f"packages' Python source), else {expected}"
                ) from None
            raise ValueError(f"{error}; {expected}") from None
        if not files:
            left_out = f" (skipped: {describe_skipped(skipped)})" if skipped else ""
            raise ValueError(f"--data folder {source!r} holds no readable, non-empty text file{left_out}; {expected}")
        if not files[0][1]:
            raise ValueError(f"--data file {source!r} is empty; {expected}")

    if path == INSTALLED_PYTHON:
        corpus = _with_packages(files, heldout_fraction, source)
    elif len(files) == 1:
        name, content = files[0]
        cut = len(content) - int(len(content) * heldout_fraction)
        corpus = Corpus(
            source, "bytes", heldout_fraction,
            _as_array([content[:cut]]), _as_array([content[cut:]]), (name,), (name,), skipped,
        )  # fmt: skip
    else:
        held = _heldout_indices(len(files), heldout_fraction)
        train = [f for i, f in enumerate(files) if i not in held]
        heldout = [f for i, f in enumerate(files) if i in held]
        corpus = Corpus(
            source, "files", heldout_fraction,
            _as_array([c for _, c in train]), _as_array([c for _, c in heldout]),
            tuple(n for n, _ in train), tuple(n for n, _ in heldout), skipped,
        )  # fmt: skip

    need = 2 if seq_len is None else _check_positive("seq_len", seq_len) + 1
    for part, data in (("training", corpus.train), ("held-out", corpus.heldout)):
        if data.size < need:
            raise ValueError(
                f"--data {source!r}: the {part} part has {data.size} bytes, fewer than the {need} "
                f"needed for one sequence (seq_len + 1); use more data or a different heldout_fraction"
            )
    return corpus


def _with_packages(stdlib: list[tuple[str, bytes]], heldout_fraction: float, source: str) -> Corpus:
    """``--data @python``: the standard library split as by default, the packages' files added to
    training (less any whose bytes equal a held-out file's), every file's SHA-256 recorded."""
    held = _heldout_indices(len(stdlib), heldout_fraction)
    heldout = [f for i, f in enumerate(stdlib) if i in held]
    hashes = {"heldout": {name: sha256_hex(content) for name, content in heldout}, "train": {}}
    heldout_hashes = set(hashes["heldout"].values())
    train = []
    for name, content in [f for i, f in enumerate(stdlib) if i not in held] + package_files():
        digest = sha256_hex(content)
        if digest not in heldout_hashes:
            train.append((name, content))
            hashes["train"][name] = digest
    roots = ", ".join(str(p) for p in package_roots())
    return Corpus(
        f"python:{source} + packages:{roots}", "files", heldout_fraction,
        _as_array([c for _, c in train]), _as_array([c for _, c in heldout]),
        tuple(n for n, _ in train), tuple(n for n, _ in heldout), {}, hashes,
    )  # fmt: skip


def _check_positive(name: str, value: object) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return int(value)


def _check_data(data: np.ndarray, seq_len: int, what: str) -> np.ndarray:
    data = np.asarray(data)
    if data.ndim != 1 or not np.issubdtype(data.dtype, np.integer):
        raise ValueError(f"{what} must be a 1-D integer array of tokens; got shape {data.shape}, dtype {data.dtype}")
    if data.size < seq_len + 1:
        raise ValueError(
            f"{what} has {data.size} tokens, fewer than seq_len + 1 = {seq_len + 1}; use more data or a shorter seq_len"
        )
    return data


@dataclasses.dataclass(frozen=True, eq=False)
class BatchSampler:
    """Random training windows, a pure function of ``(seed, step)``.

    .. code-block:: text

        rng     = np.random.default_rng([seed, step])
        offsets = rng.integers(0, len(data) - seq_len, size=batch_size)
        tokens  = data[offsets[:, None] + arange(seq_len + 1)]

    Resuming at step ``k`` therefore replays exactly the batches an uninterrupted run sees; the
    data position to checkpoint is the step.

    Raises:
      ValueError: ``batch_size`` or ``seq_len`` below 1, ``seed`` negative, or ``data`` shorter
        than ``seq_len + 1``.

    Example:
      >>> sampler = BatchSampler(np.arange(100, dtype=np.uint8), batch_size=2, seq_len=3, seed=0)
      >>> sampler.batch_at(7)["tokens"]
      array([[77, 78, 79, 80],
             [ 3,  4,  5,  6]], dtype=int32)
    """

    data: np.ndarray
    batch_size: int
    seq_len: int
    seed: int

    def __post_init__(self) -> None:
        _check_positive("batch_size", self.batch_size)
        _check_positive("seq_len", self.seq_len)
        if not is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int; got {self.seed!r}")
        object.__setattr__(self, "data", _check_data(self.data, self.seq_len, "training data"))

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """The batch for ``step``: ``{"tokens": int32 (batch_size, seq_len + 1)}``.

        Raises:
          ValueError: ``step`` is negative.
        """
        step = operator.index(step)
        if step < 0:
            raise ValueError(f"step must be >= 0; got {step}")
        rng = np.random.default_rng([int(self.seed), step])
        offsets = rng.integers(0, self.data.size - self.seq_len, size=self.batch_size)
        windows = offsets[:, None] + np.arange(self.seq_len + 1)[None, :]
        return {"tokens": self.data[windows].astype(np.int32)}


def heldout_batches(
    data: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None
) -> list[dict[str, np.ndarray]]:
    """Fixed evaluation batches of windows of ``data``: all of it, or a sample spread over all of it.

    Window ``i`` is ``data[i * seq_len : i * seq_len + seq_len + 1]``, so consecutive windows
    share one boundary byte and every byte after the first is a target exactly once. Windows
    fill whole batches of ``batch_size`` (a leftover partial batch is dropped, to keep one
    compiled shape); when there are fewer windows than ``batch_size`` they form one smaller
    batch. When ``max_batches`` allows only ``k`` of the ``n`` windows, they are windows
    ``floor(j n / k)``, ``j < k``: spread evenly over every held-out file, not the first file's
    start, so the estimate is of the whole held-out set.

    Raises:
      ValueError: a size is below 1, or ``data`` is shorter than ``seq_len + 1``.

    Example:
      >>> [b["tokens"].tolist() for b in heldout_batches(np.arange(9, dtype=np.uint8), 2, 3)]
      [[[0, 1, 2, 3], [3, 4, 5, 6]]]
    """
    batch_size = _check_positive("batch_size", batch_size)
    seq_len = _check_positive("seq_len", seq_len)
    if max_batches is not None:
        max_batches = _check_positive("max_batches", max_batches)
    data = _check_data(data, seq_len, "held-out data")
    n_windows = (data.size - 1) // seq_len
    n_batches = max(1, n_windows // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    rows = min(batch_size, n_windows)
    k = n_batches * rows
    spread = max_batches is not None and max_batches < max(1, n_windows // batch_size)
    starts = ((np.arange(k) * n_windows) // k if spread else np.arange(k)) * seq_len
    tokens = data[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int32)
    return [{"tokens": t} for t in tokens.reshape(n_batches, rows, seq_len + 1)]
