"""Tests for leanstep.blocks.rematerialization: the policy names, that remat recomputes, and that it is exact."""

import functools

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.residual_blocks import (
    ALL_POLICIES,
    LAYERS,
    PARAMS,
    STACKED,
    B,
    D,
    H,
    X,
    block,
    loop_stack,
    scan_stack,
)
from leanstep.blocks.rematerialization import (
    REMAT_POLICIES,
    checkpoint_name,
    get_remat_policy,
    remat,
)

REMAT_PRIMITIVES = {"remat2", "remat", "checkpoint"}
Y = jax.random.normal(jax.random.key(3), (B, D))


def mse(out, y):
    return jnp.mean((out - y) ** 2)


@functools.cache  # one compile per policy, however many examples
def block_value_and_grad(policy):
    layer = block if policy is None else remat(block, policy)
    return jax.jit(jax.value_and_grad(lambda p, x, y: mse(layer(p, x), y)))


@functools.cache
def scan_value_and_grad(policy, prevent_cse=False):
    layer = block if policy is None else remat(block, policy, prevent_cse=prevent_cse)
    return jax.jit(jax.value_and_grad(lambda p, x, y: mse(scan_stack(layer)(p, x), y)))


def assert_ulp_close(actual, expected, ulps=8):
    """Equal up to a few float32 ulps of each array's scale (entries near 0 get that scale)."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = max(float(np.max(np.abs(e))), np.finfo(np.float32).tiny)
        np.testing.assert_allclose(a, e, rtol=0, atol=ulps * np.finfo(np.float32).eps * scale)


# --------------------------------------------------------------------------- policies


def test_policy_names_resolve_to_the_jax_policies():
    cp = jax.checkpoint_policies
    assert REMAT_POLICIES == ("none", "full", "dots", "dots_no_batch")
    assert get_remat_policy("none") is None
    assert get_remat_policy("full") is cp.nothing_saveable
    assert get_remat_policy("dots") is cp.dots_saveable
    assert get_remat_policy("dots_no_batch") is cp.dots_with_no_batch_dims_saveable
    assert get_remat_policy("save:a, b") == cp.save_only_these_names("a", "b")
    assert get_remat_policy("save:a") != cp.save_only_these_names("a", "b")
    custom = lambda prim, *_, **__: False
    assert get_remat_policy(custom) is custom


def test_checkpoint_name_is_jax_checkpoint_name():
    assert checkpoint_name is jax.ad_checkpoint.checkpoint_name


@pytest.mark.parametrize("bad", ["dot", "", "FULL", "nothing_saveable", "save", " full"])
def test_unknown_policy_name_raises_value_error(bad):
    with pytest.raises(ValueError, match=r"policy=") as err:
        get_remat_policy(bad)
    message = str(err.value)
    assert repr(bad) in message
    for name in (*REMAT_POLICIES, "save:NAME1,NAME2"):
        assert repr(name) in message
    with pytest.raises(ValueError, match=r"policy="):
        remat(block, bad)


@pytest.mark.parametrize("bad", ["save:", "save: ", "save:a,,b", "save:a,"])
def test_save_without_names_raises_value_error(bad):
    with pytest.raises(ValueError, match=r"policy=.*empty checkpoint_name") as err:
        get_remat_policy(bad)
    assert repr(bad) in str(err.value)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (None, "policy must be"),
        (3, "policy must be"),
        (jax.checkpoint_policies.save_only_these_names, "policy=.* is a policy factory"),
    ],
    ids=["None", "int", "factory"],
)
def test_non_policy_raises_type_error(bad, message):
    with pytest.raises(TypeError, match=message):
        get_remat_policy(bad)
    with pytest.raises(TypeError, match=message):
        remat(block, bad)


def test_remat_validates_its_other_arguments():
    with pytest.raises(TypeError, match=r"prevent_cse"):
        remat(block, "full", prevent_cse="yes")
    with pytest.raises(TypeError, match=r"static_argnums"):
        remat(block, "full", static_argnums="0")
    with pytest.raises(TypeError, match=r"fn must be callable"):
        remat("block", "full")


def test_none_returns_fn_unchanged_and_others_wrap():
    assert remat(block, "none") is block
    assert remat(block, "dots") is not block
    assert remat(block, "dots").__wrapped__ is block


def test_remat_as_decorator_and_static_argnums():
    @functools.partial(remat, policy="full", static_argnums=(2,))
    def powered(w, x, n):
        for _ in range(n):  # Python loop on n needs n static
            x = jnp.tanh(x @ w)
        return jnp.sum(x)

    w = PARAMS["w1"][:, :2]
    expected = jax.grad(lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w)))(w, X)
    assert_ulp_close(jax.jit(jax.grad(powered), static_argnums=2)(w, X, 2), expected)


# ---------------------------------------------------------------- recomputation


def count_primitive(jaxpr, name):
    """Number of `name` equations in a jaxpr, sub-jaxprs included."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        for sub in sub_jaxprs(eqn):
            total += count_primitive(sub, name)
    return total


