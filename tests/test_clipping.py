"""Tests for leanstep.blocks.clipping against float64 NumPy references."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.chip import on_tpu
from leanstep.blocks.clipping import (
    clip_by_global_norm,
    clip_by_global_norm_transform,
    global_norm,
)

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)

# Shared so that the examples compile once per tree structure, with max_norm traced.
jit_clip = jax.jit(clip_by_global_norm)


def reference_norm(tree: object) -> float:
    """The global norm in float64 NumPy, from the leaves' exact values."""
    leaves = [np.asarray(leaf, np.float64) for leaf in jax.tree.leaves(tree)]
    return math.sqrt(sum(float(np.sum(leaf * leaf)) for leaf in leaves))


def finfo(dtype: object) -> ml_dtypes.finfo:
    return ml_dtypes.finfo(np.dtype(dtype))


# --- random trees: nested dicts/lists, leaves of 0-3 dims (some empty), mixed dtypes --------

leaf_specs = st.tuples(
    st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple),
    st.sampled_from(DTYPES),
    st.sampled_from([1e-2, 1.0, 1e2]),
)
tree_specs = st.recursive(
    leaf_specs,
    lambda children: st.one_of(
        st.lists(children, min_size=1, max_size=3),
        st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3),
    ),
    max_leaves=6,
)


def build_tree(spec: object, rng: np.random.Generator) -> object:
    if isinstance(spec, tuple):
        shape, dtype, scale = spec
        return jnp.asarray(rng.standard_normal(shape) * scale, dtype)
    if isinstance(spec, list):
        return [build_tree(child, rng) for child in spec]
    return {key: build_tree(child, rng) for key, child in spec.items()}


@settings(max_examples=15, deadline=None)  # each tree shape compiles
@given(spec=tree_specs, seed=st.integers(0, 2**31 - 1))
def test_global_norm_matches_float64_reference(spec: object, seed: int) -> None:
    tree = build_tree(spec, np.random.default_rng(seed))
    norm = global_norm(tree)
    assert norm.dtype == jnp.float32 and norm.shape == ()
    np.testing.assert_allclose(float(norm), reference_norm(tree), rtol=2e-6, atol=1e-30)


def test_bfloat16_norm_is_exact_where_optax_rounds() -> None:
    tree = {"w": jnp.full((9000,), 100.0, jnp.bfloat16)}
    expected = 100.0 * math.sqrt(9000)  # 9486.833
    np.testing.assert_allclose(float(global_norm(tree)), expected, rtol=1e-6)
    # The case discriminates: a norm in the leaves' dtype is off by ~15.
    assert abs(float(optax.tree.norm(tree)) - expected) > 10


def test_float16_norm_does_not_overflow() -> None:
    # 300**2 = 90000 already exceeds float16's maximum of 65504.
    tree = [jnp.full((1000,), 300.0, jnp.float16), {"b": jnp.full((2, 3), -250.0, jnp.float16)}]
    expected = math.sqrt(1000 * 300.0**2 + 6 * 250.0**2)
    np.testing.assert_allclose(float(global_norm(tree)), expected, rtol=1e-6)
    assert math.isinf(float(optax.tree.norm(tree)))
    clipped, norm = clip_by_global_norm(tree, 1.0)
    np.testing.assert_allclose(float(norm), expected, rtol=1e-6)
    np.testing.assert_allclose(reference_norm(clipped), 1.0, rtol=finfo(jnp.float16).eps)


@pytest.mark.parametrize(
    "tree", [{}, [], None, {"a": []}, [jnp.zeros((0,)), {"b": jnp.zeros((3, 0, 2), jnp.bfloat16)}]]
)
def test_empty_tree_has_norm_zero(tree: object) -> None:
    norm = global_norm(tree)
    assert norm.dtype == jnp.float32 and float(norm) == 0.0
    clipped, clip_norm = clip_by_global_norm(tree, 1.0)
    assert jax.tree.structure(clipped) == jax.tree.structure(tree)
    assert float(clip_norm) == 0.0


def test_float64_leaves_are_summed_in_float64() -> None:
    if on_tpu():
        pytest.skip("XLA:TPU has no float64 arithmetic (a norm of 1e30 leaves is nan there)")
    with jax.enable_x64(True):
        # Squares of 1e30 overflow float32 but not float64; the norm itself fits float32.
        tree = {"a": jnp.array([1e30, -1e30], jnp.float64), "b": jnp.array(1.0, jnp.float64)}
        norm = global_norm(tree)
        assert norm.dtype == jnp.float32
        np.testing.assert_allclose(float(norm), math.sqrt(2) * 1e30, rtol=1e-7)
        clipped, _ = clip_by_global_norm(tree, 2.0)
        assert clipped["a"].dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(clipped["a"]), [math.sqrt(2), -math.sqrt(2)], rtol=1e-14)


