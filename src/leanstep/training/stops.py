"""The step loop's stop checks: the time budget, a stuck loss scale, a signal, ``--stop-at``; then the end.

Each is an :class:`~leanstep.training.loop_state.Action` the loop runs after every step, in
the order :func:`leanstep.training.run_steps.loop_actions` lists them::

    StopAtBudget            the next step would end past   a stop, after an evaluation and
                            the budget (planned runs)      a checkpoint
    StopAtMinimumLossScale  max_skips skipped steps in a   RunStopped(1) at once, no checkpoint
                            row at the minimum loss scale
    StopOnSignal            every step: reads SIGINT/      a stop, after a checkpoint
                            SIGTERM once the records are
                            out
    StopAtStep              stop_at <= step < steps        a stop, after a checkpoint
    EndRun                  a stop was found               RunStopped, or (the budget) a note

A stop found after a step is only recorded there (:class:`~leanstep.training.loop_state.Stop`),
so that the checkpoint action saves the step first; :class:`EndRun` then ends the run with the
first of :data:`~leanstep.training.loop_state.STOP_REASONS` that holds.

Example:
  >>> from leanstep.training.loop_state import Tick
  >>> check = StopAtStep(stop_at=3)
  >>> [step for step in range(1, 7) if check.when(Tick(state=None, step=step, steps=5))]
  [3, 4]
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable
from pathlib import Path

from leanstep.training.budget import BudgetPlan
from leanstep.training.loop_state import STOP_REASONS, RunClock, RunStopped, Stop, Tick, max_over_processes
from leanstep.training.records import Note
from leanstep.training.stop_signals import StopSignals

__all__ = ["EndRun", "StopAtBudget", "StopAtMinimumLossScale", "StopAtStep", "StopOnSignal", "out_of_time"]


def out_of_time(plan: BudgetPlan, session_s: float) -> bool:
    """Whether a step begun ``session_s`` into the run would end past ``plan``'s budget, less its finish.

    A step takes the loop's own step time once the run has planned again, else the calibration's.

    Example:
      >>> plan = BudgetPlan(60.0, 5.0, 1.0, 0.5, (0.5,), 0.1, 0.5, 2.0, steps=100)
      >>> out_of_time(plan, 57.0), out_of_time(plan, 57.6)
      (False, True)
    """
    return session_s + (plan.loop_step_s or plan.step_s) > plan.budget_s - plan.finish_s


@dataclasses.dataclass(frozen=True)
class StopAtBudget:
    """Stops a ``--time-budget`` run before a step that would end past its budget.

    Only the run that planned (a resumed run finishes its schedule whatever it takes). Every
    process of a multi-process run (``many``) stops after the same step: the first to run out.
    """

    clock: RunClock
    many: bool = False

    def when(self, tick: Tick) -> bool:
        if tick.plan is None:
            return False
        late = tick.step < tick.steps and out_of_time(tick.plan, self.clock.session_s())
        return bool(max_over_processes(late)) if self.many else late

    def do(self, tick: Tick) -> Tick:
        return tick.with_stop(Stop("budget"))


@dataclasses.dataclass(frozen=True)
class StopAtMinimumLossScale:
    """Stops the run after ``max_skips`` skipped steps in a row with the loss scale at its minimum.

    Lowering the scale cannot help then (the gradients are non-finite at any scale), so the
    run stops at once, without saving the state it is stuck in (a checkpoint written in the
    background is committed first, by ``settle``).
    """

    max_skips: int
    checkpoints: Path  # the checkpoint directory, for the message
    settle: Callable[[Tick], Tick] = lambda tick: tick

    def when(self, tick: Tick) -> bool:
        return tick.skips_at_minimum >= self.max_skips

    def do(self, tick: Tick) -> Tick:
        tick = self.settle(tick)
        raise RunStopped(
            f"stopped at step {tick.step}: the loss scale sat at its minimum ({tick.record.loss_scale:g}) for "
            f"{tick.skips_at_minimum} skipped steps in a row (non-finite gradients); "
            f"{tick.where_saved(self.checkpoints)}. Lower --lr, check the data, or raise --max-consecutive-skips.",
            1,
        )


@dataclasses.dataclass(frozen=True)
class StopOnSignal:
    """Reads SIGINT/SIGTERM after every step, once its records are out, and stops the run if one came.

    ``received()`` is read once a step: a signal arriving later is handled after the next step
    (or by the checkpoint action, when it arrives during a save). A signal to any process of a
    multi-process run (``many``) stops all of them after the same step: saving is collective.
    """

    signals: StopSignals
    many: bool = False

    def when(self, tick: Tick) -> bool:
        return True

    def do(self, tick: Tick) -> Tick:
        received = self.signals.received
        if self.many:
            received = max_over_processes(received or 0) or None
        return tick if received is None else tick.with_stop(Stop("signal", received))


@dataclasses.dataclass(frozen=True)
class StopAtStep:
    """``--stop-at``: stops after step ``stop_at`` (or, resumed past it, the next step), as a preemption would."""

    stop_at: int | None

    def when(self, tick: Tick) -> bool:
        return self.stop_at is not None and self.stop_at <= tick.step < tick.steps

    def do(self, tick: Tick) -> Tick:
        return tick.with_stop(Stop("stop_at"))


@dataclasses.dataclass(frozen=True)
class EndRun:
    """Ends the run after a step with a stop, saying why, where its work is and how to go on.

    ``--stop-at`` and a signal raise :class:`RunStopped` (exit code 0, and 128 + the signal, which
    carries this process's own signal for :func:`leanstep.training.train` to deliver again); the
    end of the budget says so through ``emit`` and ends the loop (``tick.done``).
    """

    out: Path  # the run directory, for the message
    checkpoints: Path  # the checkpoint directory, for the message
    signals: StopSignals
    emit: Callable[..., None]

    def when(self, tick: Tick) -> bool:
        return bool(tick.stops)

    def do(self, tick: Tick) -> Tick:
        stop = min(tick.stops, key=lambda stop: STOP_REASONS.index(stop.reason))
        saved_now = (
            "after saving a checkpoint" if tick.last_saved == tick.step else f"({tick.where_saved(self.checkpoints)})"
        )
        go_on = f"--resume --out {self.out}"
        if stop.reason == "stop_at":
            raise RunStopped(f"stopped at step {tick.step} as --stop-at asked, {saved_now}; continue with {go_on}", 0)
        if stop.reason == "signal":
            assert stop.signal is not None  # StopOnSignal and SaveCheckpoint name it
            raise RunStopped(
                f"{signal.Signals(stop.signal).name} received: stopped at step {tick.step} {saved_now}; "
                f"continue with {go_on}",
                128 + stop.signal,
                signal=self.signals.received,  # this process's own, which train() delivers again
            )
        assert tick.plan is not None  # only a planned run runs out of time
        self.emit(
            Note(
                f"warning: the time budget ran out at step {tick.step} of the {tick.steps} planned "
                f"(steps ran slower than the {(tick.plan.loop_step_s or tick.plan.step_s) * 1e3:.1f} ms "
                f"measured when planning), {saved_now}; {go_on} finishes the schedule"
            )
        )
        return dataclasses.replace(tick, done=True)
