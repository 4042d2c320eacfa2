"""The values the step loop passes between its step and its periodic actions.

A :class:`Tick` is the loop after one step: the state and the counters carried from step to
step, plus what this step produced (its metrics, its records, the stops it found). The step
makes a tick; each action reads it in its ``when`` and, if it triggers, returns the next one
from its ``do`` (:class:`Action`, :mod:`leanstep.training.actions`,
:mod:`leanstep.training.stops`). :class:`RunClock` is the run's wall-clock and
:class:`RunStopped` what an early stop raises.

Example:
  >>> tick = Tick(state=None, step=4, steps=10, last_saved=2)
  >>> tick.stopping("signal"), tick.with_stop(Stop("signal", 15)).stopping("signal")
  (False, True)
  >>> tick.where_saved("ckpt")
  'the last checkpoint (step 2) is intact in ckpt'
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

import numpy as np
from jax.experimental import multihost_utils

from leanstep.training.records import EvalRecord, TrainRecord
from leanstep.training.rollback import Rollback, merge_skips

if TYPE_CHECKING:
    from leanstep.training.budget import BudgetPlan

__all__ = [
    "STOP_REASONS",
    "Action",
    "RunClock",
    "RunStopped",
    "Stop",
    "Tick",
    "max_over_processes",
    "minimum_loss_scale",
]


class RunStopped(RuntimeError):
    """The run stopped before its last step; the message says why and how to continue.

    Attributes:
      exit_code: the command line's exit status for it (128 + the signal for a signal).
      signal: the signal this process received and :func:`train` delivers again once the run
        is saved and closed (None: not stopped by a signal, or another process of the run was).
    """

    def __init__(self, message: str, exit_code: int, signal: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.signal = signal


#: Why a run stops after a step, with a checkpoint; when several hold, the first one says why.
STOP_REASONS = ("stop_at", "signal", "budget")


class Stop(NamedTuple):
    """A reason to end the run after this step, once the step is saved.

    Attributes:
      reason: one of :data:`STOP_REASONS`: ``--stop-at``, SIGINT/SIGTERM, the end of ``--time-budget``.
      signal: the signal, for ``"signal"`` (another process's, in a multi-process run).
    """

    reason: Literal["stop_at", "signal", "budget"]
    signal: int | None = None


@dataclasses.dataclass(frozen=True)
class Tick:
    """The step loop after step ``step``: what the actions' triggers read and their work changes.

    Attributes:
      state: the train state after the step.
      step: its step (``int(state.step)``, read once).
      steps: the steps the run is planned for (a replan may change them).
      plan: the ``--time-budget`` plan (None: ``--steps``).
      applied: the optimizer's applied updates before the next step (skipped steps apply none).
      last_saved: the step of the newest committed checkpoint (0: none yet).
      saving: the step whose checkpoint orbax is writing in the background (None: none).
      skips_at_minimum: skipped steps in a row at the minimum loss scale, up to this one.
      metrics: the step's metrics, on the host.
      seconds: the step's wall-clock time.
      records: the records of the step: its :class:`TrainRecord`, then any :class:`EvalRecord`.
      stops: the stops found after the step, in the order found.
      done: the run ends here without an error (the time budget ran out).
      spike_steps: the recent steps skipped for a spike (``--spike-rollback`` counts them).
      rollbacks: the rollbacks decided so far (:class:`leanstep.training.rollback.Rollback`).
      lr_factor: what the step multiplies its updates by now (below 1 after a rollback).
      rolled_back: this tick is a rollback's: the state is the checkpoint's, nothing to save.
    """

    state: Any
    step: int
    steps: int
    plan: BudgetPlan | None = None
    applied: int = 0
    last_saved: int = 0
    saving: int | None = None
    skips_at_minimum: int = 0
    metrics: Any = None
    seconds: float = 0.0
    records: tuple[TrainRecord | EvalRecord, ...] = ()
    stops: tuple[Stop, ...] = ()
    done: bool = False
    spike_steps: tuple[int, ...] = ()
    rollbacks: tuple[Rollback, ...] = ()
    lr_factor: float = 1.0
    rolled_back: bool = False

    @property
    def data_skips(self) -> tuple[tuple[int, int], ...]:
        """The data positions the run skips, merged (:func:`~leanstep.training.rollback.data_position`)."""
        skips: tuple[tuple[int, int], ...] = ()
        for rollback in self.rollbacks:
            skips = merge_skips(skips, rollback.skip)
        return skips

    @property
    def record(self) -> TrainRecord:
        """The step's :class:`TrainRecord`."""
        record = self.records[0]
        assert isinstance(record, TrainRecord)  # the step makes it first
        return record

    def stopping(self, reason: str) -> bool:
        """Whether a stop for ``reason`` was found after this step."""
        return any(stop.reason == reason for stop in self.stops)

    def with_stop(self, stop: Stop) -> Tick:
        """This tick with ``stop`` found too."""
        return dataclasses.replace(self, stops=(*self.stops, stop))

    def with_records(self, *records: EvalRecord) -> Tick:
        """This tick with ``records`` after its own."""
        return dataclasses.replace(self, records=(*self.records, *records))

    def where_saved(self, directory: str | Path) -> str:
        """Where the run's work is kept, for a message: the newest checkpoint in ``directory``, or none."""
        if self.last_saved:
            return f"the last checkpoint (step {self.last_saved}) is intact in {directory}"
        return "no checkpoint was written yet"


class Action(Protocol):
    """A periodic action of the step loop: ``do`` runs after a step for which ``when`` holds."""

    def when(self, tick: Tick) -> bool:
        """Whether the action runs after ``tick``'s step."""
        ...

    def do(self, tick: Tick) -> Tick:
        """The action's work; returns the tick the next action sees."""
        ...


@dataclasses.dataclass(frozen=True)
class RunClock:
    """The run's wall-clock, in seconds.

    Attributes:
      origin: ``now()`` when :func:`leanstep.training.train` began: a ``--time-budget`` counts from here.
      before_s: the run's time in its earlier sessions (a resumed run's checkpoint says).
      now: the clock read (``time.perf_counter``).

    Example:
      >>> clock = RunClock(origin=10.0, before_s=100.0, now=lambda: 12.5)
      >>> clock.session_s(), clock.elapsed_s()
      (2.5, 102.5)
    """

    origin: float
    before_s: float = 0.0
    now: Callable[[], float] = time.perf_counter

    def session_s(self) -> float:
        """Seconds since ``origin``."""
        return self.now() - self.origin

    def elapsed_s(self) -> float:
        """The run's time so far, its earlier sessions included (a record's ``elapsed_s``)."""
        return self.before_s + self.now() - self.origin


def max_over_processes(value: int) -> int:
    """The largest of every process's ``value`` (a collective: every process of the run calls it)."""
    return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def minimum_loss_scale(state: Any) -> float:
    """The loss scale ``state``'s cannot back off below; a static or absent one is always at it (inf)."""
    return getattr(state.loss_scale, "min_loss_scale", math.inf)
