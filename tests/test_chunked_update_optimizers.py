"""The chunked update against the whole-tree one on what users bring (issue 57, item 2): noise,
``multi_transform``, schedule-free, odd shapes, a bfloat16 parameter.

0.12 split a leaf of ``optax.add_noise`` (``noisy_sgd``) by rows, and each slice drew noise for
its own shape: every parameter of a stack differed after 3 steps. The update's dependence now
counts a value made from its position (random bits, an iota) as mixing rows, so such a leaf is
updated whole, and the noise is the whole tree's bit for bit.

Elsewhere the two programs compute each entry with the same operations, and XLA compiles them
apart: a division by a scalar (Adam's bias correction) is rewritten into a product with its
reciprocal in one and not the other, and (XLA's default flags) LLVM contracts other products and
sums into fused multiply-adds. The reference is the unchunked program's step; the bound is 4 units
in the last place of each entry's update plus one of the parameter's own (the rounding of the update
and of its sum; ``python benchmarks/chunked_rounding.py`` measures at most 1.42), and 4 units in
the last place of each entry of the optimizer state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from leanstep.step.update.chunks import chunk_plan

STACK = {"w": (4, 32, 16), "b": (4, 16), "e": (64, 8)}
MIXED = {"a": (16, 8), "b": (8,), "c": (4, 16, 4), "d": (3, 4)}
EPS = float(np.finfo(np.float32).eps)


def _params(shapes: dict, dtypes: dict | None = None) -> dict:
    rng = np.random.default_rng(0)
    dtypes = dtypes or {}
    return {k: jnp.asarray(rng.normal(size=s), dtypes.get(k, jnp.float32)) for k, s in shapes.items()}


def _loss(params, batch):
    return sum(jnp.sum(jnp.tanh(p.astype(jnp.float32) * batch["s"][0]) ** 2) for p in jax.tree.leaves(params))


def _run(tx, params, update_chunk, steps):
    state = leanstep.TrainState.create(params, tx)
    step = leanstep.make_train_step(_loss, update_chunk=update_chunk, max_grad_norm=1.0)
    for i in range(steps):
        state, _ = step(state, {"s": jnp.asarray([1.0 + 0.1 * i])})
    return state


def _leaves(tree) -> list[np.ndarray]:
    key = lambda x: jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    return [np.asarray(jax.random.key_data(x) if key(x) else x) for x in jax.tree.leaves(tree)]


NOISE = {
    "noisy_sgd": lambda: optax.noisy_sgd(0.1, eta=0.1, key=0),
    "add_noise": lambda: optax.chain(optax.add_noise(0.1, 0.55, key=0), optax.sgd(0.1)),
}


@pytest.mark.parametrize("name", list(NOISE))
def test_noise_is_drawn_for_whole_leaves_and_the_chunked_update_is_the_whole_one_bit_for_bit(name):
    params = _params(STACK)
    whole, chunked = _run(NOISE[name](), params, None, 3), _run(NOISE[name](), params, 64, 3)
    for a, b in zip(
        _leaves((whole.params, whole.opt_state)), _leaves((chunked.params, chunked.opt_state)), strict=True
    ):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", list(NOISE))
def test_a_noise_transformations_leaves_are_not_split_by_rows_and_adams_are(name):
    params = _params(STACK)
    state = leanstep.TrainState.create(params, NOISE[name]())
    plan, why = chunk_plan(state.optimizer, state.opt_state, params, 64)
    assert why is None and plan is not None
    assert all(unit.start is None for chunk in plan.chunks for unit in chunk)
    state = leanstep.TrainState.create(params, optax.adam(1e-2))  # the control: the same stack is split
    plan, _ = chunk_plan(state.optimizer, state.opt_state, params, 64)
    assert any(unit.start is not None for chunk in plan.chunks for unit in chunk)


CASES = {
    "multi_transform adam, sgd momentum": (
        lambda: optax.multi_transform(
            {"a": optax.adam(1e-2), "s": optax.sgd(1e-2, momentum=0.9)}, {"a": "a", "b": "s", "c": "a", "d": "s"}
        ),
        MIXED,
        64,
        None,
    ),
    "multi_transform two adams, a stack": (
        lambda: optax.multi_transform({"a": optax.adam(1e-2), "s": optax.adam(1e-3)}, {"w": "a", "b": "s", "e": "a"}),
        STACK,
        64,
        None,
    ),
    "schedule_free_adamw": (lambda: optax.contrib.schedule_free_adamw(1e-2), STACK, 64, None),
    "schedule_free_sgd": (lambda: optax.contrib.schedule_free_sgd(1e-2), STACK, 64, None),
    "adam, (1, 16, 4) beside (3, 4)": (lambda: optax.adam(1e-2), {"x": (1, 16, 4), "y": (3, 4)}, 8, None),
    "adam, a stack of one layer": (lambda: optax.adam(1e-2), {"w": (1, 32, 16), "b": (1, 16), "e": (64, 8)}, 300, None),
    "adam, 40 two-entry leaves": (lambda: optax.adam(1e-2), {f"l{i:02d}": (2,) for i in range(40)}, 3, None),
    "adam, a stack": (lambda: optax.adam(1e-2), STACK, 64, None),
    "adamw, a bfloat16 leaf": (lambda: optax.adamw(1e-2, weight_decay=0.1), STACK, 64, {"b": jnp.bfloat16}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_one_chunked_step_is_the_whole_ones_to_a_few_units_in_the_last_place(name):
    make, shapes, chunk, dtypes = CASES[name]
    params = _params(shapes, dtypes)
    whole, chunked = _run(make(), params, None, 1), _run(make(), params, chunk, 1)
    for key, before in params.items():
        a = np.asarray(whole.params[key], np.float64)
        b = np.asarray(chunked.params[key], np.float64)
        eps = float(jnp.finfo(before.dtype).eps)
        change = np.abs(a - np.asarray(before, np.float64))  # the whole step's update of each entry
        np.testing.assert_array_less(np.abs(a - b), 4 * eps * change + eps * np.abs(a) + 1e-30, err_msg=key)
    for a, b in zip(_leaves(whole.opt_state), _leaves(chunked.opt_state), strict=True):
        if np.issubdtype(a.dtype, np.floating):
            np.testing.assert_allclose(b, a, rtol=4 * EPS, atol=0)
        else:
            assert a.tobytes() == b.tobytes()


def test_the_rounding_benchmark_measures_a_case():
    """``benchmarks/chunked_rounding.py`` (the docs' table) runs, and finds the noise bit for bit."""
    from benchmarks import chunked_rounding

    (row,) = chunked_rounding.main(["--cases", "noisy_sgd"])
    assert row["differ"] == 0 and row["state_differ"] == 0 and row["entries"] == 2624
