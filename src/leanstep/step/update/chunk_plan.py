"""Whether and how the guarded update is chunked: the plan for a state, by its ``update_chunk``
setting (checked in :mod:`leanstep.step.spec_parts`; :mod:`leanstep.step.update.chunks` applies the plan).

An optimizer state kept in host memory (:mod:`leanstep.step.update.offload`) is planned as the
state kept on the device would be, and chunked under ``"auto"`` whenever the optimizer allows it,
so that one chunk of the state comes to the device at a time (:func:`update_plan`)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from leanstep.step.spec_parts import check_update_chunk
from leanstep.step.update.chunks import ChunkPlan, chunk_plan
from leanstep.step.update.offload import is_offloaded

__all__ = ["DEFAULT_UPDATE_CHUNK", "chunk_plan_for", "update_plan"]

#: The default largest chunk, in entries (measured: docs/lean-state.md, "A chunk-bounded update").
DEFAULT_UPDATE_CHUNK = 2**22


def _lean(state: Any) -> bool:
    """Whether the state is kept narrower than its float32 update (bfloat16 masters, 8-bit or
    bfloat16 moments): where ``"auto"`` chunks. A float32 state widens nothing (24.95 against 23.64
    bytes a parameter at peak, docs/lean-state.md), and its whole-tree program is 0.11's, bit for
    bit, on meshes too, where the chunked one differs by XLA:CPU's fused multiply-adds
    (tests/test_chunked_update.py)."""
    narrow = (jnp.uint8, jnp.bfloat16, jnp.float16)
    return state.master != "float32" or any(jnp.result_type(x) in narrow for x in jax.tree.leaves(state.opt_state))


def chunk_plan_for(state: Any, wide: Any, update_chunk: Any) -> ChunkPlan | None:
    """The plan :func:`leanstep.step.guarded_update` follows for ``state`` (masters widened: ``wide``),
    or None: the whole tree at once (``update_chunk`` None; ``"auto"`` for a float32 state, or
    where one chunk holds every parameter, the optimizer mixes parameters or the spike guard
    watches the update's norm).

    Raises:
      ValueError: a bad ``update_chunk``; an int where the optimizer mixes parameters (the
        transformation named) or the spike guard watches the update's norm.
    """
    update_chunk = check_update_chunk(update_chunk)
    if update_chunk is None:
        return None
    given = update_chunk != "auto"
    limit = int(update_chunk) if given else DEFAULT_UPDATE_CHUNK
    if not given and (not _lean(state) or sum(math.prod(jnp.shape(p)) for p in jax.tree.leaves(wide)) <= limit):
        return None
    spike_guard = state.spike_guard
    if spike_guard is not None and "update_norm" in spike_guard.watch:
        if given:
            raise ValueError(
                f"update_chunk={update_chunk!r} with a spike guard watching 'update_norm': the norm of the "
                "whole update is known only after the last chunk; pass update_chunk=None or leave "
                "'update_norm' out of SpikeGuard(watch=...)"
            )
        return None
    key = None if state.master == "float32" else jax.random.wrap_key_data(state.rng)
    plan, why = chunk_plan(state.optimizer, state.opt_state, wide, limit, key)
    if plan is None and given:
        raise ValueError(
            f"update_chunk={update_chunk!r}: the optimizer's update mixes parameters ({why}), so it cannot "
            "be applied a chunk at a time; pass update_chunk=None (or 'auto', which then applies it whole), "
            "or take the transformation out of the optimizer (the step clips the global norm itself: "
            "max_grad_norm=)"
        )
    return plan


def update_plan(state: Any, wide: Any, update_chunk: Any) -> ChunkPlan | None:
    """:func:`chunk_plan_for`, for a state whose optimizer state
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
