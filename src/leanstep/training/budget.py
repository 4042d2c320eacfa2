"""Sizing a run to a wall-clock budget (``--time-budget``): parse it, time the step, plan the steps.

A run without ``--steps`` is planned once its step is compiled: :func:`calibrate` times a few
steps on a scratch copy of the initial state (their results are dropped, so the run itself
starts from step 0 as any run does) and a held-out evaluation after a first, untimed one (a
first call can compile or load its program: 1.7 s on a TPU v5e against a steady cost far
below, which counted thirty times had halved a one-minute run), and :func:`plan_steps` sets

.. math:: N = \\Big\\lfloor \\frac{B - t_0 - e - c - f}{s + e / E + c / C} \\Big\\rfloor

steps, with ``B`` the budget, ``t_0`` the time already spent (data, compilation, calibration),
``s`` the median step time, ``e`` one evaluation (every ``E`` steps and at the end), ``c`` a
checkpoint (every ``C`` steps and at the end) and ``f`` the finish (summary and chart). The
learning-rate schedule is then laid over ``N`` (:mod:`leanstep.training.schedule`) and the plan
is recorded in ``config.json``; a resumed run keeps ``N``. The steps right after compiling are
not the loop's steady state, so the run plans once more, from its own step times, at the end of
the warmup, or late in a ``warmup-stable-decay`` run (:func:`replan_step`), where the learning
rate does not yet depend on ``N``. Should
the machine slow down later, the run that planned stops at the budget with a checkpoint, and
``--resume`` finishes the schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from leanstep.training.schedule import decay_start

__all__ = ["BudgetPlan", "calibrate", "parse_duration", "plan_budget", "plan_steps", "replan", "replan_step"]

#: Seconds per unit of a duration.
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
#: What a checkpoint save costs the step loop (orbax writes in the background; this is the
#: blocking part and the wait for the previous save, an estimate, recorded as such).
CHECKPOINT_ESTIMATE_S = 0.5
#: The finish after the last step: the final save, summary.json, the chart (an estimate).
FINISH_ESTIMATE_S = 2.0


def parse_duration(text: str | float, flag: str = "--time-budget") -> float:
    """Seconds of a duration: ``"3m"``, ``"90s"``, ``"1.5h"``, ``"2m30s"`` or a number of seconds.

    Raises:
      ValueError: naming ``flag``, for text that is not such a duration, or one not above zero.

    Example:
      >>> parse_duration("3m"), parse_duration("2m30s"), parse_duration("45"), parse_duration(1.5)
      (180.0, 150.0, 45.0, 1.5)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        parts = re.findall(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(min|[smh]?)", str(text).strip().lower())
        joined = "".join(f"{number}{unit}" for number, unit in parts)
        if (
            not parts
            or joined != re.sub(r"\s+", "", str(text).strip().lower())
            or (len(parts) > 1 and any(unit == "" for _, unit in parts))
        ):
            raise ValueError(f"{flag} must be a duration like 3m, 90s, 1.5h or 2m30s, got {text!r}")
        seconds = sum(float(number) * _UNITS[unit] for number, unit in parts)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{flag} must be a duration above zero, got {text!r}")
    return seconds


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """How a run was sized to its budget (all times in seconds); recorded in ``config.json``.

    Attributes:
      budget_s: the budget, from the start of :func:`leanstep.training.train`.
      planned_at_s: the time spent before the first step (data, compilation, calibration).
      compile_s: compiling the step (or loading it from JAX's persistent compilation cache)
        and its first call.
      step_s: the median step time of the calibration steps.
      step_times_s: every calibration step's time.
      eval_s: one held-out evaluation, as the loop runs it (the median of the calls after the first).
      checkpoint_s: a checkpoint save (the estimate :data:`CHECKPOINT_ESTIMATE_S`).
      finish_s: the finish after the last step (the estimate :data:`FINISH_ESTIMATE_S`).
      steps: the steps chosen.
      replan_at: the step at which the plan is made again from the step loop's own times
        (None: never); see :func:`replan_step`.
      calibrated_steps: the steps the calibration chose, before any replan.
      loop_step_s: the median step time in the loop when replanned (None before).
      eval_first_s: the first evaluation call, which may compile (not counted in ``eval_s``).
    """

    budget_s: float
    planned_at_s: float
    compile_s: float
    step_s: float
    step_times_s: tuple[float, ...]
    eval_s: float
    checkpoint_s: float
    finish_s: float
    steps: int
    replan_at: int | None = None
    calibrated_steps: int | None = None
    loop_step_s: float | None = None
    eval_first_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line: the budget, what it went to, the steps planned (and when they are planned again)."""
        if self.loop_step_s is not None:
            return (
                f"--time-budget {self.budget_s:g}s: {self.steps} steps, planned again after step "
                f"{self.replan_at} at {self.loop_step_s * 1e3:.1f} ms a step (the first plan: "
                f"{self.calibrated_steps} at {self.step_s * 1e3:.1f} ms)"
            )
        again = "" if self.replan_at is None else f", planned again after step {self.replan_at}"
        return (
            f"--time-budget {self.budget_s:g}s: {self.steps} steps planned at {self.step_s * 1e3:.1f} ms a step "
            f"({self.planned_at_s:.1f} s spent loading, compiling and timing; an evaluation "
            f"{self.eval_s:.2f} s{again})"
        )


def plan_steps(
    budget_s: float,
    spent_s: float,
    step_s: float,
    eval_s: float,
    eval_every: int,
    checkpoint_s: float,
    checkpoint_every: int,
    finish_s: float,
) -> int:
    """The number of steps ``N`` of the module's formula (0 if not even one fits).

    Example:
      >>> plan_steps(180.0, 20.0, 0.2, 1.0, 100, 0.5, 1000, 2.0)  # (180-20-1-0.5-2) / (0.2+0.01+0.0005)
      743
    """
    left = budget_s - spent_s - eval_s - checkpoint_s - finish_s
    per_step = step_s + eval_s / eval_every + checkpoint_s / checkpoint_every
    return max(0, math.floor(left / per_step)) if per_step > 0 else 0


def _timed(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - start


def calibrate(
    step_fn: Callable[[Any, Any], tuple[Any, Any]],
    scratch_state: Any,
    batches: Callable[[int], Any],
    evaluate: Callable[[Any], Any],
    *,
    timed_steps: int = 4,
    evaluations: int = 1,
) -> dict[str, Any]:
    """Times ``1 + timed_steps`` steps from ``scratch_state`` (whose results are dropped) and ``1 + evaluations``.

    Args:
      step_fn: the run's compiled step, ``step_fn(state, batch) -> (state, metrics)``; it may
        donate its input, so ``scratch_state`` must be a state of its own.
      scratch_state: a copy of the initial state.
      batches: ``batches(i)``, the ``i``-th step's batch.
      evaluate: ``evaluate(params)``, one held-out evaluation.
      timed_steps: steps timed after the first (which compiles).
      evaluations: evaluations timed after the first call, which is timed apart: it can
        compile, or load from a cache, even when the program was compiled ahead of it.

    Returns:
      ``{"compile_s", "step_s", "step_times_s", "eval_first_s", "eval_s"}``: the first step, the
      median of the timed ones, each of them, the first evaluation call, and the median of the
      evaluations after it.

    Raises:
      ValueError: naming ``evaluations``, when it is below one.
    """
    if evaluations < 1:
        raise ValueError(f"evaluations={evaluations}; at least one is timed after the first call")
    state = scratch_state

    def step(i: int) -> Any:  # as the step loop calls it: the batch placed, the metrics fetched
        nonlocal state
        state, metrics = step_fn(state, batches(i))
        return jax.device_get(metrics)

    compile_s = _timed(lambda: step(0))
    times = tuple(_timed(functools.partial(step, i)) for i in range(1, 1 + timed_steps))
    eval_first_s = _timed(lambda: evaluate(state.params))
    eval_s = statistics.median(_timed(lambda: evaluate(state.params)) for _ in range(evaluations))
    return {
        "compile_s": compile_s,
        "step_s": statistics.median(times),
        "step_times_s": times,
        "eval_first_s": eval_first_s,
        "eval_s": eval_s,
    }


def plan_budget(
    config: Any,
    step_fn: Callable[[Any, Any], tuple[Any, Any]],
    scratch_state: Callable[[], Any],
    batches: Callable[[int], Any],
    evaluate: Callable[[Any], Any],
    origin: float,
    *,
    evaluations: int = 1,
    compile_s: float = 0.0,
) -> BudgetPlan:
    """Calibrates the run's step and plans ``config.time_budget`` (a :class:`RunConfig` with ``steps=None``).

    Args:
      config: the run.
      step_fn, batches, evaluate, evaluations: as for :func:`calibrate`.
      scratch_state: makes a fresh initial state for the calibration to consume.
      origin: ``time.perf_counter()`` when the run began.
      compile_s: the step's compile before calibrating, if it was compiled ahead of its first call.

    Raises:
      ValueError: naming ``--time-budget``, when not one step fits; naming ``--stop-at``, when it is
        past the steps planned.
    """
    timing = calibrate(step_fn, scratch_state(), batches, evaluate, evaluations=evaluations)

    spent = time.perf_counter() - origin
    steps = plan_steps(
        config.time_budget,
        spent,
        timing["step_s"],
        timing["eval_s"],
        config.eval_every,
        CHECKPOINT_ESTIMATE_S,
        config.checkpoint_every,
        FINISH_ESTIMATE_S,
    )
    if jax.process_count() > 1:  # process 0's plan, for every process
        from jax.experimental import multihost_utils

        steps = int(multihost_utils.broadcast_one_to_all(np.int32(steps)))
    if steps < 1:
        raise ValueError(
            f"--time-budget {config.time_budget:g}s leaves no time for a step: {spent:.1f} s went to "
            f"loading and compiling, a step takes {timing['step_s']:.3g} s and an evaluation "
            f"{timing['eval_s']:.3g} s; give a longer budget or --steps"
        )
    if config.stop_at is not None and config.stop_at > steps:
        raise ValueError(
            f"--stop-at {config.stop_at} is past the {steps} steps --time-budget "
            f"{config.time_budget:g}s allows: the run would never stop there"
        )
    at = replan_step(config, steps)
    return BudgetPlan(
        budget_s=float(config.time_budget),
        planned_at_s=spent,
        compile_s=compile_s + timing["compile_s"],
        step_s=timing["step_s"],
        step_times_s=timing["step_times_s"],
        eval_s=timing["eval_s"],
        eval_first_s=timing["eval_first_s"],
        checkpoint_s=CHECKPOINT_ESTIMATE_S,
        finish_s=FINISH_ESTIMATE_S,
        steps=steps,
        replan_at=at if at is not None and at < steps else None,
        calibrated_steps=steps,
    )


def replan_step(config: Any, steps: int) -> int | None:
    """The step after which a budgeted run of ``steps`` planned steps plans again, or None.

    A few steps right after compiling run slower or faster than the run's steady state, so the
    plan is made again from the loop's own step times, once, as late as the learning rate
    allows: before the first step whose rate depends on the run's length. That is the end of
    the warmup of ``warmup-cosine`` (if it is 10 steps or more), step 20 of ``constant``, and
    three quarters of the way through ``warmup-stable-decay`` (whose rate is constant until
    the last fifth). The run is then the run of ``--steps N`` with the final ``N``, bit for bit.
    ``cosine`` depends on the length from its first step, so it keeps the calibration's plan.

    Example:
      >>> from leanstep.training import RunConfig
      >>> [replan_step(RunConfig(schedule=name, warmup_steps=30), 1000)
      ...  for name in ("warmup-cosine", "warmup-stable-decay", "constant", "cosine")]
      [30, 750, 20, None]
    """
    if config.schedule == "warmup-stable-decay":
        at = decay_start(steps) - steps // 20
        return at if at > config.warmup_steps else None
    if config.schedule == "warmup-cosine" and config.warmup_steps >= 10:
        return config.warmup_steps
    return 20 if config.schedule == "constant" else None


def replan(plan: BudgetPlan, config: Any, step: int, elapsed_s: float, step_times_s: list[float]) -> BudgetPlan:
    """``plan`` made again after ``step`` at ``elapsed_s``, from the loop's step times so far.

    The steps left are :func:`plan_steps` of the time left at the median of the later half of
    ``step_times_s`` (the loop's recent pace), and never fewer than one more than ``step``; for
    ``warmup-stable-decay``, never so few that the decay would have begun by ``step``.
    """
    times = step_times_s[len(step_times_s) // 2 :] or step_times_s
    step_s = statistics.median(times)
    more = plan_steps(
        plan.budget_s,
        elapsed_s,
        step_s,
        plan.eval_s,
        config.eval_every,
        plan.checkpoint_s,
        config.checkpoint_every,
        plan.finish_s,
    )
    steps = step + max(1, more)
    while config.schedule == "warmup-stable-decay" and decay_start(steps) <= step:
        steps += 1
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        steps = int(multihost_utils.broadcast_one_to_all(np.int32(steps)))
    if config.stop_at is not None and config.stop_at > steps:
        steps = config.stop_at  # --stop-at was checked against the first plan; it is kept
    return dataclasses.replace(plan, steps=steps, loop_step_s=step_s)
