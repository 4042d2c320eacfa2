"""The ``metrics.jsonl`` file: append records to it, cut it back to a checkpoint, read it.

``leanstep train`` appends one JSON object per line: ``"train"`` records after every step and
``"eval"`` records after every held-out evaluation (:mod:`leanstep.training.records`). A
resumed run first drops the lines past its checkpoint (:func:`truncate_metrics`); a run
killed without that appends the steps after its last checkpoint again, so the log is a
sequence of timelines. :func:`read_metrics` resolves them: the latest one wins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import stat
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

import numpy as np

from leanstep.training.records import EvalRecord, TrainRecord, parse_record

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = ["MetricsWriter", "RunMetrics", "read_metrics", "truncate_metrics"]


class MetricsWriter:
    """Appends records to ``metrics.jsonl``, one JSON object per line.

    Each :meth:`write` is one write and one flush, so a kill cuts at most the last line
    (which :func:`read_metrics` skips and :func:`truncate_metrics` drops). ``OSError`` from
    opening or writing propagates; the caller says what it means for the run.

    Args:
      path: the file; created if missing, appended to if not.

    Example:
      >>> import pathlib, tempfile
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
      >>> with MetricsWriter(path) as log:
      ...     log.write(TrainRecord(1, 2.0, 0.5, 1.0, False, False, 0, 1e3, 0.5, 1e-3),
      ...               EvalRecord.from_loss(1, 1.5))
      >>> print(path.read_text(), end="")
      {"kind": "train", "step": 1, "loss": 2.0, "grad_norm": 0.5, "loss_scale": 1.0,
       "skipped": false, "clipped": false, "consecutive_skips": 0, "tokens_per_sec": 1000.0,
       "elapsed_s": 0.5, "lr": 0.001, "spiked": false}
      {"kind": "eval", "step": 1, "heldout_loss": 1.5, "heldout_bits_per_byte": 2.16...}
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        self._file: IO[str] | None = None

    def __enter__(self) -> Self:
        self._file = self.path.open("a", encoding="utf-8")
        return self

    def write(self, *records: TrainRecord | EvalRecord) -> None:
        """Appends ``records``, one line each, in one write.

        Raises:
          TypeError: a record is not a :class:`TrainRecord` or :class:`EvalRecord` (a
            :class:`~leanstep.training.records.Note` is not logged); nothing is written.
          RuntimeError: the writer is not open (use it in a ``with`` block).
          OSError: the write or flush failed.
        """
        for record in records:
            if not isinstance(record, (TrainRecord, EvalRecord)):
                raise TypeError(
                    f"metrics.jsonl holds TrainRecord and EvalRecord lines; got {type(record).__name__} {record!r}"
                )
        if self._file is None:
            raise RuntimeError(f"MetricsWriter({str(self.path)!r}) is not open; use it in a with block")
        self._file.write("".join(json.dumps(record.to_json()) + "\n" for record in records))
        self._file.flush()

    def rewrite(self, change: Callable[[pathlib.Path], None]) -> None:
        """Closes the file, lets ``change(path)`` replace it (a rollback's rewrite), and opens it again.

        Raises:
          OSError: from ``change`` or from opening the file again.
        """
        self.__exit__()
        change(self.path)
        self.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):  # a failed write has been raised already
                self._file.close()
            self._file = None


def truncate_metrics(path: str | os.PathLike[str], last_step: int) -> None:
    """Drops the lines a killed run wrote past ``last_step``, so the log matches the state.

    Lines cut short by the kill (not JSON) and lines without an integer ``step`` go too. The
    file is replaced atomically (written next to it, then renamed); a missing file is left
    missing.

    Args:
      path: the metrics file.
      last_step: the step of the checkpoint the run resumes from.

    Raises:
      OSError: the file cannot be read or replaced.

    Example:
      >>> import pathlib, tempfile
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
      >>> with MetricsWriter(path) as log:
      ...     for step in (1, 2, 3):
      ...         log.write(EvalRecord.from_loss(step, 1.0))
      >>> with path.open("a") as file:  # the kill, mid-line
      ...     _ = file.write('{"kind": "eval", "st')
      >>> truncate_metrics(path, 2)
      >>> [json.loads(line)["step"] for line in path.read_text().splitlines()]
      [1, 2]
    """
    path = pathlib.Path(path)
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the kill
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class RunMetrics:
    """A run's records, one per step (latest timeline), sorted by step.

    Attributes:
      train: the ``"train"`` records.
      eval: the ``"eval"`` records.
      name: the run's name (its directory's name).
      resumed_at: first step of each resumed timeline (a step not above one logged before it).
      dropped_lines: 1-based numbers of lines cut off by a crash mid-write and skipped.
    """

    train: tuple[TrainRecord, ...] = ()
    eval: tuple[EvalRecord, ...] = ()
    name: str = "run"
    resumed_at: tuple[int, ...] = ()
    dropped_lines: tuple[int, ...] = ()

    def train_column(self, field: str) -> np.ndarray:
        """``field`` of every train record as a float64 array (``step`` too)."""
        return np.array([getattr(r, field) for r in self.train], dtype=np.float64)

    def eval_column(self, field: str) -> np.ndarray:
        """``field`` of every eval record as a float64 array."""
        return np.array([getattr(r, field) for r in self.eval], dtype=np.float64)