SEED_EXAMPLES = [
    (
        {"w": [3.0, 0.0], "b": 4.0},
        1.0,
        {"b": 0.8, "w": [0.6, 0.0]},
        5.0,
    ),
    (
        {"dense": {"w": [[0.1, -0.2], [0.2, 0.0]], "b": [0.4, 0.0]}, "head": [-0.4]},
        2.0,
        {"dense": {"b": [0.4, 0.0], "w": [[0.1, -0.2], [0.2, 0.0]]}, "head": [-0.4]},
        0.640312,
    ),
    (
        {"layers": [{"w": [0.6, 0.6]}, {"w": [0.6, 0.6]}, {"w": [0.6, 0.6]}]},
        1.0,
        {"layers": [{"w": [0.408248, 0.408248]}] * 3},
        1.469694,
    ),
]


def to_tree(value: object) -> object:
    """Read the seed's JSON as its Run panel does: lists of objects are list nodes."""
    if isinstance(value, dict):
        return {key: to_tree(child) for key, child in value.items()}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [to_tree(child) for child in value]
    return jnp.asarray(value, jnp.float32)


@pytest.mark.parametrize(("grads", "max_norm", "clipped", "norm"), SEED_EXAMPLES)
def test_seed_examples_under_jit_with_traced_max_norm(
    grads: object, max_norm: float, clipped: object, norm: float
) -> None:
    tree = to_tree(grads)
    got, got_norm = jit_clip(tree, max_norm)
    assert got_norm.dtype == jnp.float32 and got_norm.shape == ()
    np.testing.assert_allclose(float(got_norm), norm, rtol=0, atol=1e-6)
    expected = to_tree(clipped)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for leaf, want, original in zip(
        jax.tree.leaves(got), jax.tree.leaves(expected), jax.tree.leaves(tree), strict=True
    ):
        assert leaf.dtype == original.dtype and leaf.shape == original.shape
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(want), rtol=0, atol=1e-6)


def naive_norm(tree: object) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(tree)))


def test_gradients_at_zero_are_finite() -> None:
    zeros = {"w": jnp.zeros((2, 3)), "b": jnp.zeros((), jnp.bfloat16)}
    # The case discriminates: a plain sqrt has a NaN gradient here.
    assert np.isnan(np.asarray(jax.grad(naive_norm)({"w": jnp.zeros(3)})["w"])).all()

    grad = jax.grad(global_norm)(zeros)
    for leaf in jax.tree.leaves(grad):
        np.testing.assert_array_equal(np.asarray(leaf, np.float32), 0.0)

    # d clipped / d grads at 0 is the identity (s = 1), and d / d max_norm is 0.
    jacobian = jax.jacobian(lambda g: jit_clip(g, 1.0)[0])(jnp.zeros(3))
    np.testing.assert_array_equal(np.asarray(jacobian), np.eye(3))
    d_max_norm = jax.grad(lambda c: jnp.sum(jit_clip(jnp.zeros(3), c)[0]))(1.0)
    assert float(d_max_norm) == 0.0


def test_all_zero_grads_come_back_unchanged() -> None:
    zeros = {"w": jnp.zeros((2, 2), jnp.bfloat16), "b": [jnp.zeros(3), jnp.zeros((), jnp.float16)]}
    clipped, norm = jit_clip(zeros, 0.5)
    assert float(norm) == 0.0
    for leaf, original in zip(jax.tree.leaves(clipped), jax.tree.leaves(zeros), strict=True):
        assert leaf.dtype == original.dtype
        np.testing.assert_array_equal(np.asarray(leaf, np.float32), 0.0)


def test_nan_makes_norm_and_every_leaf_nan() -> None:
    tree = {"bad": jnp.array([1.0, jnp.nan]), "good": jnp.ones(2, jnp.bfloat16)}
    clipped, norm = jit_clip(tree, 1.0)
    assert math.isnan(float(norm)) and math.isnan(float(global_norm(tree)))
    for leaf in jax.tree.leaves(clipped):
        assert np.isnan(np.asarray(leaf, np.float32)).all()


def test_inf_gives_infinite_norm() -> None:
    clipped, norm = jit_clip({"a": jnp.array([jnp.inf, 1.0]), "b": jnp.ones(2)}, 1.0)
    assert math.isinf(float(norm))
    # s = c / inf = 0: finite entries become 0, infinite ones 0 * inf = NaN.
    np.testing.assert_array_equal(np.asarray(clipped["b"]), [0.0, 0.0])
    assert np.isnan(np.asarray(clipped["a"])[0]) and float(clipped["a"][1]) == 0.0


