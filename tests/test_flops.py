"""Tests for leanstep.inspection.flops: FLOP counts against XLA's own, loops counted times their trip counts."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from hypothesis import given, settings
from hypothesis import strategies as st

from leanstep.inspection.flops import count_flops


def _xla_flops(fn, *args):
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


# --- FLOPs --------------------------------------------------------------------------------------


# Sizes >= 2: XLA rewrites a dot with a size-1 dimension as a multiply (1 FLOP an element).
@settings(max_examples=25, deadline=None)
@given(st.integers(2, 5), st.integers(2, 5), st.integers(2, 5), st.integers(2, 5))
def test_matmul_flops_equal_xla_on_a_loop_free_program(m, k, n, p):
    def f(a, b, c):
        return (a @ b) @ c

    args = (jnp.ones((m, k)), jnp.ones((k, n)), jnp.ones((n, p)))
    assert count_flops(jax.make_jaxpr(f)(*args)) == _xla_flops(f, *args) == 2 * m * n * (k + p)


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 5), st.integers(2, 4), st.integers(2, 6))
def test_a_scan_counts_its_body_times_its_length_as_xla_does_unrolled(length, rows, width):
    def f(w, x, unroll):
        return jax.lax.scan(lambda h, wi: (h @ wi, None), x, w, unroll=unroll)[0]

    w, x = jnp.ones((length, width, width)), jnp.ones((rows, width))
    rolled = jax.make_jaxpr(functools.partial(f, unroll=1))(w, x)
    # XLA's reference: the fully unrolled program, which has no loop for XLA to count once.
    assert count_flops(rolled) == _xla_flops(functools.partial(f, unroll=True), w, x) == 2 * length * rows * width**2


def test_cond_counts_its_dearest_branch_and_while_its_body_once():
    def f(x):
        y = jax.lax.cond(x[0, 0] > 0, lambda: x @ x, lambda: x)
        return jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] @ c[1]), (0, y))[1]

    x = jnp.ones((3, 3))
    # gt 1 + cond branch 54 + while: cond `lt` 1 + body (add 1 + matmul 54)
    assert count_flops(jax.make_jaxpr(f)(x)) == 1 + 54 + 1 + 1 + 54
