"""Tests for leanstep.step.update: the guarded update and its optax form, on their own.

References: a hand-written update (unscale, float64 NumPy norm, clip, optax AdamW) for finite
gradients; bit-identity of params and optimizer state for non-finite ones; a plain-Python model
of the skip counter and the loss scale over a random sequence of finite and non-finite steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from leanstep.blocks.loss_scale import DynamicLossScale, StaticLossScale
from leanstep.common.checks import INT32_MAX
from leanstep.step.state import TrainState
from leanstep.step.update import GuardedState, guarded_update, guarded_update_transform

OPT = optax.adamw(0.1)
SCALE = 256.0


def params0() -> dict:
    return {"w": jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3) / 7, "b": jnp.array([0.5, -0.25], jnp.float32)}


def grads0(factor: float = 1.0) -> dict:
    return {"w": jnp.full((2, 3), 0.3 * factor, jnp.float32), "b": jnp.array([-0.4, 0.1], jnp.float32) * factor}


def state0() -> TrainState:
    return TrainState.create(params0(), OPT, loss_scale=DynamicLossScale.create(SCALE, growth_interval=3))


def reference(params: dict, grads: dict, max_norm: float | None) -> tuple[dict, float]:
    """Clip in float64 NumPy, then optax's own AdamW step."""
    norm = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads))))
    factor = 1.0 if max_norm is None or norm <= max_norm else max_norm / norm
    clipped = jax.tree.map(lambda g: jnp.asarray(np.asarray(g, np.float64) * factor, jnp.float32), grads)
    updates, _ = OPT.update(clipped, OPT.init(params), params)
    return optax.apply_updates(params, updates), norm


