"""The step loop's periodic work: time the steps, plan again, evaluate, log, checkpoint.

Each is an :class:`~leanstep.training.loop_state.Action`: ``when(tick)`` is its trigger, read
after every step, and ``do(tick)`` its work. The loop runs them in the order
:func:`leanstep.training.run_steps.loop_actions` lists them, beside the stop checks of
:mod:`leanstep.training.stops`::

    TimeSteps       while a replan is pending     keep the step's time
    Replan          step == plan.replan_at        plan the budget again from those times
    Evaluate        step % every == 0, the last   the held-out loss, an EvalRecord
                    step, or the budget's end
    LogRecords      every step                    metrics.jsonl and the run's callback
    CommitCheckpoint  a save in flight          commit it once orbax has written it
    SaveCheckpoint  step % every == 0, the last   a checkpoint, with signals deferred: written
                    step, or a stop; never at     in the background, but the last step's and
                    the minimum loss scale        a stop's before the run ends

Example:
  >>> from leanstep.training.loop_state import Tick
  >>> evaluate = Evaluate(every=4, evaluate=lambda params: 2.0)
  >>> [step for step in range(1, 11) if evaluate.when(Tick(state=None, step=step, steps=10))]
  [4, 8, 10]

Size: the loop's actions, each a small class with the same two methods (when, do); one file
keeps the order they run in readable as a list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from leanstep.checkpoints.checkpointer import Checkpointer, CheckpointError
from leanstep.training.budget import BudgetPlan, replan
from leanstep.training.config import RunConfig
from leanstep.training.loop_state import RunClock, RunStopped, Stop, Tick
from leanstep.training.metrics_log import MetricsWriter
from leanstep.training.records import EvalRecord, Note, RunStart
from leanstep.training.rollback import Rollback, SpikeRollback, data_position, record_rollback_lines, write_rollbacks
from leanstep.training.schedule import set_total_steps
from leanstep.training.step_loop import applied_updates
from leanstep.training.stop_signals import StopSignals

__all__ = [
    "CommitCheckpoint",
    "EndLowerRate",
    "Evaluate",
    "LogRecords",
    "Replan",
    "RollBackOnSpikes",
    "SaveCheckpoint",
    "TimeSteps",
    "replan_pending",
    "roll_back_to",
]


def replan_pending(plan: BudgetPlan | None) -> bool:
    """Whether ``plan`` is still to be made again from the loop's own step times."""
    return plan is not None and plan.replan_at is not None and plan.loop_step_s is None


@dataclasses.dataclass(frozen=True)
class TimeSteps:
    """Keeps each step's time in ``step_times`` while a replan is pending: the pace :class:`Replan` reads."""

    step_times: list[float]

    def when(self, tick: Tick) -> bool:
        return replan_pending(tick.plan)

    def do(self, tick: Tick) -> Tick:
        self.step_times.append(tick.seconds)
        return tick


@dataclasses.dataclass(frozen=True)
class Replan:
    """Plans a ``--time-budget`` run again after step ``plan.replan_at`` (:func:`~leanstep.training.budget.replan`).

    The new length goes into the tick and the optimizer state's schedule; ``on_replan(plan)``
    then records it (``config.json``) and ``emit`` says it, with a new ``RunStart``.
    """

    config: RunConfig
    clock: RunClock
    step_times: list[float]  # the steps' times so far (TimeSteps)
    on_replan: Callable[[BudgetPlan], None]
    emit: Callable[..., None]

    def when(self, tick: Tick) -> bool:
        return replan_pending(tick.plan) and tick.plan is not None and tick.step == tick.plan.replan_at

    def do(self, tick: Tick) -> Tick:
        assert tick.plan is not None  # when() holds
        plan = replan(tick.plan, self.config, tick.step, self.clock.session_s(), self.step_times)
        state = tick.state.replace(opt_state=set_total_steps(tick.state.opt_state, plan.steps))
        self.on_replan(plan)
        self.emit(Note(plan.describe()), RunStart(plan.steps, tick.step))
        return dataclasses.replace(tick, state=state, steps=plan.steps, plan=plan)


