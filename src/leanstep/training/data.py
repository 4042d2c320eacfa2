"""Real bytes to train on without a download, split by file, and deterministic batches.

The default corpus is this machine's Python standard library source (``*.py`` under
``sysconfig.get_paths()["stdlib"]``), which every Python install carries. Batches are a pure
function of ``(seed, step)``, so the only data position a checkpoint needs is the step number.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import os
import sysconfig
from pathlib import Path

import numpy as np

from leanstep._checks import is_int

#: Cap on the default corpus, so that loading it takes a fraction of a second.
DEFAULT_CORPUS_BYTES = 8_000_000
#: Folder names left out of the default corpus: installed packages and the stdlib's own tests
#: (huge, repetitive generated data files that would dominate the sample).
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


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
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
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
    """

    source: str
    split: str
    heldout_fraction: float
    train: np.ndarray
    heldout: np.ndarray
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]

    def describe(self) -> dict[str, object]:
        """A JSON-ready record of the data and its split, for ``config.json``.

        ``files_sha256`` hashes the file list with each file's part; ``data_sha256`` hashes the
        bytes of both parts, so two runs agree on data exactly when both hashes match.
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
        }


def _read_text_files(root: Path) -> list[tuple[str, bytes]]:
    """Every non-empty text file under ``root`` as ``(relative posix name, bytes)``, sorted.

    Hidden files and folders (``.git``) are skipped, as are files that cannot be read or contain
    a NUL byte (taken as binary). Symlinked folders are not followed, so a loop cannot hang us.
    """
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.startswith("."):
                continue
            path = Path(folder, name)
            try:
                content = path.read_bytes()
            except OSError:
                continue
            if content and b"\0" not in content:
                found.append((path.relative_to(root).as_posix(), content))
    return sorted(found)


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
    - a folder: every text file under it (see ``_read_text_files``), sorted by relative path.
    - a file: its bytes, whatever they are.

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

    Raises:
      ValueError: the path is missing, empty, has no readable text, or a part is too small;
        ``heldout_fraction`` is outside ``(0, 1)``.
    """
    if not isinstance(heldout_fraction, (int, float)) or not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1); got {heldout_fraction!r}")
    expected = "expected a text file or a folder of text files"
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        source = f"stdlib:{root}"
        files = [(p.relative_to(root).as_posix(), p.read_bytes()) for p in default_corpus_paths()]
    else:
        root = Path(path)
        source = str(root)
        if not root.exists():
            raise ValueError(f"--data path {source!r} does not exist; {expected}")
        if root.is_dir():
            files = _read_text_files(root)
            if not files:
                raise ValueError(
                    f"--data folder {source!r} holds no readable, non-empty text file; {expected}"
                )
        else:
            try:
                files = [(root.name, root.read_bytes())]
            except OSError as error:
                message = f"--data file {source!r} cannot be read ({error}); {expected}"
                raise ValueError(message) from None
            if not files[0][1]:
                raise ValueError(f"--data file {source!r} is empty; {expected}")

    if len(files) == 1:
        name, content = files[0]
        cut = len(content) - int(len(content) * heldout_fraction)
        corpus = Corpus(
            source, "bytes", heldout_fraction,
            _as_array([content[:cut]]), _as_array([content[cut:]]), (name,), (name,),
        )  # fmt: skip
    else:
        held = _heldout_indices(len(files), heldout_fraction)
        train = [f for i, f in enumerate(files) if i not in held]
        heldout = [f for i, f in enumerate(files) if i in held]
        corpus = Corpus(
            source, "files", heldout_fraction,
            _as_array([c for _, c in train]), _as_array([c for _, c in heldout]),
            tuple(n for n, _ in train), tuple(n for n, _ in heldout),
        )  # fmt: skip

    need = 2 if seq_len is None else _check_positive("seq_len", seq_len) + 1
    for part, data in (("training", corpus.train), ("held-out", corpus.heldout)):
        if data.size < need:
            raise ValueError(
                f"--data {source!r}: the {part} part has {data.size} bytes, fewer than the {need} "
                f"needed for one sequence (seq_len + 1); use more data or a different heldout_fraction"
            )
    return corpus


def _check_positive(name: str, value: object) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return int(value)


def _check_data(data: np.ndarray, seq_len: int, what: str) -> np.ndarray:
    data = np.asarray(data)
    if data.ndim != 1 or not np.issubdtype(data.dtype, np.integer):
        raise ValueError(
            f"{what} must be a 1-D integer array of tokens; got shape {data.shape}, dtype {data.dtype}"
        )
    if data.size < seq_len + 1:
        raise ValueError(
            f"{what} has {data.size} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "use more data or a shorter seq_len"
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
    """Fixed evaluation batches: consecutive windows from the start of ``data``.

    Window ``i`` is ``data[i * seq_len : i * seq_len + seq_len + 1]``, so consecutive windows
    share one boundary byte and every byte after the first is a target exactly once. Windows
    fill whole batches of ``batch_size`` (a leftover partial batch is dropped, to keep one
    compiled shape) up to ``max_batches``; when there are fewer windows than ``batch_size``
    they form one smaller batch.

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
    starts = np.arange(n_batches * rows) * seq_len
    tokens = data[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int32)
    return [{"tokens": t} for t in tokens.reshape(n_batches, rows, seq_len + 1)]