@settings(max_examples=30, deadline=None)
@given(
    spec=tree_specs,
    seed=st.integers(0, 2**31 - 1),
    max_norm=st.floats(1e-2, 1e3, allow_nan=False, allow_infinity=False),
)
def test_clipping_properties(spec: object, seed: int, max_norm: float) -> None:
    tree = build_tree(spec, np.random.default_rng(seed))
    clipped, norm = clip_by_global_norm(tree, max_norm)
    true_norm = reference_norm(tree)
    np.testing.assert_allclose(float(norm), true_norm, rtol=2e-6, atol=1e-30)
    assert jax.tree.structure(clipped) == jax.tree.structure(tree)

    leaves, originals = jax.tree.leaves(clipped), jax.tree.leaves(tree)
    eps = max((finfo(leaf.dtype).eps for leaf in originals), default=0.0)
    scale = 1.0 if float(norm) <= max_norm else max_norm / true_norm
    np.testing.assert_allclose(reference_norm(clipped), min(true_norm, max_norm), rtol=eps + 1e-6, atol=1e-30)
    for leaf, original in zip(leaves, originals, strict=True):
        assert leaf.dtype == original.dtype and leaf.shape == original.shape
        if scale == 1.0:
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(original))
        # Same direction: each entry is s * g up to rounding into the leaf's dtype.
        info = finfo(leaf.dtype)
        np.testing.assert_allclose(
            np.asarray(leaf, np.float64),
            scale * np.asarray(original, np.float64),
            rtol=float(info.eps) + 2e-6,
            atol=float(info.smallest_subnormal),
        )


def test_transform_in_chain_matches_manual_clipping() -> None:
    grads = {"w": jnp.array([[3.0, -1.0], [2.0, 0.5]]), "b": jnp.array([4.0, 0.0], jnp.bfloat16)}
    params = jax.tree.map(jnp.ones_like, grads)
    optimizer = optax.chain(clip_by_global_norm_transform(2.0), optax.sgd(0.1))
    state = optimizer.init(params)
    assert isinstance(state[0], optax.EmptyState)
    updates, new_state = jax.jit(optimizer.update)(grads, state, params)

    manual, _ = clip_by_global_norm(grads, 2.0)
    expected = jax.tree.map(lambda g: -0.1 * g, manual)
    for got, want in zip(jax.tree.leaves(updates), jax.tree.leaves(expected), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # The clip really happened: the update's norm is lr * max_norm, not lr * |g|.
    np.testing.assert_allclose(reference_norm(updates), 0.1 * 2.0, rtol=finfo(jnp.bfloat16).eps)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)


BAD_MAX_NORMS = [0, 0.0, -1.0, -3, math.nan, math.inf, -math.inf, np.float32(np.nan), jnp.array(0.0)]


@pytest.mark.parametrize("max_norm", BAD_MAX_NORMS)
def test_bad_max_norm_raises_value_error(max_norm: object) -> None:
    with pytest.raises(ValueError, match="max_norm"):
        clip_by_global_norm({"w": jnp.ones(2)}, max_norm)
    with pytest.raises(ValueError, match="max_norm"):
        clip_by_global_norm_transform(max_norm)


@pytest.mark.parametrize("max_norm", [True, "1.0", None, 1j])
def test_non_number_max_norm_raises_type_error(max_norm: object) -> None:
    with pytest.raises(TypeError, match="max_norm"):
        clip_by_global_norm({"w": jnp.ones(2)}, max_norm)


def test_non_scalar_max_norm_raises_even_when_traced() -> None:
    with pytest.raises(ValueError, match="max_norm"):
        clip_by_global_norm({"w": jnp.ones(2)}, np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="max_norm"):
        jax.jit(clip_by_global_norm)({"w": jnp.ones(2)}, jnp.array([1.0, 2.0]))


def test_traced_max_norm_is_not_validated() -> None:
    # A traced value cannot be raised on; c <= 0 simply scales everything to <= 0 norm.
    clipped, norm = jit_clip({"w": jnp.array([3.0, 4.0])}, 0.0)
    assert float(norm) == 5.0
    np.testing.assert_array_equal(np.asarray(clipped["w"]), [0.0, 0.0])


def test_non_float_leaf_raises_type_error_naming_path() -> None:
    with pytest.raises(TypeError, match=r"tree\['layer'\]\[1\] has dtype int32"):
        global_norm({"layer": [jnp.ones(2), jnp.arange(3)]})


@pytest.mark.parametrize("max_norm", [2, 2.0, np.float32(2.0), np.int64(2), jnp.bfloat16(2.0), jnp.array(2.0)])
def test_concrete_max_norm_of_any_real_type_is_accepted(max_norm: object) -> None:
    clipped, _ = clip_by_global_norm({"w": jnp.array([3.0, 4.0])}, max_norm)
    np.testing.assert_allclose(np.asarray(clipped["w"]), [1.2, 1.6], rtol=1e-6)
