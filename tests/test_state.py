"""Tests for leanstep.step.state: the state carries its own part of the step (optimizer, masters'
and moments' formats, spike guard) as static fields, through jit, scan and a checkpoint, and a
checkpoint of 0.11's state (without the guard and moments fields) restores into 0.12's bit for bit."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from leanstep import StepSpec, TrainState
from leanstep.blocks.spike_guard import SpikeGuard
from leanstep.checkpoints import Checkpointer

GUARD = SpikeGuard(window=4, warmup=2, watch=("loss", "grad_norm"))
SPEC = StepSpec(master="bfloat16-sr", moments="int8", spike_guard=GUARD, loss_scale="dynamic")


def _params() -> dict:
    return {"w": jnp.arange(600.0, dtype=jnp.float32).reshape(2, 300) / 600, "b": jnp.ones(3)}


def _bits(tree: Any) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


def _static(state: TrainState) -> tuple[Any, ...]:
    return state.optimizer, state.master, state.spike_guard, state.moments


def test_the_state_carries_its_guard_and_moments_through_jit_and_scan():
    state = TrainState.create(_params(), optax.adam(1e-3), SPEC)
    assert (state.master, state.spike_guard, state.moments) == ("bfloat16-sr", GUARD, "int8")
    through_jit = jax.jit(lambda s: s)(state)
    through_scan, _ = jax.lax.scan(lambda s, _: (s, None), state, None, length=3)
    for out in (through_jit, through_scan):
        assert _static(out) == _static(state) and _bits(out) == _bits(state)
    # static fields: two guards (or moments formats) are two programs, never one traced with the other's
    other = TrainState.create(_params(), optax.adam(1e-3), SPEC.replace(spike_guard=SpikeGuard(window=4, warmup=2)))
    assert jax.tree.structure(other) != jax.tree.structure(state)
    plain = TrainState.create(_params(), optax.adam(1e-3))
    assert (plain.spike_guard, plain.moments, plain.spike) == (None, "float32", None)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "step",
        "params",
        "opt_state",
        "loss_scale",
        "rng",
        "consecutive_skips",
        "model_state",
        "master_error",
        "spike",
    ],
    meta_fields=["optimizer", "master"],
)
@dataclasses.dataclass(frozen=True)
class StateOf011:
    """0.11's TrainState: the same arrays, the optimizer and master format its only static fields."""

    step: Any
    params: Any
    opt_state: Any
    loss_scale: Any
    rng: Any
    consecutive_skips: Any
    model_state: Any
    optimizer: Any
    master_error: Any = None
    spike: Any = None
    master: Any = "float32"


def test_a_checkpoint_of_0_11s_state_restores_into_the_state_with_its_static_fields(tmp_path):
    optimizer = optax.adam(1e-3)
    saved = TrainState.create(_params(), optimizer, SPEC, seed=3).replace(step=jnp.int32(17))
    fields = {f.name: getattr(saved, f.name) for f in dataclasses.fields(StateOf011)}
    old = StateOf011(**fields)
    template = TrainState.create(_params(), optimizer, SPEC, seed=0)
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(17, old)
        restored = checkpointer.restore(template).state
    assert isinstance(restored, TrainState) and _static(restored) == _static(template)
    assert jax.tree.structure(restored) == jax.tree.structure(saved) and _bits(restored) == _bits(saved)
