"""The records a training run emits: one type per kind, used by writer, reader and displays.

``leanstep train`` emits a :class:`TrainRecord` after every optimizer step, an
:class:`EvalRecord` after every held-out evaluation and a :class:`Note` for each warning.
The first two are the lines of ``metrics.jsonl`` (:meth:`TrainRecord.to_json` gives a line's
object, :func:`parse_record` reads it back); notes are shown, never logged. This module
imports nothing of leanstep, so every other module can depend on it.

Example:
  >>> import json
  >>> record = TrainRecord(step=3, loss=2.5, grad_norm=0.75, loss_scale=32768.0, skipped=False,
  ...     clipped=True, consecutive_skips=0, tokens_per_sec=1e4, elapsed_s=1.5, lr=1e-3)
  >>> line = json.dumps(record.to_json())
  >>> line
  '{"kind": "train", "step": 3, "loss": 2.5, "grad_norm": 0.75, "loss_scale": 32768.0,
    "skipped": false, "clipped": true, "consecutive_skips": 0, "tokens_per_sec": 10000.0,
    "elapsed_s": 1.5, "lr": 0.001, "spiked": false}'
  >>> parse_record(json.loads(line)) == record
  True
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from typing import Any, Generic, Literal, NamedTuple, TypeVar

__all__ = ["EvalRecord", "Note", "Record", "RunStart", "TrainRecord", "parse_record"]

_T = TypeVar("_T")


class _class_constant(Generic[_T]):
    """A read-only attribute, the same on a class and its instances, that is not a field of a NamedTuple.

    ``kind = "train"`` in a NamedTuple's body does the same at run time, but type checkers read
    every assignment there as a field (``kind: ClassVar[str]`` would be one at run time).
    """

    def __init__(self, value_of: Callable[[Any], _T]) -> None:
        self._value = value_of(None)

    def __get__(self, instance: object, owner: type | None = None) -> _T:
        return self._value


class TrainRecord(NamedTuple):
    """One ``"train"`` line: the state after optimizer step ``step`` (1-based).

    Attributes:
      step: optimizer steps taken, skipped ones included.
      loss: the training loss of the step's batch (nats per byte).
      grad_norm: the global norm of the unscaled gradient, before clipping.
      loss_scale: the loss scale after the step.
      skipped: whether the update was skipped (a non-finite gradient).
      clipped: whether the gradient was clipped to ``max_grad_norm``.
      consecutive_skips: skipped steps in a row up to and including this one.
      tokens_per_sec: throughput of this step.
      elapsed_s: wall-clock time of the run so far from the start of each session of
        :func:`leanstep.training.train` (loading and compiling included), resumes included.
      lr: the learning rate the step's update used.
      spiked: whether the update was skipped for a loss spike (``--spike-guard``; a finite step).
    """

    step: int
    loss: float
    grad_norm: float
    loss_scale: float
    skipped: bool
    clipped: bool
    consecutive_skips: int
    tokens_per_sec: float
    elapsed_s: float
    lr: float
    spiked: bool = False

    @_class_constant
    def kind(self) -> Literal["train"]:
        return "train"

    def to_json(self) -> dict[str, Any]:
        """``{"kind": "train", <fields in order>}`` with Python ints, floats and bools."""
        return _to_json(self)


class EvalRecord(NamedTuple):
    """One ``"eval"`` line: held-out loss of the parameters after step ``step``.

    Attributes:
      step: the step after which the parameters were evaluated.
      heldout_loss: mean loss over the held-out batches (nats per byte).
      heldout_bits_per_byte: the same loss in bits, ``heldout_loss / ln 2``.
    """

    step: int
    heldout_loss: float
    heldout_bits_per_byte: float

    @_class_constant
    def kind(self) -> Literal["eval"]:
        return "eval"

    @classmethod
    def from_loss(cls, step: int, heldout_loss: float) -> EvalRecord:
        """The record of a held-out loss in nats; bits per byte are ``heldout_loss / ln 2``.

        Example:
          >>> EvalRecord.from_loss(50, 2 * math.log(2))
          EvalRecord(step=50, heldout_loss=1.386..., heldout_bits_per_byte=2.0)
        """
        heldout_loss = float(heldout_loss)
        return cls(int(step), heldout_loss, heldout_loss / math.log(2))

    def to_json(self) -> dict[str, Any]:
        """``{"kind": "eval", <fields in order>}`` with Python ints and floats."""
        return _to_json(self)


class Note(NamedTuple):
    """A message for the person running training (a warning); shown, not logged.

    Attributes:
      message: one line of plain text (no markup).
    """

    message: str

    @_class_constant
    def kind(self) -> Literal["note"]:
        return "note"


class RunStart(NamedTuple):
    """The run is about to take its first step (after compiling, restoring and any notes).

    Attributes:
      steps: the run's last step.
      start_step: the step it starts from (a checkpoint's step when resuming, else 0).
    """

    steps: int
    start_step: int

    @_class_constant
    def kind(self) -> Literal["start"]:
        return "start"


#: Anything a run emits.
Record = TrainRecord | EvalRecord | Note | RunStart

_RECORD_TYPES: dict[str, type[TrainRecord | EvalRecord]] = {
    "train": TrainRecord,
    "eval": EvalRecord,
}
_FIELDS = {kind: tuple(typing.get_type_hints(record_type).items()) for kind, record_type in _RECORD_TYPES.items()}


def _to_json(record: TrainRecord | EvalRecord) -> dict[str, Any]:
    # int(), float() and bool() turn NumPy scalars into what json.dumps writes as before.
    values = {field: kind(value) for (field, kind), value in zip(_FIELDS[record.kind], record)}
    return {"kind": record.kind, **values}


def _coerce(value: object, kind: type, where: str) -> Any:
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is bool:
        if isinstance(value, bool) or value in (0, 1):
            return bool(value)
    elif value is None:  # a writer that maps non-finite floats to null
        return math.nan
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"{where} is {value!r}; expected {kind.__name__}")


def parse_record(obj: object, where: str = "record") -> TrainRecord | EvalRecord | None:
    """The record one decoded ``metrics.jsonl`` line holds; None for kinds of other readers.

    Integers read as floats where a float is due, ``0``/``1`` as bools, and ``null`` as NaN.

    Args:
      obj: the line's decoded JSON value.
      where: how error messages name the line (e.g. ``"metrics.jsonl:7"``).

    Returns:
      A :class:`TrainRecord` or :class:`EvalRecord`, or None when ``kind`` is another string.

    Raises:
      ValueError: ``obj`` is not an object, has no ``kind``, lacks a field of its kind, or has
        a value of the wrong type; the message starts with ``where``.

    Example:
      >>> parse_record({"kind": "eval", "step": 4, "heldout_loss": 1, "heldout_bits_per_byte": None})
      EvalRecord(step=4, heldout_loss=1.0, heldout_bits_per_byte=nan)
      >>> parse_record({"kind": "eval", "step": 4}, "metrics.jsonl:2")
      Traceback (most recent call last):
      ValueError: metrics.jsonl:2 ('eval' record) lacks the field 'heldout_loss'
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{where} is {obj!r}; expected a JSON object")  # noqa: TRY004 - bad data (as documented), not a bad call
    if "kind" not in obj:
        raise ValueError(f"{where} has no 'kind' field; expected 'train' or 'eval'")
    record_type = _RECORD_TYPES.get(obj["kind"]) if isinstance(obj["kind"], str) else None
    if record_type is None:  # other kinds are for other readers
        return None
    values = []
    defaults = record_type._field_defaults  # fields newer than some runs' lines (spiked): defaulted
    for field, kind in _FIELDS[obj["kind"]]:
        if field not in obj and field in defaults:
            values.append(defaults[field])
            continue
        if field not in obj:
            raise ValueError(f"{where} ({obj['kind']!r} record) lacks the field {field!r}")
        values.append(_coerce(obj[field], kind, f"{where} field {field!r}"))
        if field in ("step", "consecutive_skips") and values[-1] < 0:
            raise ValueError(f"{where} field {field!r} is {values[-1]}; expected an integer >= 0")
    return record_type(*values)
