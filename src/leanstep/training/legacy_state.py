"""Restoring checkpoints written by leanstep 0.5 and earlier, whose schedule state had no length.

Before the schedule's length moved into the optimizer state (:mod:`leanstep.training.schedule`),
the optimizer was ``optax.adamw`` of an optax schedule, whose last state is
``optax.ScaleByScheduleState(count)``. Such a checkpoint restores into the template with that
state in place of :class:`~leanstep.training.schedule.RunScheduleState`, and the length is then
the template's (the run's ``--steps``): the update it computes is the one 0.5 computed.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import optax

from leanstep.checkpoints.checkpointer import Checkpointer, CheckpointError, RestoreResult
from leanstep.training.schedule import RunScheduleState

__all__ = ["from_legacy", "restore_state", "to_legacy"]


def _is_schedule(node: Any) -> bool:
    return isinstance(node, RunScheduleState)


def to_legacy(opt_state: Any) -> Any:
    """``opt_state`` with each :class:`RunScheduleState` as 0.5 saved it: ``ScaleByScheduleState(count)``."""
    return jax.tree.map(
        lambda n: optax.ScaleByScheduleState(count=n.count) if _is_schedule(n) else n, opt_state, is_leaf=_is_schedule
    )


def from_legacy(legacy: Any, template: Any) -> Any:
    """The inverse of :func:`to_legacy`: each count from ``legacy``, each length from ``template``."""
    return jax.tree.map(
        lambda t, old: t._replace(count=old.count) if _is_schedule(t) else old, template, legacy, is_leaf=_is_schedule
    )


def restore_state(checkpointer: Checkpointer, template: Any) -> RestoreResult:
    """:meth:`Checkpointer.restore` into ``template`` (a TrainState), or failing that, as a 0.5 checkpoint.

    Raises:
      CheckpointError: the first attempt's error, when neither restores.
    """
    quiet = logging.getLogger("leanstep.checkpoints.checkpointer")  # each rejected step is in the result's skipped
    level, quiet.level = quiet.level, logging.ERROR
    try:
        try:
            return checkpointer.restore(template)
        except CheckpointError as error:
            try:
                restored = checkpointer.restore(template.replace(opt_state=to_legacy(template.opt_state)))
            except CheckpointError:
                raise error from None
    finally:
        quiet.setLevel(level)
    return restored._replace(
        state=restored.state.replace(opt_state=from_legacy(restored.state.opt_state, template.opt_state))
    )