@dataclasses.dataclass(frozen=True)
class Evaluate:
    """The held-out loss every ``every`` steps, after the last one, and when the budget runs out."""

    every: int
    evaluate: Callable[[Any], float]  # evaluate(params) -> the mean held-out loss

    def when(self, tick: Tick) -> bool:
        return tick.step % self.every == 0 or tick.step == tick.steps or tick.stopping("budget")

    def do(self, tick: Tick) -> Tick:
        return tick.with_records(EvalRecord.from_loss(tick.step, self.evaluate(tick.state.params)))


@dataclasses.dataclass(frozen=True)
class LogRecords:
    """Every step: its records to ``metrics.jsonl`` (``log``; None: another process writes it), then to ``emit``.

    A failed write stops the run (:class:`RunStopped`, exit code 1), saying where its work is,
    once ``settle`` has committed a checkpoint written in the background (:meth:`SaveCheckpoint.settle`).
    """

    log: MetricsWriter | None
    emit: Callable[..., None]
    checkpoints: Path  # the checkpoint directory, for the message
    settle: Callable[[Tick], Tick] = lambda tick: tick

    def when(self, tick: Tick) -> bool:
        return True

    def do(self, tick: Tick) -> Tick:
        if self.log is not None:
            try:
                self.log.write(*tick.records)
            except OSError as error:
                tick = self.settle(tick)
                raise write_failed(self.log.path, error, tick.where_saved(self.checkpoints)) from None
        self.emit(*tick.records)
        return tick


def write_failed(path: Path, error: OSError, where_saved: str) -> RunStopped:
    """The stop for a ``metrics.jsonl`` that cannot be opened or written."""
    return RunStopped(f"cannot write {path}: {error}; {where_saved}", 1)


def background_failure(tick: Tick, error: CheckpointError, directory: Path, out: Path) -> RunStopped:
    """The stop for a checkpoint whose background write failed (``tick.saving``'s)."""
    return RunStopped(
        f"stopped at step {tick.step}: the checkpoint of step {tick.saving} could not be written ({error}); "
        f"{tick.where_saved(directory)}. Free space or fix the directory, then continue with --resume --out {out}",
        1,
    )


@dataclasses.dataclass(frozen=True)
class CommitCheckpoint:
    """Commits the checkpoint written in the background once orbax has written it (:meth:`Checkpointer.poll`).

    Never waits for the write: the step loop goes on while orbax writes. The commit (the
    manifest, the rename, pruning) runs with signals deferred; a write that failed stops the
    run (exit code 1) at once, saying which checkpoint is intact. A multi-process run commits
    at its next save instead, where every process is at the same step.
    """

    checkpointer: Checkpointer
    signals: StopSignals
    out: Path  # the run directory, for the message
    many: bool = False

    def when(self, tick: Tick) -> bool:
        return tick.saving is not None and not self.many

    def do(self, tick: Tick) -> Tick:
        try:
            with self.signals.deferred():
                committed = self.checkpointer.poll()
        except CheckpointError as error:
            raise background_failure(tick, error, self.checkpointer.directory, self.out) from None
        if not committed:
            return tick
        return dataclasses.replace(tick, last_saved=max(committed), saving=None)