def _decode_line(line: str) -> tuple[object | None, bool]:
    """(object, whether a crash fragment was dropped) for one stripped line."""
    decoder = json.JSONDecoder()
    try:
        return decoder.decode(line), False
    except json.JSONDecodeError:
        pass
    if not line.startswith("{"):  # every record, and so every cut-off record, starts with "{"
        raise json.JSONDecodeError("not a JSON record", line, 0)
    # A run killed mid-write leaves a fragment without newline; the resumed run then
    # appends its first record to it. Recover that record from the line's tail.
    for start in (i for i, c in enumerate(line) if c == "{" and i > 0):
        try:
            obj, end = decoder.raw_decode(line, start)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and not line[end:].strip():
            return obj, True
    if not line.endswith("}"):
        return None, True
    raise json.JSONDecodeError("not a JSON record", line, 0)


def read_metrics(path: str | os.PathLike[str]) -> RunMetrics:
    """Read ``metrics.jsonl`` (or a run directory holding it) into :class:`RunMetrics`.

    Resumes are resolved like this: a train record for step ``s`` discards every earlier
    train record with step ``>= s`` and eval record with step ``> s`` (they belong to the
    abandoned timeline), so the last occurrence of a step wins. ``NaN``/``Infinity`` tokens
    and ``null`` floats read as non-finite floats.

    Args:
      path: the metrics file, or a directory containing ``metrics.jsonl``.

    Returns:
      The records sorted by step, named after the run directory.

    Raises:
      FileNotFoundError: the file does not exist.
      ValueError: a line is neither a record nor a cut-off record, or a record lacks a field.

    Example:
      >>> import pathlib, tempfile
      >>> run = pathlib.Path(tempfile.mkdtemp()) / "demo"; run.mkdir()
      >>> rec = lambda s, loss: json.dumps(dict(kind="train", step=s, loss=loss, grad_norm=1.0,
      ...     loss_scale=2.0**15, skipped=False, clipped=False, consecutive_skips=0,
      ...     tokens_per_sec=1e4, elapsed_s=s, lr=1e-3))
      >>> lines = [rec(1, 5.0), rec(2, 4.0), rec(2, 3.5), rec(3, float("nan")), rec(4, 1)[:20]]
      >>> _ = (run / "metrics.jsonl").write_text("\\n".join(lines))
      >>> m = read_metrics(run)
      >>> [(r.step, r.loss) for r in m.train], m.resumed_at, m.dropped_lines
      ([(1, 5.0), (2, 3.5), (3, nan)], (2,), (5,))
    """
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}")
    train: dict[int, TrainRecord] = {}
    evals: dict[int, EvalRecord] = {}
    resumed_at: list[int] = []
    dropped: list[int] = []
    last_step = 0
    # Non-blocking, and checked once open: a FIFO swapped in after the check above never hangs.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"metrics file {str(path)!r} is not a regular file")
    with os.fdopen(fd, encoding="utf-8", errors="replace") as file:
        for number, raw in enumerate(file, start=1):
            line = raw.strip()
            if not line:
                continue
            where = f"{path}:{number}"
            try:
                obj, fragment = _decode_line(line)
            except json.JSONDecodeError:
                raise ValueError(f"{where} is not JSON: {line[:80]!r}") from None
            if fragment:
                dropped.append(number)
            if obj is None:
                continue
            record = parse_record(obj, where)
            if isinstance(record, TrainRecord):
                if train and record.step <= last_step:
                    resumed_at.append(record.step)
                    train = {s: r for s, r in train.items() if s < record.step}
                    evals = {s: r for s, r in evals.items() if s <= record.step}
                train[record.step] = record
                last_step = record.step  # steps only increase within one timeline
            elif isinstance(record, EvalRecord):
                evals[record.step] = record
    return RunMetrics(
        train=tuple(train[s] for s in sorted(train)),
        eval=tuple(evals[s] for s in sorted(evals)),
        name=path.resolve().parent.name or "run",
        resumed_at=tuple(resumed_at),
        dropped_lines=tuple(dropped),
    )