@pytest.mark.parametrize("max_norm", [None, 10.0, 0.5])
def test_finite_gradients_match_a_hand_written_update(max_norm):
    state = state0()
    new, info = jax.jit(guarded_update, static_argnames="max_grad_norm")(
        state, jax.tree.map(lambda g: g * SCALE, grads0()), loss=jnp.float32(1.0), max_grad_norm=max_norm
    )
    expected, norm = reference(params0(), grads0(), max_norm)
    for a, e in zip(jax.tree.leaves(new.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(info.grad_norm, norm, rtol=1e-6)
    assert bool(info.finite) and bool(info.clipped) == (max_norm is not None and norm > max_norm)
    assert int(new.consecutive_skips) == 0 and int(new.loss_scale.good_steps) == 1
    assert int(new.step) == 0 and new.optimizer is OPT  # the step counter is the composition's


# A finite gradient whose float32 sum of squares overflows is no longer skipped (issue 57, item 3):
# tests/test_clipping_overflow.py clips and applies it against a float64 reference.
@pytest.mark.parametrize("poison", ["nan_grad", "inf_grad", "nan_loss"])
def test_a_non_finite_step_changes_nothing_but_the_scale_and_the_count(poison):
    state = state0()
    grads = jax.tree.map(lambda g: g * SCALE, grads0())
    loss = jnp.float32(1.0)
    if poison == "nan_grad":
        grads["w"] = grads["w"].at[0, 1].set(jnp.nan)
    elif poison == "inf_grad":
        grads["b"] = grads["b"].at[0].set(-jnp.inf)
    else:
        loss = jnp.float32(jnp.nan)
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    new, info = guarded_update(state, grads, loss=loss, max_grad_norm=1.0)
    assert not bool(info.finite) and not bool(info.clipped)
    for a, b in zip(jax.tree.leaves((new.params, new.opt_state)), jax.tree.leaves(before), strict=True):
        assert np.asarray(a).tobytes() == b.tobytes()
    assert float(new.loss_scale.loss_scale) == SCALE / 2 and int(new.consecutive_skips) == 1


def test_skip_counter_and_scale_follow_a_plain_python_model():
    rng = np.random.default_rng(3)
    finite_steps = rng.random(40) < 0.7
    step = jax.jit(guarded_update)
    state, scale, good, skips = state0(), SCALE, 0, 0
    for finite in finite_steps:
        factor = float(state.loss_scale.loss_scale) * (1.0 if finite else np.nan)
        grads = jax.tree.map(lambda g, factor=factor: g * factor, grads0())
        state, info = step(state, grads)
        good, skips = (good + 1, 0) if finite else (0, skips + 1)
        if finite and good >= 3:
            scale, good = min(scale * 2, 2.0**24), 0
        elif not finite:
            scale = max(scale / 2, 1.0)
        assert (bool(info.finite), int(state.consecutive_skips), float(state.loss_scale.loss_scale)) == (
            bool(finite),
            skips,
            scale,
        )


def test_skip_counter_saturates():
    state = state0().replace(consecutive_skips=jnp.int32(INT32_MAX))
    new, _ = guarded_update(state, {"w": jnp.full((2, 3), jnp.nan), "b": jnp.zeros(2)})
    assert int(new.consecutive_skips) == INT32_MAX


def test_transform_matches_the_function_form_and_chains_with_optax():
    tx = optax.chain(
        optax.identity(), guarded_update_transform(OPT, loss_scale=DynamicLossScale.create(SCALE), max_grad_norm=0.5)
    )
    params = params0()
    opt_state = tx.init(params)
    assert isinstance(opt_state[1], GuardedState)
    updates, opt_state = jax.jit(tx.update)(jax.tree.map(lambda g: g * SCALE, grads0()), opt_state, params)
    new, info = guarded_update(state0(), jax.tree.map(lambda g: g * SCALE, grads0()), max_grad_norm=0.5)
    for a, e in zip(jax.tree.leaves(optax.apply_updates(params, updates)), jax.tree.leaves(new.params), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-6)  # jitted against eager: an ulp apart at most
    np.testing.assert_allclose(opt_state[1].grad_norm, info.grad_norm)
    # A non-finite gradient: zero updates, the inner state kept, the scale halved.
    inner = jax.tree.map(np.asarray, opt_state[1].inner_state)
    updates, opt_state = tx.update({"w": jnp.full((2, 3), jnp.inf), "b": jnp.zeros(2)}, opt_state, params)
    assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
    for a, b in zip(jax.tree.leaves(opt_state[1].inner_state), jax.tree.leaves(inner), strict=True):
        assert np.asarray(a).tobytes() == b.tobytes()
    assert float(opt_state[1].loss_scale.loss_scale) == SCALE / 2 and int(opt_state[1].consecutive_skips) == 1


def test_transform_arguments_are_checked():
    with pytest.raises(TypeError, match="optimizer must be an optax.GradientTransformation"):
        guarded_update_transform("adam")
    with pytest.raises(ValueError, match="max_grad_norm must be a positive finite number or None, got -1"):
        guarded_update_transform(OPT, max_grad_norm=-1)
    with pytest.raises(ValueError, match="initial_scale is required for spec 'static'"):
        guarded_update_transform(OPT, loss_scale="static")
    tx = guarded_update_transform(OPT, loss_scale=StaticLossScale.create(2.0))
    with pytest.raises(ValueError, match="needs params"):
        tx.update(grads0(), tx.init(params0()))


# No composition of leanstep's guards unscales twice (issue 27, item 13): the class of cases.
GUARDS = {
    "dynamic": lambda: guarded_update_transform(OPT, loss_scale="dynamic"),
    "static": lambda: guarded_update_transform(OPT, loss_scale=StaticLossScale.create(8.0)),
    "chained": lambda: optax.chain(optax.identity(), guarded_update_transform(OPT, loss_scale="dynamic")),
    "nested-inner-none": lambda: guarded_update_transform(
        guarded_update_transform(OPT, loss_scale="dynamic"), loss_scale="none"
    ),
}


@pytest.mark.parametrize("guard", sorted(GUARDS))
@pytest.mark.parametrize("state_scale", ["none", "dynamic"])
def test_a_guard_with_a_loss_scale_inside_the_step_is_refused(guard, state_scale):
    """make_train_step (guarded_update) unscales by the state's loss scale; a guard inside its optimizer
    would divide again (by 32768 for a dynamic scale, whatever the state's scale is)."""
    import leanstep

    state = TrainState.create(params0(), GUARDS[guard](), loss_scale=state_scale)
    with pytest.raises(ValueError, match="unscaled twice"):
        guarded_update(state, grads0())
    step = leanstep.make_train_step(lambda p, b: jnp.sum(p["w"] ** 2) * jnp.mean(b), jit=False)
    with pytest.raises(ValueError, match="unscaled twice"):
        step(state, jnp.ones(2))


def test_a_guard_with_no_loss_scale_inside_the_step_only_guards_and_matches_the_plain_optimizer():
    plain = TrainState.create(params0(), OPT, loss_scale="dynamic")
    guarded = TrainState.create(params0(), guarded_update_transform(OPT, loss_scale="none"), loss_scale="dynamic")
    scaled = jax.tree.map(lambda g: g * plain.loss_scale.loss_scale, grads0())
    a, _ = guarded_update(plain, scaled)
    b, _ = guarded_update(guarded, scaled)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(jax.tree.leaves(a.params)[0], jax.tree.leaves(params0())[0])  # it moved


def test_a_guard_around_a_scaling_guard_is_refused_at_init():
    outer = guarded_update_transform(guarded_update_transform(OPT, loss_scale="dynamic"), loss_scale="dynamic")
    with pytest.raises(ValueError, match="the optimizer given to guarded_update_transform .* unscaled twice"):
        outer.init(params0())


def test_the_transform_needs_its_loss_scale_named():
    """The old default, dynamic, divided every update of an unscaled loss by 32768."""
    with pytest.raises(TypeError, match="guarded_update_transform needs loss_scale=: 'none' for the gradient"):
        guarded_update_transform(OPT)
    tx = guarded_update_transform(optax.sgd(1.0), loss_scale="none")  # as optax.apply_if_finite
    updates, _ = tx.update({"w": jnp.array([1.0, 2.0])}, tx.init({"w": jnp.zeros(2)}), {"w": jnp.zeros(2)})
    np.testing.assert_array_equal(updates["w"], [-1.0, -2.0])


def test_an_unscaling_guard_inside_a_non_scaling_one_unscales_once():
    inner = guarded_update_transform(optax.sgd(1.0), loss_scale=StaticLossScale.create(4.0))
    tx = guarded_update_transform(inner, loss_scale="none")
    params = {"w": jnp.zeros(2)}
    updates, _ = tx.update({"w": jnp.array([4.0, 8.0])}, tx.init(params), params)
    np.testing.assert_array_equal(updates["w"], [-1.0, -2.0])  # divided by 4 once, not 16
