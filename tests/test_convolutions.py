"""Convolutions counted where matmuls are (issue 27, item 3): FLOPs by hand, the audit, the planner's
ranking, and the compute-dtype check that says which matmuls and convolutions leave bf16."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from leanstep.blocks.compute_dtype_check import unused_compute_dtype
from leanstep.inspection.flops import count_flops

DN = ("NHWC", "HWIO", "NHWC")


def conv(x, k, stride=1, groups=1):
    return jax.lax.conv_general_dilated(
        x, k, (stride, stride), "SAME", dimension_numbers=DN, feature_group_count=groups
    )


@pytest.mark.parametrize(
    ("x", "k", "stride", "groups", "hand"),
    [
        # 2 * (N*H*W*O) * (kh*kw*C/groups): each output element sums the kernel window over its input features.
        ((1, 8, 8, 3), (3, 3, 3, 16), 1, 1, 2 * (8 * 8 * 16) * (3 * 3 * 3)),
        ((2, 8, 8, 4), (3, 3, 4, 6), 2, 1, 2 * (2 * 4 * 4 * 6) * (3 * 3 * 4)),
        ((1, 6, 6, 8), (1, 1, 8, 5), 1, 1, 2 * (6 * 6 * 5) * 8),
        ((1, 6, 6, 8), (3, 3, 2, 8), 1, 4, 2 * (6 * 6 * 8) * (3 * 3 * 2)),  # grouped: 2 input features each
    ],
)
def test_a_convolution_counts_its_window_times_its_input_features(x, k, stride, groups, hand):
    args = (jnp.ones(x), jnp.ones(k))
    jaxpr = jax.make_jaxpr(lambda a, b: conv(a, b, stride, groups))(*args)
    assert count_flops(jaxpr) == count_flops(jaxpr, dots_only=True) == hand


def test_the_backward_convolutions_cost_what_the_forward_does():
    """Stride 1, SAME: the input gradient and the weight gradient each do the forward's multiply-adds."""
    x, k = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 16))
    forward = 2 * (2 * 8 * 8 * 16) * 27
    grad = jax.make_jaxpr(jax.grad(lambda a, b: jnp.sum(conv(a, b)), argnums=(0, 1)))(x, k)
    assert count_flops(grad, dots_only=True) == 3 * forward


def test_a_conv_net_s_flops_are_its_convolutions_and_the_audit_lists_them():
    x, k1, k2, w = jnp.ones((4, 8, 8, 3)), jnp.ones((3, 3, 3, 8)), jnp.ones((3, 3, 8, 8)), jnp.ones((8, 10))

    def loss(params, batch):
        h = jax.nn.relu(conv(batch, params["k1"]))
        h = jax.nn.relu(conv(h, params["k2"]))
        return jnp.mean(jnp.mean(h, axis=(1, 2)) @ params["w"])

    params = {"k1": k1, "k2": k2, "w": w}
    convs = 2 * (4 * 8 * 8 * 8) * 27 + 2 * (4 * 8 * 8 * 8) * 72
    head = 2 * 4 * 8 * 10
    assert count_flops(jax.make_jaxpr(loss)(params, x), dots_only=True) == convs + head
    state = leanstep.TrainState.create(params, optax.sgd(0.1))
    report = leanstep.inspection.audit(leanstep.make_train_step(loss, num_microbatches=2), state, x)
    kinds = [m.kind for m in report.matmuls]
    assert kinds.count("conv_general_dilated") >= 2 * 3 - 1  # forward, weight and input gradients (not of x)
    share = sum(m.flops for m in report.matmuls if m.kind == "conv_general_dilated") / sum(
        m.flops for m in report.matmuls
    )
    assert share > 0.95, share
    assert "of them convolutions" in str(report)


def test_the_dtype_check_names_the_float32_share_when_only_some_leave_bf16():
    """Two convolutions in bf16, then a float32 head (a model state or an astype promotes it): said once, with its share."""
    x = jnp.ones((4, 8, 8, 3), jnp.bfloat16)
    k1, k2, w = (
        jnp.ones((3, 3, 3, 8), jnp.bfloat16),
        jnp.ones((3, 3, 8, 8), jnp.bfloat16),
        jnp.ones((8, 10), jnp.bfloat16),
    )

    def model(k1, k2, w, x):
        h = conv(conv(x, k1), k2)
        return jnp.sum(jnp.mean(h, axis=(1, 2)).astype(jnp.float32) @ w.astype(jnp.float32))

    message = unused_compute_dtype(model, (k1, k2, w, x), jnp.bfloat16)
    assert message is not None and "1 of the loss's 3 matmuls and convolutions do not run in it" in message
    head = 2 * 4 * 8 * 10 / (2 * (4 * 8 * 8 * 8) * 27 + 2 * (4 * 8 * 8 * 8) * 72 + 2 * 4 * 8 * 10)
    assert f"float32 x float32: 1, {100 * head:.1f}% of their FLOPs" in message
    assert (
        unused_compute_dtype(lambda k1, k2, w, x: jnp.sum(conv(conv(x, k1), k2)), (k1, k2, w, x), jnp.bfloat16) is None
    )


def test_the_step_warns_once_for_a_partly_float32_model():
    params = {"k": jnp.ones((3, 3, 3, 8)) * 0.1, "w": jnp.ones((8, 2)) * 0.1}

    def loss(p, batch):
        h = conv(batch["x"], p["k"])
        return jnp.mean((jnp.mean(h, axis=(1, 2)).astype(jnp.float32) @ p["w"].astype(jnp.float32)) ** 2)

    step = leanstep.make_train_step(loss, precision="compute=bfloat16", num_microbatches=2)
    batch = {"x": jnp.ones((4, 8, 8, 3))}
    state = leanstep.TrainState.create(params, optax.sgd(0.1))
    with pytest.warns(
        leanstep.blocks.PrecisionWarning, match="1 of the loss's 2 matmuls and convolutions do not run in it"
    ):
        state, _ = step(state, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, metrics = step(state, batch)  # once: not again at the next call
    assert np.isfinite(float(metrics.loss))
