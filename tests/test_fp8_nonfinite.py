"""A non-finite operand of an FP8 matmul skips the step, as it does without FP8 (issue 41, item 6).

The quantizer clips to the format's largest value, so before 0.12 an inf input (or an
overflowed, scaled output gradient) left the FP8 matmul finite: the step trained on it, wrote
inf into the amax history, and delayed scaling then kept its scale frozen until the inf left
the history. The reference here is the same model without FP8 (plain matmuls), whose step
skips such a batch; and the FP8 state after the bad step is the state before it, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from helpers.fp8_models import batch, fp8_of
from leanstep.blocks.fp8 import fp8_max
from leanstep.blocks.loss_scale import StaticLossScale

PRECISION = "params=float32,compute=bfloat16,output=float32"
HISTORY = 8


def _recipe(scaling: str) -> leanstep.Fp8Recipe:
    return leanstep.Fp8Recipe(scaling, history=HISTORY) if scaling == "delayed" else leanstep.Fp8Recipe(scaling)


def _params(scaling: str | None) -> dict:
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (16, 32)) * 0.3, "w2": jax.random.normal(k2, (32, 4)) * 0.3}
    if scaling == "delayed":
        params["fp8"] = {
            "l1": leanstep.blocks.Fp8Meta.create(_recipe(scaling)),
            "l2": leanstep.blocks.Fp8Meta.create(_recipe(scaling)),
        }
    return params


def _loss(scaling: str | None):
    def loss(params, batch):
        if scaling is None:
            out = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
        else:
            metas = params.get("fp8", {"l1": None, "l2": None})
            h = jnp.tanh(leanstep.blocks.fp8_matmul(batch["x"], params["w1"], metas["l1"], _recipe(scaling)))
            out = leanstep.blocks.fp8_matmul(h, params["w2"], metas["l2"], _recipe(scaling))
        return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)

    return loss


def _run(scaling: str | None, bad: dict, *, loss_scale="dynamic") -> tuple:
    """Two good steps, then ``bad``: the state before the bad step, after it, and its metrics."""
    step = leanstep.make_train_step(_loss(scaling), precision=PRECISION, num_microbatches=2, max_grad_norm=1.0)
    state = leanstep.TrainState.create(_params(scaling), optax.adam(1e-3), loss_scale=loss_scale)
    for seed in (0, 1):
        state, metrics = step(state, batch(seed))
        assert not bool(metrics.skipped)
    before = jax.tree.map(np.asarray, state)
    after, metrics = step(state, bad)
    return before, jax.tree.map(np.asarray, after), metrics, step, after


def _with_inf_input() -> dict:
    bad = batch(2)
    bad["x"][3, 2] = np.inf
    return bad


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_an_inf_input_skips_the_step_as_the_plain_step_does(scaling):
    _, _, plain, _, _ = _run(None, _with_inf_input())
    before, after, metrics, _, _ = _run(scaling, _with_inf_input())
    assert bool(plain.skipped)  # the reference: without FP8 the inf reaches the gradient
    assert bool(metrics.skipped)
    assert float(metrics.loss_scale) == float(plain.loss_scale)  # backed off alike
    for a, b in zip(jax.tree.leaves(after.params), jax.tree.leaves(before.params), strict=True):
        np.testing.assert_array_equal(a, b)  # weights and FP8 state bit-identical
    for a, b in zip(jax.tree.leaves(after.opt_state), jax.tree.leaves(before.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert all(np.all(np.isfinite(leaf)) for leaf in fp8_of(after.params))


def test_after_an_inf_input_the_input_scale_follows_larger_inputs():
    """The scale is not frozen: steps on 50x larger inputs after the skipped one give the input
    scale of delayed scaling's formula over the amaxes actually seen (float64 NumPy)."""
    _, _, _, step, state = _run("delayed", _with_inf_input())
    seen = []
    for seed in (3, 4, 5):
        big = batch(seed)
        big["x"] = big["x"] * 50.0
        seen.append(float(np.max(np.abs(np.asarray(jnp.asarray(big["x"], jnp.bfloat16), np.float64)))))
        state, metrics = step(state, big)
        assert not bool(metrics.skipped)
    meta = state.params["fp8"]["l1"]
    history = np.asarray(meta.input_history, np.float64)
    assert np.all(np.isfinite(history))
    assert history[0] == pytest.approx(seen[-1], rel=0)
    # the scale the last step quantized with: from the history before it (max of the amaxes before)
    expected = np.float32(1.0) / (np.float32(fp8_max("e4m3")) / np.float32(max(history[1:])))
    assert float(meta.input_scale[0]) == pytest.approx(float(expected), rel=1e-6)
    assert float(meta.input_scale[0]) > 10 * 0.0247  # the frozen value the issue measured


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_an_overflowed_output_gradient_skips_the_step_as_the_plain_step_does(scaling):
    """A static loss scale of 1e38 and targets of 1e3: the scaled cotangent of the output (about
    1e38 * 2 * 1e3 / 64) overflows to inf. Without FP8 the gradient is not finite and the step
    skips; the e5m2 quantizer used to clip the inf to its largest value and apply the step."""
    scale = StaticLossScale.create(1e38)
    far = batch(2)
    far["y"] = far["y"] * 1e3
    plain_step = leanstep.make_train_step(_loss(None), precision=PRECISION, num_microbatches=2, max_grad_norm=1.0)
    fp8_step = leanstep.make_train_step(_loss(scaling), precision=PRECISION, num_microbatches=2, max_grad_norm=1.0)
    _, plain = plain_step(leanstep.TrainState.create(_params(None), optax.adam(1e-3), loss_scale=scale), far)
    state = leanstep.TrainState.create(_params(scaling), optax.adam(1e-3), loss_scale=scale)
    before = jax.tree.map(np.asarray, state.params)  # the step donates its state
    after, metrics = fp8_step(state, far)
    assert bool(plain.skipped)
    assert bool(metrics.skipped)
    for a, b in zip(jax.tree.leaves(after.params), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_fp8_matmul_of_a_non_finite_operand_is_not_finite():
    """The mechanism: forward and both transposes carry a non-finite operand through."""
    x = jnp.ones((4, 8)).at[1, 2].set(jnp.inf)
    w = jnp.full((8, 3), 0.5)
    recipe = _recipe("current")
    out, vjp = jax.vjp(lambda x, w: leanstep.blocks.fp8_matmul(x, w, None, recipe), x, w)
    assert not np.all(np.isfinite(np.asarray(out)))
    _, vjp = jax.vjp(lambda x, w: leanstep.blocks.fp8_matmul(x, w, None, recipe), jnp.ones((4, 8)), w)
    dx, dw = vjp(jnp.ones((4, 3)).at[0, 0].set(jnp.inf))
    assert not np.all(np.isfinite(np.asarray(dx))) and not np.all(np.isfinite(np.asarray(dw)))
    # finite operands: finite results (the factor is 1, not NaN)
    dx, dw = vjp(jnp.ones((4, 3)))
    assert np.all(np.isfinite(np.asarray(dx))) and np.all(np.isfinite(np.asarray(dw)))


def test_flax_fp8_ops_recording_an_inf_amax_skips_the_step():
    """Flax's own ``fp8_ops`` (whose quantizer clips as leanstep's did) record inf in their amax
    history: the guarded update counts the FP8 state it would write in its finiteness decision."""
    from helpers.fp8_models import flax_loss, flax_variables
    from leanstep.frameworks import linen as llinen

    params, _ = llinen.split(flax_variables())
    step = leanstep.make_train_step(flax_loss, precision=PRECISION, num_microbatches=2, max_grad_norm=1.0)
    state, metrics = step(leanstep.TrainState.create(params, optax.adam(1e-3), loss_scale="dynamic"), batch(0))
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = step(state, _with_inf_input())
    assert bool(metrics.skipped)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