def sub_jaxprs(eqn):
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, jex.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jex.Jaxpr):
                yield v


def remat_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in REMAT_PRIMITIVES:
            yield eqn
        for sub in sub_jaxprs(eqn):
            yield from remat_eqns(sub)


def grad_jaxpr(fn, *args):
    return jax.make_jaxpr(jax.grad(lambda *a: mse(fn(*a), Y)))(*args).jaxpr


@pytest.mark.parametrize("policy", ["full", "dots", "dots_no_batch", "save:pre"])
def test_tanh_is_recomputed_in_the_backward_pass(policy):
    plain = grad_jaxpr(block, PARAMS, X)
    assert list(remat_eqns(plain)) == []
    jaxpr = grad_jaxpr(remat(block, policy), PARAMS, X)
    backward_tanh = [count_primitive(sub, "tanh") for e in remat_eqns(jaxpr) for sub in sub_jaxprs(e)]
    assert sum(backward_tanh) >= 1
    assert count_primitive(jaxpr, "tanh") > count_primitive(plain, "tanh") == 1


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_tanh_is_recomputed_inside_scan(policy):
    plain = grad_jaxpr(scan_stack(block), STACKED, X)
    jaxpr = grad_jaxpr(scan_stack(remat(block, policy, prevent_cse=False)), STACKED, X)
    assert list(remat_eqns(jaxpr)) and not list(remat_eqns(plain))
    assert count_primitive(jaxpr, "tanh") > count_primitive(plain, "tanh")


# --------------------------------------------------------------------- exactness


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_value_and_grad_equal_unrematted(policy):
    assert_ulp_close(block_value_and_grad(policy)(PARAMS, X, Y), block_value_and_grad(None)(PARAMS, X, Y))


@pytest.mark.parametrize("policy", ["none", "full", "dots", "dots_no_batch", "save:pre,h"])
def test_value_and_grad_equal_unrematted_inside_scan(policy):
    expected = scan_value_and_grad(None)(STACKED, X, Y)
    assert_ulp_close(scan_value_and_grad(policy)(STACKED, X, Y), expected)
    assert_ulp_close(loop_reference(), expected)


@functools.cache
def loop_reference():
    """The scanned stack's value and grads from an unrolled Python loop (independent of scan)."""
    loss, grads = jax.jit(jax.value_and_grad(lambda ps, x, y: mse(loop_stack(block)(ps, x), y)))(LAYERS, X, Y)
    return loss, jax.tree.map(lambda *g: jnp.stack(g), *grads)


def test_prevent_cse_true_inside_scan_is_also_exact():
    expected = scan_value_and_grad(None)(STACKED, X, Y)
    assert_ulp_close(scan_value_and_grad("dots", prevent_cse=True)(STACKED, X, Y), expected)


