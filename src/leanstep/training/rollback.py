r"""Escalation past a burst of loss spikes: roll back, skip the data that caused it, go slower for a while.

The spike guard (:class:`leanstep.SpikeGuard`, ``--spike-guard``) skips a spike inside the
compiled step. A burst of them is another matter: the steps just before a burst were often
already bad (update-norm spikes precede loss spikes), and skipping the worst steps does not bring
the loss back. PaLM's practice, here with ``--spike-rollback``:

.. code-block:: text

    after `after` spikes within `within` steps (the first at step s, the last at step t):
        c = the newest committed checkpoint before step s             none: a warning, the spikes stay skipped
        record the decision in rollbacks.json                           (atomic: what --resume follows)
        metrics.jsonl: its lines after step c move to rolled_back.jsonl; a "rollback" line at step c
        delete the checkpoints after c; restore c
        skip the batches of steps s..t and the next `ahead`: their data positions never come again
        multiply the optimizer's updates by lr_factor until step c + lr_steps

The batch of a step is a pure function of the run's seed and its *data position*; positions
advance one a step, except over the skipped windows (:func:`data_position`), so a skip is exact
and a resumed run takes the same batches. Each checkpoint records how many rollbacks were decided
before it and the recent spikes; a run killed inside a rollback resumes by finishing it
(:func:`pending_rollback`).

Example:
  >>> policy = SpikeRollback.from_string("after=2,within=10,lr=0.5,for=20")
  >>> policy.after, policy.within, policy.lr_factor, policy.lr_steps
  (2, 10, 0.5, 20)
  >>> skips = merge_skips((), (5, 7))    # the batches at positions 5, 6 and 7 never come again
  >>> [data_position(i, skips) for i in range(3, 8)]
  [3, 4, 8, 9, 10]

Size: the rollback's decisions and the records that keep them (rollbacks.json, the metrics
lines) go together: a decision holds exactly when it is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from leanstep.common.checks import is_int

__all__ = [
    "ROLLBACKS_FILE",
    "ROLLED_BACK_FILE",
    "Rollback",
    "SpikeRollback",
    "check_decisions_kept",
    "data_position",
    "logged_rollbacks",
    "merge_skips",
    "pending_rollback",
    "read_rollbacks",
    "record_rollback_lines",
    "write_rollbacks",
]

#: The run directory's list of rollback decisions (``--resume`` follows it).
ROLLBACKS_FILE = "rollbacks.json"
#: Where the lines of ``metrics.jsonl`` a rollback abandoned go (kept, never shown as the run).
ROLLED_BACK_FILE = "rolled_back.jsonl"


@dataclasses.dataclass(frozen=True)
class SpikeRollback:
    """When ``leanstep train`` rolls back past spikes, and what it does then (``--spike-rollback``).

    Attributes:
      after: spikes (steps the guard skipped) that make a burst, an int >= 1 ...
      within: ... within this many steps, an int >= ``after`` (a burst fits in its window).
      lr_factor: the optimizer's updates are multiplied by this after a rollback, in (0, 1].
      lr_steps: ... for this many steps from the checkpoint rolled back to, an int >= 0.
      max_rollbacks: a run that would roll back more often than this stops instead (exit 1).
      ahead: data positions skipped after the burst's last, an int >= 0: bad data comes in
        stretches (a damaged shard), and the stretch's rest, not yet seen, would start another
        burst after the rollback.

    Raises:
      ValueError: a setting outside its form, named.
    """

    after: int = 3
    within: int = 50
    lr_factor: float = 0.5
    lr_steps: int = 100
    max_rollbacks: int = 5
    ahead: int = 50

    def __post_init__(self) -> None:
        for name in ("after", "within", "max_rollbacks"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"SpikeRollback.{name} must be an int >= 1, got {value!r}")
        for name in ("lr_steps", "ahead"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"SpikeRollback.{name} must be an int >= 0, got {value!r}")
        if self.after > self.within:
            raise ValueError(
                f"SpikeRollback.after ({self.after}) must be at most within ({self.within}): "
                f"{self.after} spikes never fall within {self.within} steps, so it would never roll back"
            )
        factor = self.lr_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ValueError(f"SpikeRollback.lr_factor must be a number in (0, 1], got {factor!r}")

    @classmethod
    def from_string(cls, spec: str) -> SpikeRollback | None:
        """``"none"`` (None), ``"on"`` (the defaults), or ``"after=N,within=N,lr=X,for=N,max=N,ahead=N"``.

        Raises:
          ValueError: another form, naming it and the expected one.

        Example:
          >>> SpikeRollback.from_string("on"), SpikeRollback.from_string("none")
          (SpikeRollback(after=3, within=50, lr_factor=0.5, lr_steps=100, max_rollbacks=5, ahead=50), None)
        """
        expected = "none, on, or after=N,within=N,lr=X,for=N,max=N,ahead=N"
        if not isinstance(spec, str):
            raise TypeError(f"a spike rollback is a string, got {type(spec).__name__}")
        spec = spec.strip().lower()
        if spec in ("none", "on"):
            return None if spec == "none" else cls()
        names = {
            "after": "after",
            "within": "within",
            "lr": "lr_factor",
            "for": "lr_steps",
            "max": "max_rollbacks",
            "ahead": "ahead",
        }
        fields: dict[str, Any] = {}
        for part in (p.strip() for p in spec.split(",")):
            name, sep, value = part.partition("=")
            if not sep or name not in names or names[name] in fields:
                raise ValueError(
                    f"unknown or repeated spike-rollback setting {part!r} in {spec!r}; expected {expected}"
                )
            try:
                fields[names[name]] = float(value) if name == "lr" else int(value)
            except ValueError:
                raise ValueError(f"spike-rollback setting {part!r} is not a number; expected {expected}") from None
        try:
            return cls(**fields)
        except ValueError as error:
            raise ValueError(f"{error}; expected {expected}") from None

    def to_string(self) -> str:
        """The ``--spike-rollback`` value of these settings (:meth:`from_string` reads it back).

        Example:
          >>> SpikeRollback(max_rollbacks=6).to_string()
          'after=3,within=50,lr=0.5,for=100,max=6,ahead=50'
        """
        return (
            f"after={self.after},within={self.within},lr={self.lr_factor!r},for={self.lr_steps},"
            f"max={self.max_rollbacks},ahead={self.ahead}"
        )


@dataclasses.dataclass(frozen=True)
class Rollback:
    """One rollback decision, as ``rollbacks.json`` and the ``"rollback"`` line of ``metrics.jsonl`` keep it.

    Attributes:
      at_step: the step whose spike completed the burst.
      to_step: the checkpoint the run went back to (its next step is ``to_step + 1``).
      spikes: the burst's spiked steps.
      skip: ``(first, last)``: the data positions skipped (the batches of the spiked steps' span,
        and ``ahead`` more).
      lr_factor: the updates' factor after it ...
      lr_until: ... until this step (the factor applies to steps ``<= lr_until``).
    """

    at_step: int
    to_step: int
    spikes: tuple[int, ...]
    skip: tuple[int, int]
    lr_factor: float
    lr_until: int

    def to_json(self) -> dict[str, Any]:
        """A JSON object (lists for tuples)."""
        return {**dataclasses.asdict(self), "spikes": list(self.spikes), "skip": list(self.skip)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Rollback:
        """The decision :meth:`to_json` wrote."""
        return cls(
            int(obj["at_step"]),
            int(obj["to_step"]),
            tuple(int(s) for s in obj["spikes"]),
            (int(obj["skip"][0]), int(obj["skip"][1])),
            float(obj["lr_factor"]),
            int(obj["lr_until"]),
        )

    def line(self) -> dict[str, Any]:
        """Its ``metrics.jsonl`` line: ``kind`` ``"rollback"`` at ``step`` = ``to_step``, where the run continues."""
        return {"kind": "rollback", "step": self.to_step, **self.to_json()}


def merge_skips(skips: Sequence[tuple[int, int]], new: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """``skips`` (sorted, disjoint, inclusive ranges of data positions) with ``new`` merged in.

    Example:
      >>> merge_skips(((3, 4), (10, 12)), (4, 10))
      ((3, 12),)
    """
    merged: list[tuple[int, int]] = []
    for first, last in sorted([*skips, new]):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return tuple(merged)


def data_position(index: int, skips: Sequence[tuple[int, int]]) -> int:
    """The data position of the ``index``-th batch (0-based) of a run that skips ``skips``.

    Positions count up from 0, passing over every skipped range: the ``index``-th position not
    in any of ``skips`` (sorted, disjoint, inclusive).

    Example:
      >>> data_position(0, ((0, 1),)), data_position(4, ((2, 2), (4, 5)))
      (2, 7)
    """
    position = index
    for first, last in skips:
        if position >= first:
            position += last - first + 1
    return position


def read_rollbacks(out: Path) -> list[Rollback]:
    """The rollback decisions of the run in ``out`` (none: no file).

    Raises:
      ValueError: the file is not such a list.
    """
    path = Path(out) / ROLLBACKS_FILE
    if not path.exists():
        return []
    try:
        return [Rollback.from_json(obj) for obj in json.loads(path.read_text(encoding="utf-8"))]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, IndexError, ValueError) as error:
        raise ValueError(
            f"{path} is not a list of rollbacks as leanstep writes it ({error}); put back the file the run wrote, "
            "or start again with a new --out"
        ) from None


def logged_rollbacks(metrics: Path) -> list[Rollback]:
    """The decisions of the ``"rollback"`` lines of ``metrics`` (a ``metrics.jsonl``; none: no file), in order.

    A rollback's line stays in ``metrics.jsonl``: a later rollback goes back no further than the
    checkpoint an earlier one restored, so it moves only lines after that. A line cut short by a
    kill, or one that is not a decision, is passed over.
    """
    metrics = Path(metrics)
    if not metrics.is_file():
        return []
    logged: list[Rollback] = []
    for line in metrics.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            obj = json.loads(line)
            if isinstance(obj, dict) and obj.get("kind") == "rollback":
                logged.append(Rollback.from_json(obj))
        except (json.JSONDecodeError, KeyError, TypeError, IndexError, ValueError):
            continue
    return logged


def check_decisions_kept(
    path: Path, rollbacks: Sequence[Rollback], *, saved: int, step: int | None, logged: Sequence[Rollback]
) -> None:
    """Refuses a ``rollbacks.json`` (at ``path``, holding ``rollbacks``) that lost or changed a decision of its run.

    A run's decisions are recorded three times: in ``rollbacks.json``, as a count in each
    checkpoint (``saved``: decided before checkpoint ``step`` was saved) and as the
    ``"rollback"`` lines of ``metrics.jsonl`` (``logged``). The file must hold at least as many
    as either, and agree with the log where both hold one (the file may hold one more: a run
    killed between the two writes). A resume without them would take other batches, at another
    learning rate, and say nothing.

    Raises:
      ValueError: one line naming the file and what it is missing, or the decision that differs.

    Example:
      >>> r = Rollback(40, 30, (35, 38, 40), (34, 39), 0.5, 130)
      >>> check_decisions_kept(Path("run/rollbacks.json"), [r], saved=1, step=45, logged=[r])
      >>> check_decisions_kept(Path("run/rollbacks.json"), [], saved=1, step=45, logged=[r])
      Traceback (most recent call last):
      ...
      ValueError: --resume: run/rollbacks.json is missing, and checkpoint step 45 was saved after 1 rollback decision(s); ...
    """
    held = f"holds {len(rollbacks)}" if path.exists() else "is missing"
    if len(logged) > saved:
        needed, source = len(logged), f"metrics.jsonl records {len(logged)}"
    else:
        needed, source = saved, f"checkpoint step {step} was saved after {saved}"
    if len(rollbacks) < needed:
        raise ValueError(
            f"--resume: {path} {held}, and {source} rollback decision(s); without them the run would go on "
            'with other batches and learning rates. Put the file back (metrics.jsonl\'s "rollback" lines hold '
            "the decisions too), or start again with a new --out"
        )
    for number, (kept, line) in enumerate(zip(rollbacks, logged, strict=False), start=1):
        if kept != line:
            raise ValueError(
                f'--resume: {path}: decision {number} differs from metrics.jsonl\'s "rollback" line '
                f"({json.dumps(kept.to_json())} vs {json.dumps(line.to_json())}); put back the file the run "
                "wrote, or start again with a new --out"
            )


def write_rollbacks(out: Path, rollbacks: Sequence[Rollback]) -> None:
    """Writes the decisions atomically (a temporary file, fsync, rename)."""
    path = Path(out) / ROLLBACKS_FILE
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as file:
        json.dump([r.to_json() for r in rollbacks], file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)


def record_rollback_lines(metrics: Path, rollback: Rollback) -> None:
    """``metrics.jsonl`` as the run continues after ``rollback``: its lines after ``to_step`` moved
    to ``rolled_back.jsonl`` (appended), then the rollback's line. Doing it again changes nothing.

    Raises:
      OSError: a file cannot be read or written.
    """
    metrics = Path(metrics)
    if not metrics.exists():
        return
    kept: list[str] = []
    abandoned: list[str] = []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        late = isinstance(obj, dict) and isinstance(obj.get("step"), int) and obj["step"] > rollback.to_step
        (abandoned if late else kept).append(line)
    mine = json.dumps(rollback.line())
    if kept and kept[-1] == mine and not abandoned:
        return
    if abandoned:
        with (metrics.parent / ROLLED_BACK_FILE).open("a", encoding="utf-8") as file:
            file.write("".join(line + "\n" for line in abandoned))
            file.flush()
            os.fsync(file.fileno())
    if not kept or kept[-1] != mine:
        kept.append(mine)
    tmp = metrics.with_name(metrics.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, metrics)


def pending_rollback(rollbacks: Sequence[Rollback], saved_rollbacks: int) -> Rollback | None:
    """The rollback a resumed run must finish: decided after its checkpoint was saved, or None.

    A checkpoint records how many rollbacks were decided before it (``saved_rollbacks``). If
    ``rollbacks.json`` holds more, the run was stopped inside the newest one: it resumes from
    that rollback's ``to_step`` (a later checkpoint is abandoned), with its factor, and finishes it.

    Example:
      >>> r = Rollback(40, 30, (35, 38, 40), (34, 39), 0.5, 130)
      >>> pending_rollback([r], 0) == r, pending_rollback([r], 1)
      (True, None)
    """
    return rollbacks[-1] if len(rollbacks) > saved_rollbacks else None
