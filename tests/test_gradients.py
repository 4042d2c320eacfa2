"""Tests for leanstep.step.gradients: the gradient stage on its own.

References: ``jax.value_and_grad`` of the scaled full-batch loss in float32 (mean and
token-weighted), the per-microbatch keys ``fold_in(key, j)`` computed by hand, and the dtypes
the loss function is handed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import leanstep
from leanstep import Accumulation, LossContract
from leanstep.blocks.compute_dtype_check import PrecisionWarning
from leanstep.blocks.loss_scale import StaticLossScale
from leanstep.blocks.microbatches import split_microbatches
from leanstep.step.gradients import Gradients, gradient_stage

SCALE = StaticLossScale.create(1024.0)


def params0() -> dict:
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
    }


def batch0(rows: int = 12) -> dict:
    rng = np.random.default_rng(1)
    return {
        "x": jnp.asarray(rng.normal(size=(rows, 3)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(rows, 4)), jnp.float32),
        "mask": jnp.asarray(rng.integers(0, 2, size=(rows,)), jnp.float32),
    }


def mean_loss(params: dict, batch: dict) -> jax.Array:
    pred = jnp.tanh(batch["x"] @ params["w"] + params["b"][None, :])
    return jnp.mean((pred - batch["y"]) ** 2)


def sum_and_count(params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    pred = jnp.tanh(batch["x"] @ params["w"] + params["b"][None, :])
    per_row = jnp.mean((pred - batch["y"]) ** 2, axis=1)
    return jnp.sum(per_row * batch["mask"]), jnp.sum(batch["mask"])


def assert_close(actual, expected, rtol=2e-6, atol=1e-6) -> None:
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


@pytest.mark.parametrize("split", ["contiguous", "strided", "presplit"])
@pytest.mark.parametrize("num_microbatches", [1, 3, 4])
def test_mean_mode_is_the_scaled_full_batch_gradient(split, num_microbatches):
    params, batch = params0(), batch0()
    stage = jax.jit(gradient_stage(mean_loss, accumulation=Accumulation(num_microbatches, split=split)))
    given = split_microbatches(batch, num_microbatches) if split == "presplit" else batch
    result = stage(params, given, SCALE)
    loss, grads = jax.value_and_grad(mean_loss)(params, batch)
    assert isinstance(result, Gradients) and result.aux is None
    assert result.loss.dtype == jnp.float32 and all(g.dtype == jnp.float32 for g in jax.tree.leaves(result.grads))
    np.testing.assert_allclose(result.loss, loss, rtol=2e-6)  # unscaled
    assert_close(result.grads, jax.tree.map(lambda g: 1024.0 * g, grads), rtol=2e-5, atol=1e-4)  # scaled


def test_token_weighted_is_the_full_batch_sum_over_count_with_aux():
    params, batch = params0(), batch0()

    def with_aux(params, batch):
        return sum_and_count(params, batch), jnp.max(batch["x"])

    stage = jax.jit(gradient_stage(with_aux, accumulation=4, loss=LossContract(has_aux=True, token_weighted=True)))
    result = stage(params, batch, SCALE)
    ratio = lambda p: sum_and_count(p, batch)[0] / sum_and_count(p, batch)[1]
    loss, grads = jax.value_and_grad(ratio)(params)
    np.testing.assert_allclose(result.loss, loss, rtol=2e-6)
    assert_close(result.grads, jax.tree.map(lambda g: 1024.0 * g, grads), rtol=2e-5, atol=1e-4)
    loss_sums, counts, maxima = result.aux
    micro = split_microbatches(batch, 4)
    np.testing.assert_array_equal(counts, np.asarray(micro["mask"]).sum(axis=1))
    np.testing.assert_array_equal(maxima, np.asarray(micro["x"]).max(axis=(1, 2)))
    np.testing.assert_allclose(np.sum(loss_sums) / np.sum(counts), loss, rtol=2e-6)


def test_each_microbatch_gets_fold_in_of_the_key_and_its_index():
    def loss_fn(params, batch, key):
        return mean_loss(params, batch), jax.random.key_data(key)

    key = jax.random.key(7)
    stage = jax.jit(gradient_stage(loss_fn, accumulation=3, loss=LossContract(has_aux=True, uses_rng=True)))
    result = stage(params0(), batch0(), None, key)
    expected = np.stack([np.asarray(jax.random.key_data(jax.random.fold_in(key, j))) for j in range(3)])
    np.testing.assert_array_equal(result.aux, expected)
    with pytest.raises(ValueError, match="uses_rng=True: pass the step's PRNG key"):
        stage(params0(), batch0())


def test_the_loss_sees_compute_dtype_params_and_batch_and_the_layout_hook():
    seen = {}

    def loss_fn(params, batch):
        seen.update(w=params["w"].dtype, x=batch["x"].dtype)
        return mean_loss(params, batch)

    def layout(params_c, probe):
        seen["layout"] = params_c["w"].dtype
        assert probe(params_c) is None  # the loss traced on abstract values, nothing computed
        return params_c

    result = gradient_stage(loss_fn, precision="compute=bfloat16")(params0(), batch0(), params_layout=layout)
    assert seen == {"w": jnp.bfloat16, "x": jnp.bfloat16, "layout": jnp.bfloat16}
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(result.grads))  # the accumulator's dtype
    # a float32 batch against bf16 weights: the matmul runs in float32, and the warning says so
    with pytest.warns(PrecisionWarning, match=r"float32 x bfloat16: 1, 100.0% of their FLOPs"):
        gradient_stage(loss_fn, precision="compute=bfloat16", cast_batch=False)(params0(), batch0())
    assert seen["x"] == jnp.float32


@pytest.mark.parametrize(
    ("kwargs", "out", "error", "pattern"),
    [
        ({"has_aux": True}, lambda: jnp.float32(1.0), TypeError, r"has_aux=True: loss_fn must return \(loss, aux\)"),
        (
            {"token_weighted": True},
            lambda: jnp.float32(1.0),
            TypeError,
            r"token_weighted=True: loss_fn must return \(loss_sum, count\)",
        ),
        (
            {"token_weighted": True, "has_aux": True},
            lambda: (jnp.float32(1.0), 2),
            TypeError,
            r"has_aux=True and token_weighted=True: loss_fn must return \(\(loss_sum, count\), aux\)",
        ),
        ({}, lambda: jnp.ones(2), ValueError, r"loss_fn's loss must be a scalar, got shape \(2,\)"),
        ({}, lambda: jnp.int32(1), TypeError, "loss_fn's loss must be a real floating scalar, got dtype int32"),
    ],
)
def test_bad_loss_outputs_are_named(kwargs, out, error, pattern):
    stage = gradient_stage(lambda p, b: out(), loss=LossContract(**kwargs))
    with pytest.raises(error, match=pattern):
        stage(params0(), batch0())


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        gradient_stage("loss")
    with pytest.raises(TypeError, match="uses_rng must be a bool"):
        gradient_stage(mean_loss, loss=LossContract(uses_rng="yes"))
    with pytest.raises(TypeError, match="params_layout must be callable"):
        gradient_stage(mean_loss)(params0(), batch0(), params_layout=3)
    with pytest.raises(
        TypeError, match=r"gradient_stage\(params_layout=\) was removed in leanstep 0.12: give it to each call"
    ):
        gradient_stage(mean_loss, params_layout=lambda p, probe: p)
    for shards in (0, 1.5, True):
        with pytest.raises(ValueError, match="data_shards must be a positive int"):
            gradient_stage(mean_loss)(params0(), batch0(), data_shards=shards)
    with pytest.raises(ValueError, match="batch size 12 is not divisible by num_microbatches=5"):
        gradient_stage(mean_loss, accumulation=5)(params0(), batch0())


def test_data_shards_seeds_a_mean_loss_with_fp8_state_by_its_share_of_the_devices():
    """The sharding layer tells the stage how many devices reduce once per step (``data_shards=``, an
    argument, where 0.11 read a context variable): with FP8 state a mean loss's gradient is this
    device's share, 1 / (M * D) of the whole, exactly (a power of two); the FP8 state's new values
    record the cotangents of that share (the output gradient's amax a quarter of the whole's, the
    input's the same); without FP8 state nothing changes."""
    recipe = leanstep.Fp8Recipe(history=4)
    params = {**params0(), "fp8": leanstep.blocks.Fp8Meta.create(recipe)}

    def loss_fn(params, batch):
        pred = jnp.tanh(
            leanstep.blocks.fp8_matmul(batch["x"], params["w"], params["fp8"], recipe) + params["b"][None, :]
        )
        return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)

    stage = jax.jit(gradient_stage(loss_fn, accumulation=2), static_argnames="data_shards")
    one, four = (stage(params, batch0(), SCALE, data_shards=shards) for shards in (1, 4))
    for name in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(four.grads[name]) * 4, np.asarray(one.grads[name]))
    np.testing.assert_array_equal(
        np.asarray(four.grads["fp8"].input_history), np.asarray(one.grads["fp8"].input_history)
    )
    np.testing.assert_array_equal(
        np.asarray(four.grads["fp8"].grad_history) * 4, np.asarray(one.grads["fp8"].grad_history)
    )
    assert float(four.loss) == float(one.loss)  # the loss itself is the whole batch's
    plain = jax.jit(gradient_stage(mean_loss, accumulation=2), static_argnames="data_shards")
    assert_close(plain(params0(), batch0(), data_shards=4).grads, plain(params0(), batch0()).grads, rtol=0, atol=0)