@dataclasses.dataclass(frozen=True)
class SaveCheckpoint:
    """A checkpoint every ``every`` steps, after the last one and before any stop.

    A step stuck at the minimum loss scale is never saved: such a state is not worth keeping,
    and saving it could prune a good checkpoint. The save runs with signals deferred
    (:meth:`StopSignals.deferred`); one that arrives during it stops the run at this step, which
    is saved, except in a multi-process run (``many``), where every process must stop after the
    same step and the next step's check finds it.

    With ``background`` (the default), orbax writes the checkpoint while the loop goes on: the
    save blocks only to wait for the previous write (usually done) and to copy the state to the
    host; :class:`CommitCheckpoint` commits it once written. The last step's checkpoint, a
    stop's, and one during which a signal arrived are waited for, so that the run ends with it
    committed.
    """

    every: int
    checkpointer: Checkpointer
    config_sha256: str  # written with each checkpoint: a resume checks it
    signals: StopSignals
    out: Path  # the run directory, for the message
    many: bool = False
    background: bool = True

    def when(self, tick: Tick) -> bool:
        due = tick.step % self.every == 0 or tick.step == tick.steps or bool(tick.stops)
        return tick.skips_at_minimum == 0 and due and not tick.rolled_back  # a rollback's step is saved

    def do(self, tick: Tick) -> Tick:
        wait = bool(tick.stops) or tick.step >= tick.steps or not self.background
        with self.signals.deferred():
            tick = self.finish(tick)  # the write in flight, committed (or its failure)
            self.save(tick, wait=wait)
            tick = dataclasses.replace(tick, saving=tick.step)
            if wait:
                tick = dataclasses.replace(tick, last_saved=tick.step, saving=None)
        received = self.signals.received
        if not self.many and received is not None:
            tick = self.settle(tick)  # a signal during the save: the run stops with it committed
            if not tick.stopping("signal"):
                tick = tick.with_stop(Stop("signal", received))
        return tick

    def settle(self, tick: Tick) -> Tick:
        """``tick`` with its save in flight committed, signals deferred: before a stop names the last checkpoint."""
        with self.signals.deferred():
            return self.finish(tick)

    def finish(self, tick: Tick) -> Tick:
        """``tick`` with its save in flight committed (waits for its write); a failure stops the run."""
        if tick.saving is None:
            return tick
        try:
            self.checkpointer.wait_until_finished()
        except CheckpointError as error:
            raise background_failure(tick, error, self.checkpointer.directory, self.out) from None
        return dataclasses.replace(tick, last_saved=tick.saving, saving=None)

    def save(self, tick: Tick, *, wait: bool = True) -> None:
        """Saves ``tick``'s state with where the run's data is and its time; a failure stops the run."""
        extra = {
            "data_position": data_position(tick.step, tick.data_skips),
            "elapsed_s": tick.record.elapsed_s,
            "config_sha256": self.config_sha256,
            "rollbacks": len(tick.rollbacks),  # decided before this checkpoint (--resume finishes a later one)
            "spike_steps": list(tick.spike_steps),
        }
        try:
            self.checkpointer.save(tick.step, tick.state, extra=extra, wait=wait)
        except CheckpointError as error:
            raise RunStopped(
                f"stopped at step {tick.step}: its checkpoint could not be written ({error}); "
                f"{tick.where_saved(self.checkpointer.directory)}. Free space or fix the directory, then continue "
                f"with --resume --out {self.out}",
                1,
            ) from None