finite = st.floats(-3.0, 3.0, width=32)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(
    policy=st.sampled_from(ALL_POLICIES),
    w1=hnp.arrays(np.float32, (D, H), elements=finite),
    b1=hnp.arrays(np.float32, (H,), elements=finite),
    w2=hnp.arrays(np.float32, (H, D), elements=finite),
    b2=hnp.arrays(np.float32, (D,), elements=finite),
    x=hnp.arrays(np.float32, (B, D), elements=finite),
)
def test_property_remat_matches_unrematted(policy, w1, b1, w2, b2, x):
    p = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}
    assert_ulp_close(block_value_and_grad(policy)(p, x, Y), block_value_and_grad(None)(p, x, Y))


# ------------------------------------------------------------------ seed 004


SEED_004 = [
    (
        {
            "w1": [[0.5, -0.3, 0.8], [0.1, 0.4, -0.6]],
            "b1": [0.0, 0.1, -0.1],
            "w2": [[0.2, -0.5], [0.7, 0.3], [-0.4, 0.6]],
            "b2": [0.05, -0.05],
        },
        [[1.0, -2.0]],
        [[0.5, -1.0]],
        0.408815,
        {
            "w1": [[0.332859, -0.197498, -0.033156], [-0.665719, 0.394996, 0.066313]],
            "b1": [0.332859, -0.197498, -0.033156],
            "w2": [[-0.089534, -0.24773], [0.234075, 0.647654], [-0.293898, -0.813177]],
            "b2": [-0.307348, -0.850392],
        },
    ),
    (
        {"w1": [[1.0, 0.0], [0.0, 1.0]], "b1": [0.0, 0.0], "w2": [[1.0, 0.0], [0.0, 1.0]], "b2": [0.0, 0.0]},
        [[0.5, -0.5], [1.0, 2.0]],
        [[0.0, 0.0], [0.0, 0.0]],
        3.435003,
        {
            "w1": [[0.559076, -0.084458], [0.550661, 0.398575]],
            "b1": [0.74824, -0.273622],
            "w2": [[0.893115, 0.906388], [0.626807, 1.651008]],
            "b2": [1.361856, 1.000955],
        },
    ),
    (
        {"w1": [[4.0, -3.0], [2.5, 3.5]], "b1": [1.0, -1.0], "w2": [[0.3, -0.2], [0.1, 0.4]], "b2": [0.0, 0.2]},
        [[2.0, 1.5], [-1.0, -2.0], [0.5, 0.5]],
        [[1.0, 1.0], [-1.0, 0.0], [0.0, 0.5]],
        1.039321,
        {
            "w1": [[3.7e-05, 0.010167], [3.7e-05, 0.006994]],
            "b1": [7.4e-05, 0.000838],
            "w2": [[0.780639, 0.623179], [-0.400972, 0.681628]],
            "b2": [0.514078, -0.710164],
        },
    ),
]


def seed_block(params, x):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    return x + hidden @ params["w2"] + params["b2"][None, :]


_seed_step = jax.jit(jax.value_and_grad(lambda p, x, y: mse(remat(seed_block, "dots")(p, x), y)))


@pytest.mark.parametrize("example", range(len(SEED_004)))
def test_seed_004_examples(example):
    params, x, y, loss, grads = SEED_004[example]
    args = (
        {k: jnp.asarray(v, jnp.float32) for k, v in params.items()},
        jnp.asarray(x, jnp.float32),
        jnp.asarray(y, jnp.float32),
    )
    got_loss, got_grads = _seed_step(*args)
    assert got_loss.dtype == jnp.float32 and got_loss.shape == ()
    np.testing.assert_allclose(got_loss, loss, rtol=0, atol=1e-6)
    assert set(got_grads) == set(grads)
    for name, g in grads.items():
        assert got_grads[name].dtype == jnp.float32
        assert got_grads[name].shape == np.shape(g)
        np.testing.assert_allclose(got_grads[name], g, rtol=0, atol=1e-6)
    jaxpr = jax.make_jaxpr(_seed_step)(*args).jaxpr
    assert any(True for _ in remat_eqns(jaxpr))
