"""Model state in the step, on its own: threaded in order, never trained, never cast, kept on a skip.

References: a plain-Python model of the state's path through the microbatches, bit-identity
on a skipped step, a checkpoint round trip, and the dtypes the loss is handed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from leanstep import LossContract
from leanstep.checkpoints.checkpointer import Checkpointer
from leanstep.step.gradients import gradient_stage
from leanstep.step.state import TrainState
from leanstep.step.train_step import make_train_step


def counting_loss(params, model_state, batch):
    """Counts microbatches and keeps a running mean of x, as BatchNorm keeps its statistics."""
    loss = jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    new_state = {
        "count": model_state["count"] + 1,
        "mean": 0.5 * model_state["mean"] + 0.5 * jnp.mean(batch["x"].astype(jnp.float32), axis=0),
    }
    return (loss, (model_state["count"], model_state["mean"].dtype == jnp.float32)), new_state


def state0(**kw) -> TrainState:
    return TrainState.create(
        {"w": jnp.ones((3, 1), jnp.float32) * 0.1},
        optax.sgd(0.1),
        model_state={"count": jnp.int32(5), "mean": jnp.zeros(3, jnp.float32)},
        **kw,
    )


def batch0(rows: int = 8, poison: bool = False) -> dict:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3)).astype(np.float32)
    if poison:
        x[3, 0] = np.nan
    return {"x": jnp.asarray(x), "y": jnp.asarray(rng.normal(size=(rows, 1)).astype(np.float32))}


STEP = make_train_step(
    counting_loss, has_state=True, has_aux=True, num_microbatches=4, precision="compute=bfloat16", donate=False
)


def test_the_state_threads_through_the_microbatches_in_order():
    batch = batch0()
    state, metrics = STEP(state0(), batch)
    counts, float32_seen = metrics.aux
    np.testing.assert_array_equal(counts, [5, 6, 7, 8])  # microbatch j sees the count j - 1 left
    assert int(state.model_state["count"]) == 9 and bool(np.all(float32_seen))  # never cast to bf16
    mean = np.zeros(3)
    for j in range(4):  # the running mean over the microbatches, in order, in float64
        mean = 0.5 * mean + 0.5 * np.asarray(batch["x"], np.float64)[2 * j : 2 * j + 2].astype(jnp.bfloat16).astype(
            np.float64
        ).mean(axis=0)
    np.testing.assert_allclose(state.model_state["mean"], mean, rtol=1e-6)
    assert state.model_state["mean"].dtype == jnp.float32
    # The optimizer never sees the state: the optimizer state is the params' alone.
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(optax.sgd(0.1).init(state.params))


def test_a_skipped_step_keeps_the_state():
    before = state0()
    state, metrics = STEP(before, batch0(poison=True))
    assert bool(metrics.skipped)
    for a, b in zip(jax.tree.leaves(state.model_state), jax.tree.leaves(before.model_state), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_the_state_is_checkpointed_with_the_rest(tmp_path):
    state, _ = STEP(state0(), batch0())
    with Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, state)
        restored = checkpointer.restore(state0()).state
    assert int(restored.model_state["count"]) == 9
    np.testing.assert_array_equal(restored.model_state["mean"], state.model_state["mean"])


def test_the_gradient_stage_returns_the_state_and_differentiates_only_params():
    stage = gradient_stage(counting_loss, accumulation=2, loss=LossContract(has_aux=True, has_state=True))
    model_state = state0().model_state
    result = stage(state0().params, batch0(), model_state=model_state)
    assert int(result.model_state["count"]) == 7
    assert jax.tree.structure(result.grads) == jax.tree.structure(state0().params)


def test_state_mismatches_are_named():
    plain = TrainState.create({"w": jnp.ones((3, 1))}, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"has_state=True needs TrainState.create\(..., model_state=...\)"):
        STEP(plain, batch0())
    with pytest.raises(ValueError, match="the state holds a model_state: pass has_state=True"):
        make_train_step(lambda p, b: jnp.mean(b["x"] @ p["w"]))(state0(), batch0())
    with pytest.raises(TypeError, match="has_state=True: loss_fn must return a new model state of the structure"):
        make_train_step(lambda p, s, b: (jnp.mean(b["x"] @ p["w"]), {"count": s["count"]}), has_state=True)(
            state0(), batch0()
        )
    with pytest.raises(TypeError, match=r"has_state=True: loss_fn must return \(out, new_model_state\)"):
        make_train_step(lambda p, s, b: jnp.mean(b["x"] @ p["w"]), has_state=True)(state0(), batch0())
    with pytest.raises(
        TypeError, match=r"model_state\['f'\] is a PjitFunction; the model state must be a pytree of arrays"
    ):
        TrainState.create({"w": jnp.ones(2)}, optax.sgd(0.1), model_state={"f": jnp.sin})
