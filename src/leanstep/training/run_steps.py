"""The step loop of :func:`leanstep.training.train`: the step, its record, and the periodic actions.

It runs from a state to ``config.steps``; after each step (:func:`take_step`, which makes the
step's :class:`~leanstep.training.records.TrainRecord`) it runs :func:`loop_actions` in order::

    tick = take_step(loop, clock, tick)
    for action in actions:
        if action.when(tick):
            tick = action.do(tick)

The run stops early, with a checkpoint, on a signal, at ``--stop-at``, at the end of a time
budget, or (without a checkpoint) when the loss scale sits at its minimum; each early stop is
a :class:`RunStopped` that says where the run is and how to go on (the time budget's is a note).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from leanstep.step.state import TrainState
from leanstep.training.actions import (
    CommitCheckpoint,
    EndLowerRate,
    Evaluate,
    LogRecords,
    Replan,
    RollBackOnSpikes,
    SaveCheckpoint,
    TimeSteps,
    write_failed,
)
from leanstep.training.budget import BudgetPlan
from leanstep.training.config import RunConfig, config_hash
from leanstep.training.loop_state import Action, RunClock, RunStopped, Tick, minimum_loss_scale
from leanstep.training.metrics_log import MetricsWriter
from leanstep.training.records import TrainRecord
from leanstep.training.rollback import Rollback, data_position
from leanstep.training.step_loop import StepLoop, applied_updates, evaluate, step_batch
from leanstep.training.stop_signals import StopSignals
from leanstep.training.stops import EndRun, StopAtBudget, StopAtMinimumLossScale, StopAtStep, StopOnSignal

__all__ = ["RunStopped", "loop_actions", "planned_steps", "run_steps", "take_step"]


def planned_steps(config: RunConfig) -> int:
    """``config.steps``, which a run has once it is planned (``--steps``, or ``--time-budget``'s plan)."""
    if config.steps is None:
        raise ValueError("the run has no --steps yet: it is planned (leanstep.training.budget) before its steps run")
    return config.steps


def run_steps(
    loop: StepLoop,
    state: TrainState,
    elapsed_before: float,
    *,
    plan: BudgetPlan | None = None,
    on_replan: Callable[[BudgetPlan], None] = lambda plan: None,
    rollbacks: tuple[Rollback, ...] = (),
    spike_steps: tuple[int, ...] = (),
    lr_factor: float = 1.0,
) -> None:
    """Steps from ``state`` to ``config.steps``, logging every step and checkpointing as configured.

    ``plan``: the run sized it to its budget; it plans again at ``plan.replan_at`` (then calls
    ``on_replan``) and stops, with a checkpoint, before a step that would end past the budget.
    ``rollbacks``, ``spike_steps``, ``lr_factor``: a resumed run's (``--spike-rollback``), from
    ``rollbacks.json`` and its checkpoint.
    """
    assert loop.checkpointer is not None
    clock = RunClock(loop.origin, elapsed_before)
    step = int(state.step)
    tick = Tick(
        state=state,
        step=step,
        steps=planned_steps(loop.config),
        plan=plan,
        applied=applied_updates(state.opt_state),
        last_saved=step,
        rollbacks=rollbacks,
        spike_steps=spike_steps,
        lr_factor=lr_factor,
    )
    with contextlib.ExitStack() as stack:
        log, path = None, loop.metrics_path
        if path is not None:  # None: another process writes the metrics
            try:
                log = stack.enter_context(MetricsWriter(path))
            except OSError as error:
                raise write_failed(path, error, tick.where_saved(loop.checkpointer.directory)) from None
        signals = stack.enter_context(StopSignals())
        actions = loop_actions(loop, clock, log, signals, on_replan)
        while not tick.done and tick.step < tick.steps:
            tick = take_step(loop, clock, tick)
            for action in actions:
                if action.when(tick):
                    tick = action.do(tick)


def take_step(loop: StepLoop, clock: RunClock, tick: Tick) -> Tick:
    """The step after ``tick``'s: its state, metrics and time, and its record (the new tick's first).

    The record's learning rate is the schedule's at the updates applied before the step, over
    the steps planned; the tick counts the updates (a skipped step applies none) and the
    skipped steps in a row at the minimum loss scale.
    """
    start = clock.now()
    state, metrics = loop.step_fn(tick.state, step_batch(loop, data_position(tick.step, tick.data_skips)))
    metrics = jax.device_get(metrics)
    seconds = clock.now() - start
    record = TrainRecord(
        step=int(state.step),
        loss=float(metrics.loss),
        grad_norm=float(metrics.grad_norm),
        loss_scale=float(metrics.loss_scale),
        skipped=bool(metrics.skipped),
        clipped=bool(metrics.clipped),
        consecutive_skips=int(metrics.consecutive_skips),
        tokens_per_sec=loop.config.batch_size * loop.config.seq_len / seconds,
        elapsed_s=clock.elapsed_s(),
        lr=float(loop.schedule(tick.applied, tick.steps, np)) * tick.lr_factor,
        spiked=metrics.spiked is not None and bool(metrics.spiked),
    )
    at_minimum = record.skipped and record.loss_scale <= minimum_loss_scale(state)
    return dataclasses.replace(
        tick,
        state=state,
        step=record.step,
        applied=tick.applied + (not record.skipped and not record.spiked),
        skips_at_minimum=tick.skips_at_minimum + 1 if at_minimum else 0,
        metrics=metrics,
        seconds=seconds,
        records=(record,),
        stops=(),
        rolled_back=False,
    )


def loop_actions(
    loop: StepLoop,
    clock: RunClock,
    log: MetricsWriter | None,
    signals: StopSignals,
    on_replan: Callable[[BudgetPlan], None],
) -> list[Action]:
    """What the loop does after each step, in order (:mod:`leanstep.training.actions`, :mod:`~leanstep.training.stops`).

    The order is the loop's contract: the budget's end is known before the evaluation it
    asks for; the records are out before a stuck loss scale stops the run and before the
    signals are read (a signal sent on seeing a step's record stops after that step); every
    stop is found before the checkpoint that saves its step, and the run ends after it.
    """
    config, checkpointer = loop.config, loop.checkpointer
    assert checkpointer is not None  # the run directory is open
    out, many = Path(config.out), jax.process_count() > 1
    step_times: list[float] = []  # TimeSteps keeps them, Replan reads them
    save = SaveCheckpoint(
        config.checkpoint_every, checkpointer, config_hash(config), signals, out, many=many, background=not many
    )
    policy = config.rollback
    rollback = [] if policy is None else [RollBackOnSpikes(policy, checkpointer, log, out, loop.emit, save.settle)]
    return [
        TimeSteps(step_times),
        Replan(config, clock, step_times, on_replan, loop.emit),
        StopAtBudget(clock, many=many),
        Evaluate(config.eval_every, lambda params: evaluate(loop, params)),
        LogRecords(log, loop.emit, checkpointer.directory, settle=save.settle),
        StopAtMinimumLossScale(config.max_consecutive_skips, checkpointer.directory, settle=save.settle),
        *rollback,
        EndLowerRate(),
        StopOnSignal(signals, many=many),
        StopAtStep(config.stop_at),
        CommitCheckpoint(checkpointer, signals, out, many=many),
        save,
        EndRun(out, checkpointer.directory, signals, loop.emit),
    ]
