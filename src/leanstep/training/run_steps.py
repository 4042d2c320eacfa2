"""The step loop of :func:`leanstep.training.train`: step, log, evaluate, checkpoint, stop.

It runs from a state to ``config.steps`` and stops early, with a checkpoint, on a signal, at
``--stop-at``, at the end of a time budget, or (without one) when the loss scale sits at its
minimum; each early stop is a :class:`RunStopped` that says where the run is and how to go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from leanstep.checkpoints.checkpointer import CheckpointError
from leanstep.step.state import TrainState
from leanstep.training.budget import BudgetPlan, replan
from leanstep.training.config import RunConfig, config_hash
from leanstep.training.metrics_log import MetricsWriter
from leanstep.training.records import EvalRecord, Note, RunStart, TrainRecord
from leanstep.training.schedule import set_total_steps
from leanstep.training.step_loop import StepLoop, applied_updates, evaluate, step_batch
from leanstep.training.stop_signals import StopSignals

__all__ = ["RunStopped", "planned_steps", "run_steps"]


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
) -> None:
    """Steps from ``state`` to ``config.steps``, logging every step and checkpointing as configured.

    ``plan``: the run sized it to its budget; it plans again at ``plan.replan_at`` (then calls
    ``on_replan``) and stops, with a checkpoint, before a step that would end past the budget.
    """
    config, checkpointer, out = loop.config, loop.checkpointer, Path(loop.config.out)
    assert checkpointer is not None
    last_saved = int(state.step)
    # A static or absent loss scale cannot back off, so it is always at its minimum.
    minimum = getattr(state.loss_scale, "min_loss_scale", math.inf)
    skips_at_minimum = 0  # skipped steps in a row at the minimum loss scale: lowering it cannot help

    def where_saved() -> str:
        return (
            f"the last checkpoint (step {last_saved}) is intact in {checkpointer.directory}"
            if last_saved
            else "no checkpoint was written yet"
        )

    def save(state: TrainState, elapsed: float) -> None:
        step = int(state.step)
        try:
            checkpointer.save(
                step, state, extra={"data_position": step, "elapsed_s": elapsed, "config_sha256": config_hash(config)}
            )
        except CheckpointError as error:
            raise RunStopped(
                f"stopped at step {step}: its checkpoint could not be written ({error}); "
                f"{where_saved()}. Free space or fix the directory, then continue with "
                f"--resume --out {out}",
                1,
            ) from None

    def write_failed(error: OSError) -> RunStopped:
        return RunStopped(f"cannot write {loop.metrics_path}: {error}; {where_saved()}", 1)

    tokens_per_step = config.batch_size * config.seq_len
    applied = applied_updates(state.opt_state)
    t_start, step_times = loop.origin, []
    many = jax.process_count() > 1
    with contextlib.ExitStack() as stack:
        try:
            log = stack.enter_context(MetricsWriter(loop.metrics_path)) if loop.metrics_path else None
        except OSError as error:
            raise write_failed(error) from None
        stop = stack.enter_context(StopSignals())
        while int(state.step) < (steps := planned_steps(config)):
            t0 = time.perf_counter()
            state, metrics = loop.step_fn(state, step_batch(loop, int(state.step)))
            metrics = jax.device_get(metrics)
            dt = time.perf_counter() - t0
            step = int(state.step)
            replanning = plan is not None and plan.replan_at is not None and plan.loop_step_s is None
            if replanning:  # the loop's own step times, until the plan is made again
                step_times.append(dt)
            if replanning and plan is not None and step == plan.replan_at:
                plan = replan(plan, config, step, time.perf_counter() - t_start, step_times)
                config, steps = dataclasses.replace(config, steps=plan.steps), plan.steps
                loop = dataclasses.replace(loop, config=config)
                state = state.replace(opt_state=set_total_steps(state.opt_state, plan.steps))
                on_replan(plan)
                loop.emit(Note(plan.describe()), RunStart(plan.steps, step))
            record = TrainRecord(
                step=step,
                loss=float(metrics.loss),
                grad_norm=float(metrics.grad_norm),
                loss_scale=float(metrics.loss_scale),
                skipped=bool(metrics.skipped),
                clipped=bool(metrics.clipped),
                consecutive_skips=int(metrics.consecutive_skips),
                tokens_per_sec=tokens_per_step / dt,
                elapsed_s=elapsed_before + time.perf_counter() - t_start,
                lr=float(loop.schedule(applied, steps, np)),
            )
            applied += not record.skipped
            records: list[TrainRecord | EvalRecord] = [record]
            # Out of time: the next step would end past the budget (the planning run only).
            out_of_time = (
                plan is not None
                and step < steps
                and time.perf_counter() - t_start + (plan.loop_step_s or plan.step_s) > plan.budget_s - plan.finish_s
            )
            if many and plan is not None:  # every process stops after the same step
                out_of_time = bool(np.max(multihost_utils.process_allgather(np.int32(out_of_time))))
            if step % config.eval_every == 0 or step == steps or out_of_time:
                records.append(EvalRecord.from_loss(step, evaluate(loop, state.params)))
            if log is not None:
                try:
                    log.write(*records)
                except OSError as error:
                    raise write_failed(error) from None
            loop.emit(*records)
            at_minimum = record.skipped and record.loss_scale <= minimum
            skips_at_minimum = skips_at_minimum + 1 if at_minimum else 0
            if skips_at_minimum >= config.max_consecutive_skips:
                raise RunStopped(
                    f"stopped at step {step}: the loss scale sat at its minimum ({record.loss_scale:g}) for "
                    f"{skips_at_minimum} skipped steps in a row (non-finite gradients); {where_saved()}. "
                    "Lower --lr, check the data, or raise --max-consecutive-skips.",
                    1,
                )
            signalled = stop.received  # read once: a signal arriving later is handled after the next step
            if many:  # a signal to any process stops all of them after the same step (saving is collective)
                signalled = int(np.max(multihost_utils.process_allgather(np.int32(signalled or 0)))) or None
            stop_here = config.stop_at is not None and config.stop_at <= step < steps
            # A state stuck at the minimum scale is not worth keeping, and saving it could prune a good one.
            if skips_at_minimum == 0 and (
                step % config.checkpoint_every == 0 or step == steps or signalled or stop_here or out_of_time
            ):
                with stop.deferred():
                    save(state, record.elapsed_s)
                last_saved = step
                if not many:  # a signal during the save: this step is saved, so stop here
                    signalled = signalled or stop.received
            saved_now = "after saving a checkpoint" if last_saved == step else f"({where_saved()})"
            if stop_here:
                raise RunStopped(
                    f"stopped at step {step} as --stop-at asked, {saved_now}; continue with --resume --out {out}", 0
                )
            if signalled:
                raise RunStopped(
                    f"{signal.Signals(signalled).name} received: stopped at step {step} "
                    f"{saved_now}; continue with --resume --out {out}",
                    128 + signalled,
                    signal=stop.received,  # this process's own, which train() delivers again
                )
            if out_of_time:
                assert plan is not None  # only a planned run runs out of time
                loop.emit(
                    Note(
                        f"warning: the time budget ran out at step {step} of the {steps} planned "
                        f"(steps ran slower than the {(plan.loop_step_s or plan.step_s) * 1e3:.1f} ms "
                        "measured when planning), "
                        f"{saved_now}; --resume --out {out} finishes the schedule"
                    )
                )
                return
