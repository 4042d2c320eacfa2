"""How the guarded update of an optimizer state kept in host memory is chunked
(:mod:`leanstep.step.update.offload`): planned as the state kept on the device would be, and
chunked under ``"auto"`` whenever the optimizer allows it, so that one chunk of the state comes
to the device at a time."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from leanstep.step.update.chunk_plan import DEFAULT_UPDATE_CHUNK, chunk_plan_for
from leanstep.step.update.chunks import ChunkPlan
from leanstep.step.update.offload import is_offloaded

__all__ = ["update_plan"]


def update_plan(state: Any, wide: Any, update_chunk: Any) -> ChunkPlan | None:
    """:func:`leanstep.step.update.chunk_plan.chunk_plan_for`, for a state whose optimizer state
    may live in host memory: planned on device stand-ins of it (the plan traces the optimizer,
    and JAX refuses to mix memory spaces); with ``"auto"``, chunks of ``DEFAULT_UPDATE_CHUNK``
    for an offloaded state whatever its format, or the whole tree (brought to the device at once)
    where the optimizer mixes parameters or the spike guard watches the update's norm.

    Raises:
      ValueError: as ``chunk_plan_for``.
    """
    if update_chunk is None:
        return None
    if not is_offloaded(state.opt_state):
        return chunk_plan_for(state, wide, update_chunk)
    standins = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), state.opt_state)
    state = state.replace(opt_state=standins)
    if not (isinstance(update_chunk, str) and update_chunk == "auto"):
        return chunk_plan_for(state, wide, update_chunk)
    try:
        return chunk_plan_for(state, wide, DEFAULT_UPDATE_CHUNK)
    except ValueError:  # the optimizer or the guard needs the whole tree: it comes to the device at once
        return None
