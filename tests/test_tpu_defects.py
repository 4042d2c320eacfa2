"""Issue 41, items 10, 11, 19 and 20: the precision warning's count, FP8 state on a mesh, the budget's
evaluation cost (the TPU items' mechanisms, checked on the CPU)."""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from leanstep import audit
from leanstep.blocks.compute_dtype_check import unused_compute_dtype
from leanstep.training.budget import calibrate, plan_steps


class _State(NamedTuple):
    params: jax.Array


def _step(state, batch):
    return _State(state.params + 1), {"loss": jnp.float32(batch)}


def test_a_slow_first_evaluation_is_not_the_planned_evaluation_cost():
    # On a TPU v5e the first evaluation call took 1.73 s (it compiled) and the plan reserved that
    # for each of 30 evaluations: a 60 s budget trained for 28 s. Here the first call sleeps 0.5 s.
    first_call_s, calls = 0.5, []

    def evaluate(params):
        if not calls:
            time.sleep(first_call_s)
        calls.append(params)
        return jnp.float32(0.0)

    # The trainer's call: its evaluation was compiled ahead (on a thread), so one evaluation is timed.
    timing = calibrate(_step, _State(jnp.int32(0)), lambda i: i, evaluate, timed_steps=2, evaluations=1)
    assert timing["eval_s"] < first_call_s / 10
    assert timing["eval_first_s"] >= first_call_s  # recorded apart
    # What that is worth in a 60 s budget with 30 evaluations and 10 ms steps: the first call
    # taken as the cost would leave (60 - 30 * 0.5 - ...) / 0.01 steps, 1,500 fewer.
    planned = plan_steps(60.0, 5.0, 0.01, timing["eval_s"], 100, 0.5, 1000, 2.0)
    reference = plan_steps(60.0, 5.0, 0.01, 0.0, 100, 0.5, 1000, 2.0)
    assert planned >= 0.98 * reference


# --- item 10: a mixed bf16 x float32 matmul runs in float32 ------------------------------------------


def test_the_precision_warning_counts_a_mixed_matmul_as_the_audit_does():
    # The Equinox example: a bf16 activation times a float32 weight. jnp.matmul hands both to one
    # dot_general that computes in float32; the warning said "1 of 7 ... 0.0% of FLOPs" were off.
    x = jnp.ones((4, 8), jnp.bfloat16)
    w_mixed = jnp.ones((8, 16), jnp.float32)  # 4 * 8 * 16 * 2 = 1,024 FLOPs in float32
    w_bf16 = jnp.ones((16, 2), jnp.bfloat16)  # 4 * 16 * 2 * 2 = 256 FLOPs in bf16

    def loss(x, w_mixed, w_bf16):
        return jnp.sum((x @ w_mixed).astype(jnp.bfloat16) @ w_bf16)

    # The independent reference: the audit's record of each matmul's operand dtypes.
    matmuls = audit(loss, x, w_mixed, w_bf16).matmuls
    off = [m for m in matmuls if m.lhs[1] != "bfloat16" or m.rhs[1] != "bfloat16"]
    assert [(m.lhs[1], m.rhs[1]) for m in off] == [("bfloat16", "float32")]
    share = 100 * sum(m.flops for m in off) / sum(m.flops for m in matmuls)
    assert share == 100 * 1024 / (1024 + 256)
    message = unused_compute_dtype(loss, (x, w_mixed, w_bf16), jnp.bfloat16)
    assert message is not None
    assert (
        f"1 of the loss's 2 matmuls and convolutions do not run in it (bfloat16 x float32: 1, {share:.1f}%" in message
    )
