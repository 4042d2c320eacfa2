"""A finite gradient whose float32 sum of squares overflows (issue 57, item 3).

0.12 took a non-finite norm for a non-finite gradient: with clipping on, a gradient of entries
1e20 was skipped at every step and the dynamic loss scale halved each time, though nothing in it
is inf or NaN (without clipping the same gradient was applied). The norm is now summed again over
the entries divided by the largest where the float32 sum overflows; the references are float64
NumPy norms and clipped updates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from leanstep.blocks.clipping import clip_by_global_norm, global_norm, norm_parts
from leanstep.step.update import guarded_update_transform

F32_MAX = float(np.finfo(np.float32).max)


def _tree(scale: float, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.normal(size=(16, 8)) * scale, jnp.float32),
        "b": jnp.asarray(rng.normal(size=(8,)) * scale, jnp.float32),
        "h": jnp.asarray(rng.normal(size=(5,)) * min(scale, 1e30), jnp.bfloat16),  # bfloat16 holds 1e30
    }


def _norm64(tree) -> float:
    return float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree))))


@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e18, 1e20, 1e30, 3e36])
def test_the_global_norm_is_the_float64_norm_where_its_squares_overflow(scale):
    tree = _tree(scale)
    expected = _norm64(tree)
    got = float(jax.jit(global_norm)(tree))
    assert expected < F32_MAX
    assert got == pytest.approx(expected, rel=1e-5)


def test_a_norm_beyond_float32_is_inf_but_its_clip_is_the_float64_clip():
    tree = {"w": jnp.full((4,), 3e38, jnp.float32), "b": jnp.asarray([-2e38, 1.0], jnp.float32)}
    clipped, norm = jax.jit(clip_by_global_norm)(tree, 1.0)
    assert np.isinf(float(norm))
    expected = _norm64(tree)
    for key, leaf in tree.items():
        reference = np.asarray(leaf, np.float64) / expected
        np.testing.assert_allclose(np.asarray(clipped[key], np.float64), reference, rtol=1e-5, atol=1e-38)
    assert bool(norm_parts(tree).finite)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_an_inf_or_nan_entry_is_still_not_finite_beside_overflowing_ones(bad):
    tree = {"w": jnp.full((4,), 1e20, jnp.float32).at[2].set(bad), "b": jnp.ones(3)}
    parts = jax.jit(norm_parts)(tree)
    assert not bool(parts.finite)
    assert not np.isfinite(float(parts.norm))
    clipped, _ = clip_by_global_norm(tree, 1.0)
    assert not np.isfinite(np.asarray(clipped["w"])).all()


def test_the_norm_at_zero_keeps_a_finite_gradient():
    assert np.all(np.asarray(jax.grad(global_norm)(jnp.zeros(3))) == 0)
    assert float(global_norm({"w": jnp.zeros((0,))})) == 0.0


def _loss(params, batch):
    """The mean over rows of a linear loss: its gradient is the mean row, here every row."""
    return jnp.mean(batch["x"] @ params["w"] + batch["y"] @ params["b"])


PARAMS = {"w": jnp.ones(4), "b": jnp.zeros(2)}
ROW = {"x": jnp.asarray([1e20, -2e20, 3e20, 1e19]), "y": jnp.asarray([1.0, -1.0])}


def _reference(steps: int, lr: float, max_norm: float) -> dict:
    """SGD on the clipped gradient, in float64 NumPy."""
    grad = {"w": np.asarray(ROW["x"], np.float64), "b": np.asarray(ROW["y"], np.float64)}
    norm = np.sqrt(sum(np.sum(g**2) for g in grad.values()))
    params = {k: np.asarray(v, np.float64) for k, v in PARAMS.items()}
    for _ in range(steps):
        params = {k: params[k] - lr * grad[k] * min(1.0, max_norm / norm) for k in params}
    return params


@pytest.mark.parametrize("update_chunk", [None, 4])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_clipped_step_of_an_overflowing_norm_is_applied_and_keeps_the_loss_scale(update_chunk, microbatches):
    batch = {k: jnp.stack([v] * 4) for k, v in ROW.items()}
    state = leanstep.TrainState.create(PARAMS, optax.sgd(0.1), loss_scale="dynamic")
    step = leanstep.make_train_step(_loss, max_grad_norm=1.0, num_microbatches=microbatches, update_chunk=update_chunk)
    for _ in range(3):
        state, metrics = step(state, batch)
        assert not bool(metrics.skipped) and bool(metrics.clipped)
        assert float(metrics.grad_norm) == pytest.approx(_norm64(ROW), rel=1e-6)
        assert float(metrics.loss_scale) == 32768.0
    reference = _reference(3, 0.1, 1.0)
    for key in PARAMS:
        np.testing.assert_allclose(np.asarray(state.params[key], np.float64), reference[key], rtol=1e-6, atol=1e-7)


def test_the_guarded_transform_applies_an_overflowing_clipped_gradient():
    tx = guarded_update_transform(optax.sgd(0.1), loss_scale="dynamic", max_grad_norm=1.0)
    state = tx.init(PARAMS)
    grads = {"w": ROW["x"] * 32768.0, "b": ROW["y"] * 32768.0}  # the gradient of the scaled loss
    updates, state = tx.update(grads, state, PARAMS)
    assert int(state.consecutive_skips) == 0 and float(state.loss_scale.loss_scale) == 32768.0
    reference = _reference(1, 0.1, 1.0)
    for key, param in PARAMS.items():
        np.testing.assert_allclose(np.asarray(param + updates[key], np.float64), reference[key], rtol=1e-6, atol=1e-7)
