"""Learning-rate schedules whose length lives in the optimizer state, not in the compiled step.

A run sized by ``--time-budget`` learns its number of steps only after its step has been
compiled and timed. optax's schedules take the length as a Python number, baked into the
compiled step, so choosing it afterwards would mean compiling again. Here the schedule is a
function of ``(count, total)`` and :func:`scale_by_run_schedule` keeps ``total`` in its state
beside ``count``: :func:`set_total_steps` fixes it once the run is planned, and the compiled
step is the same whatever it is.

The values are optax's: ``warmup-cosine`` rises linearly from 0 to the peak ``lr`` over
``w = min(warmup_steps, total - 1)`` steps, then decays along a cosine to ``0.1 lr`` at
``total``; ``cosine`` decays from ``lr`` to ``0.1 lr`` over ``total``; ``constant`` is ``lr``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["SCHEDULES", "RunScheduleState", "decay_start", "make_schedule", "scale_by_run_schedule", "set_total_steps"]

#: The schedules of :func:`make_schedule`.
SCHEDULES = ("constant", "cosine", "warmup-cosine", "warmup-stable-decay")


def decay_start(total: int) -> int:
    """The first step of ``warmup-stable-decay``'s decay in a run of ``total`` steps: its last fifth.

    Example:
      >>> decay_start(1000), decay_start(7)
      (800, 6)
    """
    return total - total // 5


#: ``schedule(count, total)``: the learning rate after ``count`` applied updates of ``total``.
Schedule = Callable[..., jax.Array]


def make_schedule(name: str, lr: float, warmup_steps: int) -> Schedule:
    r"""The schedule ``name`` as ``schedule(count, total)``, traceable in both arguments.

    With :math:`w = \min(\text{warmup}, \max(T - 1, 0))`, :math:`D = \max(T, w + 1) - w` and
    :math:`\eta_{end} = 0.1\,\eta` (``warmup-cosine``, :math:`T` = ``total``):

    .. math:: \eta(c) = \begin{cases} \eta\, c / w & c < w \\
              \eta_{end} + (\eta - \eta_{end})\,\tfrac12\big(1 + \cos(\pi \min(c - w, D) / D)\big) & c \ge w
              \end{cases}

    ``cosine`` is the same with :math:`w = 0`, :math:`D = T`; ``constant`` is :math:`\eta`.
    ``warmup-stable-decay`` rises as ``warmup-cosine`` does, holds :math:`\eta` until
    :math:`s = T - \lfloor T / 5 \rfloor`, then falls linearly to :math:`\eta_{end}` at :math:`T`:

    .. math:: \eta(c) = \eta_{end} + (\eta - \eta_{end})\,\mathrm{clip}\big((T - c) / (T - s), 0, 1\big),
              \qquad w \le c

    so up to step :math:`s` the rate does not depend on :math:`T` at all: a run sized to a
    time budget can choose :math:`T` late (:func:`leanstep.training.budget.replan_step`).
    ``schedule(count, total, numpy)`` computes it on the host, in float32 as well.

    Raises:
      ValueError: an unknown ``name``.

    Example:
      >>> schedule = make_schedule("warmup-cosine", 3e-3, 10)
      >>> [round(float(schedule(c, 100)), 6) for c in (0, 5, 10, 100, 200)]
      [0.0, 0.0015, 0.003, 0.0003, 0.0003]
      >>> wsd = make_schedule("warmup-stable-decay", 3e-3, 10)
      >>> [round(float(wsd(c, 100)), 6) for c in (5, 10, 80, 90, 100)]
      [0.0015, 0.003, 0.003, 0.00165, 0.0003]
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    end = 0.1 * lr

    def schedule(count: Any, total: Any, xp: Any = jnp) -> jax.Array:
        # xp=numpy: the same float32 arithmetic on the host, without a dispatch per operation.
        count = xp.asarray(count, xp.float32)
        total = xp.asarray(total, xp.float32)
        if name == "constant":
            return xp.full((), lr, xp.float32)
        zero, one = xp.float32(0.0), xp.float32(1.0)
        warmup = xp.minimum(xp.float32(warmup_steps), xp.maximum(total - one, zero)) if name != "cosine" else zero
        rising = xp.float32(lr) * count / xp.maximum(warmup, one)
        if name == "warmup-stable-decay":
            stable_end = xp.maximum(decay_start(total), warmup)
            falling = xp.clip((total - count) / xp.maximum(total - stable_end, one), zero, one)
            return xp.where(count < warmup, rising, xp.float32(end) + xp.float32(lr - end) * falling)
        decay = xp.maximum(total, warmup + one) - warmup
        cosine = xp.float32(0.5) * (one + xp.cos(xp.float32(math.pi) * xp.clip(count - warmup, zero, decay) / decay))
        decayed = xp.float32(end) + xp.float32(lr - end) * cosine
        return xp.where(count < warmup, rising, decayed)

    return schedule


class RunScheduleState(NamedTuple):
    """``count``: applied updates; ``total``: the run's length in steps (int32 scalars)."""

    # optax's name (ScaleByScheduleState.count), and a key of the saved checkpoints: it hides tuple.count.
    count: jax.Array  # type: ignore[assignment]
    total: jax.Array


def scale_by_run_schedule(schedule: Schedule, total: int) -> optax.GradientTransformation:
    r"""Scales updates by :math:`-\eta(\text{count}, \text{total})`, ``total`` kept in the state.

    Like ``optax.scale_by_learning_rate`` of a schedule, with the schedule's length a value of
    the state (:func:`set_total_steps`) rather than a constant of the compiled update.

    Example:
      >>> tx = scale_by_run_schedule(make_schedule("constant", 0.5, 0), total=10)
      >>> updates, state = tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.zeros(2)}))
      >>> updates["w"].tolist(), int(state.count), int(state.total)
      ([-0.5, -0.5], 1, 10)
    """

    def init(params: Any) -> RunScheduleState:
        del params
        return RunScheduleState(jnp.zeros((), jnp.int32), jnp.asarray(total, jnp.int32))

    def update(updates: Any, state: RunScheduleState, params: Any = None) -> tuple[Any, RunScheduleState]:
        del params
        step_size = -schedule(state.count, state.total)
        updates = jax.tree.map(lambda u: step_size.astype(u.dtype) * u, updates)
        return updates, RunScheduleState(optax.safe_int32_increment(state.count), state.total)

    return optax.GradientTransformation(init, update)


def set_total_steps(opt_state: Any, total: int) -> Any:
    """``opt_state`` with every :class:`RunScheduleState`'s ``total`` set to ``total`` (its sharding kept).

    Example:
      >>> tx = scale_by_run_schedule(make_schedule("cosine", 1.0, 0), total=0)
      >>> int(set_total_steps(tx.init({}), 500).total)
      500
    """

    def set_total(node: Any) -> Any:
        if not isinstance(node, RunScheduleState):
            return node
        # An operation on the old value keeps its placement (and a committed array committed):
        # a state that differed in either would compile the step again.
        return node._replace(total=node.total * 0 + jnp.asarray(total, node.total.dtype))

    return jax.tree.map(set_total, opt_state, is_leaf=lambda node: isinstance(node, RunScheduleState))