@dataclasses.dataclass(frozen=True)
class RollBackOnSpikes:
    """``--spike-rollback``: after a burst of spikes, back to the checkpoint before it (:mod:`leanstep.training.rollback`).

    Counts the steps the spike guard skipped; when ``policy.after`` of them fall within
    ``policy.within`` steps, it settles the save in flight, records the decision
    (``rollbacks.json``, then ``metrics.jsonl``), deletes the checkpoints after the one it goes
    back to, restores that one and returns its tick: the loop goes on from there, past the
    burst's batches, with the updates scaled by ``policy.lr_factor``. With no checkpoint before
    the burst it warns and goes on (the spikes stay skipped); past ``policy.max_rollbacks`` it
    stops the run (exit code 1).
    """

    policy: SpikeRollback
    checkpointer: Checkpointer
    log: MetricsWriter | None  # None: another process writes the run directory
    out: Path
    emit: Callable[..., None]
    settle: Callable[[Tick], Tick]

    def when(self, tick: Tick) -> bool:
        return tick.record.spiked

    def do(self, tick: Tick) -> Tick:
        policy = self.policy
        recent = (*(s for s in tick.spike_steps if s > tick.step - policy.within), tick.step)
        if len(recent) < policy.after:
            return dataclasses.replace(tick, spike_steps=recent)
        tick = self.settle(tick)
        burst = f"{len(recent)} loss spikes within {policy.within} steps (steps {', '.join(map(str, recent))})"
        earlier = [step for step in self.checkpointer.all_steps() if step < recent[0]]
        if not earlier:
            self.emit(
                Note(f"warning: {burst}, but no checkpoint before step {recent[0]} to roll back to: they were skipped")
            )
            return dataclasses.replace(tick, spike_steps=())
        if len(tick.rollbacks) >= policy.max_rollbacks:
            # --resume replays the run bit for bit, into this same burst, and refuses another
            # --lr or --spike-rollback (they are the run's identity): the advice is a new run.
            more = dataclasses.replace(policy, max_rollbacks=policy.max_rollbacks + 1)
            raise RunStopped(
                f"stopped at step {tick.step}: {burst} after {len(tick.rollbacks)} rollbacks (--spike-rollback "
                f"max={policy.max_rollbacks}); {tick.where_saved(self.checkpointer.directory)}. --resume would meet "
                "this burst again, and a resumed run keeps its --lr and --spike-rollback: check the data, then start "
                f"a new run (a new --out) with a lower --lr or with --spike-rollback {more.to_string()}",
                1,
            )
        to, skips = earlier[-1], tick.data_skips
        decision = Rollback(
            at_step=tick.step,
            to_step=to,
            spikes=recent,
            skip=(data_position(recent[0] - 1, skips), data_position(tick.step - 1, skips) + policy.ahead),
            lr_factor=policy.lr_factor,
            lr_until=to + policy.lr_steps,
        )
        rollbacks = (*tick.rollbacks, decision)
        try:
            if self.log is not None:
                write_rollbacks(self.out, rollbacks)  # the decision first: --resume finishes it from here
                self.log.rewrite(lambda path: record_rollback_lines(path, decision))
        except OSError as error:
            raise RunStopped(
                f"stopped at step {tick.step}: {burst}, and the rollback to step {to} could not be recorded "
                f"({error}); {tick.where_saved(self.checkpointer.directory)}",
                1,
            ) from None
        state = roll_back_to(self.checkpointer, tick.state, decision, tick.steps)
        self.emit(
            Note(
                f"{burst}: rolled back to step {to}, skipping the batches at data positions {decision.skip[0]}-"
                f"{decision.skip[1]}; updates x{decision.lr_factor:g} until step {decision.lr_until}"
            )
        )
        return Tick(
            state=state,
            step=to,
            steps=tick.steps,
            plan=tick.plan,
            applied=applied_updates(state.opt_state),
            last_saved=to,
            records=tick.records,
            rollbacks=rollbacks,
            lr_factor=decision.lr_factor,
            rolled_back=True,
        )


def roll_back_to(checkpointer: Checkpointer, template: Any, decision: Rollback, steps: int) -> Any:
    """The state of checkpoint ``decision.to_step``, the checkpoints after it deleted, its updates scaled.

    Raises:
      RunStopped: that checkpoint cannot be restored.
    """
    try:
        checkpointer.delete_newer_than(decision.to_step)
        state = checkpointer.restore(template, step=decision.to_step).state
    except CheckpointError as error:
        raise RunStopped(f"the rollback to step {decision.to_step} failed: {error}", 1) from None
    return state.replace(
        opt_state=set_total_steps(state.opt_state, steps),
        spike=state.spike.with_update_scale(decision.lr_factor),
    )


@dataclasses.dataclass(frozen=True)
class EndLowerRate:
    """Puts the updates' factor back to 1 after the last step a rollback lowered it for (``lr_until``)."""

    def when(self, tick: Tick) -> bool:
        return tick.lr_factor != 1.0 and bool(tick.rollbacks) and tick.step >= tick.rollbacks[-1].lr_until

    def do(self, tick: Tick) -> Tick:
        state = tick.state.replace(spike=tick.state.spike.with_update_scale(1.0))
        return dataclasses.replace(tick, state=state, lr_factor=1.0)