def test_aux_comes_back_in_the_output_dtype():
    """``output=`` of the policy applies where leanstep sees the model's outputs: the aux."""

    def loss_fn(params, batch):
        pred = batch["x"] @ params["w"]
        return jnp.mean(pred.astype(jnp.float32) ** 2), pred

    for spec, dtype in (
        ("params=float32,compute=bfloat16,output=float32", jnp.float32),
        ("params=float32,compute=bfloat16,output=bfloat16", jnp.bfloat16),
    ):
        result = gradient_stage(loss_fn, precision=spec, accumulation=2, loss=LossContract(has_aux=True))(
            params0(), batch0()
        )
        assert result.aux.dtype == dtype and result.loss.dtype == jnp.float32  # the loss stays float32


def test_unrolled_microbatches_give_the_scanned_gradient():
    params, batch = params0(), batch0()
    scanned = jax.jit(gradient_stage(mean_loss, accumulation=4))(params, batch, SCALE)
    unrolled = gradient_stage(mean_loss, accumulation=Accumulation(4, unroll=True))
    jaxpr = jax.make_jaxpr(unrolled)(params, batch, SCALE)
    (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert scan.params["unroll"] == 4  # lax.scan(unroll=True) unrolls every step
    assert_close(jax.jit(unrolled)(params, batch, SCALE), scanned, rtol=1e-6, atol=1e-5)
