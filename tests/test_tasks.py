"""The four seed contracts: public examples, traced-program rules, edge cases, references, bad input."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.chip import SIX_DECIMALS_ON_TPU, on_tpu
from leanstep import tasks
from leanstep.cli.solve import load_examples
from leanstep.common.jaxprs import scan_operands
from leanstep.inspection.residuals import saved_residuals_report

mixed_step = jax.jit(tasks.mixed_precision_step, static_argnames=("growth_interval",))
accumulate = jax.jit(tasks.accumulate_gradients, static_argnames=("num_microbatches",))
clip = jax.jit(tasks.clip_by_global_norm)
residual = jax.jit(tasks.checkpointed_residual_block)


def _tree(value):
    """The seeds' JSON rule: a list of objects is a list node, any other list is an array leaf."""
    if isinstance(value, dict):
        return {k: _tree(v) for k, v in value.items()}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [_tree(v) for v in value]
    return jnp.asarray(value, jnp.float32)


def _run(task: str, inp: dict):
    if task == "mixed-precision-step":
        return mixed_step(
            _tree(inp["params"]),
            _tree(inp["x"]),
            _tree(inp["y"]),
            jnp.float32(inp["loss_scale"]),
            jnp.int32(inp["good_steps"]),
            jnp.float32(inp["lr"]),
            growth_interval=inp["growth_interval"],
        )
    if task == "gradient-accumulation":
        return accumulate(
            _tree(inp["params"]), _tree(inp["x"]), _tree(inp["y"]), num_microbatches=inp["num_microbatches"]
        )
    if task == "global-norm-clipping":
        return clip(_tree(inp["grads"]), jnp.float32(inp["max_norm"]))
    return residual(_tree(inp["params"]), _tree(inp["x"]), _tree(inp["y"]))


def _assert_matches(actual, expected, where="output"):
    if isinstance(expected, dict):
        assert set(actual) == set(expected), where
        for key in expected:
            _assert_matches(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, list) and expected and all(isinstance(e, dict) for e in expected):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_matches(a, e, f"{where}[{i}]")
    elif isinstance(expected, bool):
        assert actual.dtype == jnp.bool_ and bool(actual) == expected, where
    elif isinstance(expected, int) and not isinstance(expected, bool):
        assert actual.dtype == jnp.int32 and int(actual) == expected, where
    else:
        assert actual.dtype == jnp.float32, where
        a = np.asarray(actual, np.float64)
        e = np.asarray(expected, np.float64)
        assert a.shape == e.shape, where
        # "to 6 decimals"; past 8e6 a float32 has no 6th decimal, so there: a float32 ulp.
        tolerance = np.maximum(1e-6, np.abs(e) * 2.0**-23) * 1.01
        np.testing.assert_array_less(np.abs(np.round(a, 6) - e), tolerance + 1e-9, err_msg=where)


EXAMPLES = [(task, i) for task in tasks.TASKS for i in range(3)]


@pytest.mark.parametrize(("task", "index"), EXAMPLES)
def test_public_example_reproduces_to_six_decimals(task, index):
    if on_tpu():
        pytest.skip(SIX_DECIMALS_ON_TPU)
    example = load_examples(task)[index]
    _assert_matches(_run(task, example["input"]), example["output"])


def test_embedded_examples_are_the_seeds_three_each():
    for task in tasks.TASKS:
        assert len(load_examples(task)) == 3


# --- mixed precision: bf16 rounding really happens, and the loss-scale edge cases ---------------

BASE = {"w": jnp.array([[0.5], [-1.25]]), "b": jnp.array([0.1])}
X = jnp.array([[1.0, 2.0], [0.5, -1.0]])
Y = jnp.array([[-1.9], [1.5]])
# Inputs whose unscaled gradient overflows float32 whatever the scale.
X_HUGE = jnp.array([[1e30, 0.0], [0.0, 0.0]])
Y_HUGE = jnp.array([[3e38], [0.0]])


def _mp(loss_scale, good_steps, *, x=X, y=Y, growth_interval=2, lr=0.1):
    return mixed_step(
        BASE, x, y, jnp.float32(loss_scale), jnp.int32(good_steps), jnp.float32(lr), growth_interval=growth_interval
    )


def test_without_explicit_rounding_the_first_example_is_off():
    # The trap the contract warns about: XLA's excess precision gives 0.005010, not 0.005159.
    def naive(params, x, y):
        pred = x.astype(jnp.bfloat16) @ params["w"].astype(jnp.bfloat16) + params["b"].astype(jnp.bfloat16)[None, :]
        return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

    assert abs(float(jax.jit(naive)(BASE, X, Y)) - 0.005159) > 1e-4
    assert abs(float(_mp(1024.0, 0)["loss"]) - 0.005159) < 1e-6


def test_only_the_scaled_loss_overflows_keeps_params_and_halves():
    out = _mp(3e38, 0, y=jnp.array([[40.0], [-30.0]]))
    assert np.isfinite(float(out["loss"]))
    assert not bool(out["grads_finite"])
    for key, value in BASE.items():
        np.testing.assert_array_equal(out["params"][key], value)
    assert float(out["loss_scale"]) == np.float32(1.5e38)


@pytest.mark.parametrize(("scale", "expected"), [(1.5, 1.0), (1.0, 1.0), (2.0, 1.0), (8.0, 4.0)])
def test_halving_has_a_floor_of_one(scale, expected):
    out = _mp(scale, 1, x=X_HUGE, y=Y_HUGE)
    assert not bool(out["grads_finite"])
    assert float(out["loss_scale"]) == expected
    assert int(out["good_steps"]) == 0  # reset on a non-finite step


@pytest.mark.parametrize(
    ("good_steps", "growth_interval", "scale", "count"),
    [(0, 3, 512.0, 1), (1, 3, 512.0, 2), (2, 3, 1024.0, 0), (0, 1, 1024.0, 0), (4, 5, 1024.0, 0)],
)
def test_doubling_exactly_when_the_count_reaches_growth_interval(good_steps, growth_interval, scale, count):
    out = _mp(512.0, good_steps, growth_interval=growth_interval)
    assert bool(out["grads_finite"])
    assert float(out["loss_scale"]) == scale
    assert int(out["good_steps"]) == count


def test_output_dtypes_and_shapes():
    out = _mp(1024.0, 0)
    assert out["loss"].shape == () and out["loss"].dtype == jnp.float32
    assert out["loss_scale"].dtype == jnp.float32 and out["good_steps"].dtype == jnp.int32
    assert out["grads_finite"].dtype == jnp.bool_
    assert out["params"]["w"].shape == (2, 1) and out["params"]["w"].dtype == jnp.float32


def _bf16(a):
    return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def _mixed_precision_reference(params, x, y, scale, lr):
    """Float64 NumPy, rounding every bf16 op result to bf16, forward and backward."""
    w, b, xb = _bf16(params["w"]), _bf16(params["b"]), _bf16(x)
    pred = _bf16(_bf16(xb @ w) + b)
    diff = np.float32(pred) - np.float32(y)
    loss = np.mean(diff.astype(np.float64) ** 2)
    d_pred = _bf16(2.0 * scale * diff / diff.size)
    grad_w = _bf16(xb.T @ d_pred) / scale
    grad_b = _bf16(d_pred.sum(0)) / scale
    return loss, params["w"] - lr * grad_w, params["b"] - lr * grad_b


@settings(max_examples=12, deadline=None)  # each example compiles
@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(0, 2**31 - 1),
    st.sampled_from([1.0, 256.0, 1024.0, 65536.0]),
)
def test_mixed_precision_matches_a_bf16_rounding_float64_reference(batch, d, k, seed, scale):
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=(d, k)).astype(np.float32), "b": rng.normal(size=k).astype(np.float32)}
    x = rng.normal(size=(batch, d)).astype(np.float32)
    y = rng.normal(size=(batch, k)).astype(np.float32)
    out = mixed_step(params, x, y, jnp.float32(scale), jnp.int32(0), jnp.float32(0.1), growth_interval=4)
    loss, w, b = _mixed_precision_reference(params, x, y, scale, 0.1)
    assert bool(out["grads_finite"])
    np.testing.assert_allclose(float(out["loss"]), loss, rtol=1e-5, atol=1e-6)
    # Up to the order of accumulation inside the bf16 reductions: a bf16 ulp of the step.
    np.testing.assert_allclose(
        out["params"]["w"], w, rtol=1e-6, atol=0.1 * 2**-7 * (1 + np.abs(w - params["w"]).max() * 10)
    )
    np.testing.assert_allclose(
        out["params"]["b"], b, rtol=1e-6, atol=0.1 * 2**-7 * (1 + np.abs(b - params["b"]).max() * 10)
    )


# --- gradient accumulation: traced-program rules and the full-batch reference ---------------------


def _mlp_params(rng, d, h, k):
    return {
        "w1": rng.normal(size=(d, h)).astype(np.float32),
        "b1": rng.normal(size=h).astype(np.float32),
        "w2": rng.normal(size=(h, k)).astype(np.float32),
        "b2": rng.normal(size=k).astype(np.float32),
    }


def _eqns(jaxpr):
    """Top-level equations of a jaxpr, looking through pjit wrappers."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pjit", "jit"):
            out.extend(_eqns(eqn.params["jaxpr"].jaxpr))
        else:
            out.append(eqn)
    return out


def _all_primitives(jaxpr):
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                names.extend(_all_primitives(inner))
    return names


@pytest.mark.parametrize(("batch", "num_microbatches"), [(4, 2), (6, 3), (8, 8), (3, 1)])
def test_accumulation_traced_program_rules(batch, num_microbatches):
    rng = np.random.default_rng(0)
    params = _mlp_params(rng, 3, 5, 2)  # no parameter shaped like x or y
    x = rng.normal(size=(batch, 3)).astype(np.float32)
    y = rng.normal(size=(batch, 2)).astype(np.float32)
    closed = jax.make_jaxpr(functools.partial(tasks.accumulate_gradients, num_microbatches=num_microbatches))(
        params, x, y
    )
    top = _eqns(closed.jaxpr)
    scans = [e for e in top if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == num_microbatches
    outside = [e.primitive.name for e in top if e.primitive.name != "scan"]
    assert "dot_general" not in outside
    body = scans[0].params["jaxpr"].jaxpr
    body_primitives = _all_primitives(body)
    # Forward (2 matmuls) and backward (dW2, dh, dW1) of one microbatch in the body.
    assert body_primitives.count("dot_general") == 5
    rows = batch // num_microbatches
    scan = scans[0]
    consts, _, xs = scan_operands(scan)
    # The scanned-over operands are x and y, split (M, S, ...); the body sees S rows of each.
    assert sorted(v.aval.shape for v in xs) == sorted([(num_microbatches, rows, 3), (num_microbatches, rows, 2)])
    # Neither the full x nor the full y reaches the body as a closed-over constant.
    assert all(v.aval.shape not in ((batch, 3), (batch, 2)) for v in consts) or rows == batch


@pytest.mark.float32_matmuls
@settings(max_examples=10, deadline=None)  # each example compiles: 10 cover the shapes well
@given(
    st.integers(1, 8).flatmap(
        lambda b: st.tuples(st.just(b), st.sampled_from([m for m in range(1, b + 1) if b % m == 0]))
    ),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(0, 2**31 - 1),
)
def test_accumulation_equals_full_batch_value_and_grad(batch_and_m, d, h, k, seed):
    batch, m = batch_and_m
    rng = np.random.default_rng(seed)
    params = _mlp_params(rng, d, h, k)
    x = rng.normal(size=(batch, d)).astype(np.float32)
    y = rng.normal(size=(batch, k)).astype(np.float32)

    def full_loss(p):
        out = jnp.tanh(x @ p["w1"] + p["b1"][None, :]) @ p["w2"] + p["b2"][None, :]
        return jnp.mean(jnp.sum((out - y) ** 2, axis=-1))

    loss, grads = jax.value_and_grad(full_loss)(params)
    out = accumulate(params, x, y, num_microbatches=m)
    np.testing.assert_allclose(out["loss"], loss, rtol=2e-5, atol=1e-6)
    for key in params:
        np.testing.assert_allclose(out["grads"][key], grads[key], rtol=2e-4, atol=2e-5)


# --- clipping -----------------------------------------------------------------------------------


def test_all_zero_gradients_come_back_unchanged_with_norm_zero():
    grads = {"a": jnp.zeros((2, 3)), "b": [jnp.zeros(()), jnp.zeros((1, 2, 2))]}
    out = clip(grads, jnp.float32(1.0))
    assert float(out["global_norm"]) == 0.0
    for leaf in jax.tree.leaves(out["clipped"]):
        assert not np.isnan(np.asarray(leaf)).any() and not np.asarray(leaf).any()


def test_bf16_leaves_norm_in_float32_and_come_back_bf16():
    # 10,000 entries of 94.868: the bf16 sum of squares stalls; the float32 one does not.
    leaf = jnp.full((100, 100), 94.868, jnp.bfloat16)
    out = clip({"g": leaf}, jnp.float32(1.0))
    true_norm = np.sqrt(np.sum(np.asarray(leaf, np.float64) ** 2))
    assert out["global_norm"].dtype == jnp.float32
    np.testing.assert_allclose(float(out["global_norm"]), true_norm, rtol=1e-6)
    assert out["clipped"]["g"].dtype == jnp.bfloat16


@st.composite
def _grad_trees(draw):
    def leaf():
        shape = draw(st.lists(st.integers(1, 3), min_size=0, max_size=3))
        return np.asarray(
            draw(st.lists(st.floats(-100, 100, width=32), min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))),
            np.float32,
        ).reshape(shape)

    n = draw(st.integers(1, 3))
    return {"dense": {"w": leaf(), "b": leaf()}, "layers": [{"w": leaf()} for _ in range(n)]}


@settings(max_examples=30, deadline=None)
@given(_grad_trees(), st.floats(0.01, 50.0))
def test_clipping_matches_float64_numpy(grads, max_norm):
    leaves = [np.asarray(l, np.float64) for l in jax.tree.leaves(grads)]
    norm = np.sqrt(sum(np.sum(l**2) for l in leaves))
    scale = 1.0 if norm <= max_norm else max_norm / norm
    out = clip(grads, jnp.float32(max_norm))
    np.testing.assert_allclose(float(out["global_norm"]), norm, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(out["clipped"]), leaves):
        assert got.dtype == jnp.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want * scale, rtol=1e-5, atol=1e-5)


# --- the checkpointed residual block --------------------------------------------------------------


def _block_params(rng, d, h):
    return {
        "w1": rng.normal(size=(d, h)).astype(np.float32),
        "b1": rng.normal(size=h).astype(np.float32),
        "w2": rng.normal(size=(h, d)).astype(np.float32),
        "b2": rng.normal(size=d).astype(np.float32),
    }


def test_residual_block_checkpoints_with_dots_saveable():
    rng = np.random.default_rng(0)
    params, x, y = _block_params(rng, 2, 3), rng.normal(size=(5, 2)).astype(np.float32), np.zeros((5, 2), np.float32)
    closed = jax.make_jaxpr(tasks.checkpointed_residual_block)(params, x, y)
    remats = [
        e for e in _walk(closed.jaxpr) if e.primitive.name.startswith("remat") or e.primitive.name == "checkpoint"
    ]
    assert remats, "no jax.checkpoint region in the traced program"
    assert all(e.params["policy"] is jax.checkpoint_policies.dots_saveable for e in remats)
    # tanh is recomputed: in the backward part it appears inside a remat region again.
    forward_and_backward = [e for e in _walk(closed.jaxpr)]
    assert sum(e.primitive.name == "tanh" for e in forward_and_backward) >= 2


def test_residual_block_saves_matmul_results_and_not_tanh():
    rng = np.random.default_rng(1)
    params, x = _block_params(rng, 2, 3), rng.normal(size=(5, 2)).astype(np.float32)
    report = saved_residuals_report(tasks._checkpointed_block, params, x)
    kinds = [e.kind for e in report.entries]
    assert "dot_general" in kinds  # x @ W1 (5, 3) is kept
    assert not any("tanh" in e.description for e in report.entries)
    assert any(e.kind == "dot_general" and e.shape == (5, 3) for e in report.entries)


def _walk(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                yield from _walk(inner)


@settings(max_examples=12, deadline=None)  # each example compiles
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_residual_block_equals_the_unchecked_function(batch, d, h, seed):
    rng = np.random.default_rng(seed)
    params = _block_params(rng, d, h)
    x = rng.normal(size=(batch, d)).astype(np.float32)
    y = rng.normal(size=(batch, d)).astype(np.float32)

    def plain(p):
        out = x + jnp.tanh(x @ p["w1"] + p["b1"][None, :]) @ p["w2"] + p["b2"][None, :]
        return jnp.mean((out - y) ** 2)

    loss, grads = jax.jit(jax.value_and_grad(plain))(params)
    out = residual(params, x, y)
    np.testing.assert_allclose(out["loss"], loss, rtol=1e-6, atol=1e-7)
    for key in params:
        np.testing.assert_allclose(out["grads"][key], grads[key], rtol=1e-5, atol=1e-6)


# --- bad input ------------------------------------------------------------------------------------

GOOD_MLP = {
    "w1": np.ones((2, 3), np.float32),
    "b1": np.ones(3, np.float32),
    "w2": np.ones((3, 1), np.float32),
    "b2": np.ones(1, np.float32),
}


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: tasks.mixed_precision_step({"w": np.ones((2, 1))}, X, Y, 1.0, 0, 0.1, 2),
            ValueError,
            r"params.*missing \['b'\]",
        ),
        (
            lambda: tasks.mixed_precision_step({**BASE, "c": 1.0}, X, Y, 1.0, 0, 0.1, 2),
            ValueError,
            r"unexpected \['c'\]",
        ),
        (
            lambda: tasks.mixed_precision_step(BASE, np.ones((2, 3)), Y, 1.0, 0, 0.1, 2),
            ValueError,
            r"x has shape \(2, 3\)",
        ),
        (
            lambda: tasks.mixed_precision_step(BASE, X, np.ones((3, 1)), 1.0, 0, 0.1, 2),
            ValueError,
            r"y has shape \(3, 1\)",
        ),
        (
            lambda: tasks.mixed_precision_step(BASE, X, Y, 1.0, 0, 0.1, 0),
            ValueError,
            "growth_interval must be >= 1, got 0",
        ),
        (
            lambda: tasks.mixed_precision_step(BASE, X, Y, 1.0, 0, 0.1, 2.0),
            TypeError,
            "growth_interval must be a static Python int",
        ),
        (lambda: tasks.mixed_precision_step([1.0], X, Y, 1.0, 0, 0.1, 2), TypeError, "params must be a dict"),
        (
            lambda: tasks.accumulate_gradients(GOOD_MLP, np.ones((4, 2)), np.ones((4, 1)), 0),
            ValueError,
            "num_microbatches must be >= 1, got 0",
        ),
        (
            lambda: tasks.accumulate_gradients(GOOD_MLP, np.ones((6, 2)), np.ones((6, 1)), 4),
            ValueError,
            "batch size 6 is not divisible by num_microbatches=4",
        ),
        (
            lambda: tasks.accumulate_gradients(
                {k: v for k, v in GOOD_MLP.items() if k != "b2"}, np.ones((4, 2)), np.ones((4, 1)), 2
            ),
            ValueError,
            r"missing \['b2'\]",
        ),
        (
            lambda: tasks.accumulate_gradients({**GOOD_MLP, "b1": np.ones(4)}, np.ones((4, 2)), np.ones((4, 1)), 2),
            ValueError,
            r"params\['b1'\] has shape \(4,\)",
        ),
        (lambda: tasks.clip_by_global_norm({"g": np.ones(2)}, 0.0), ValueError, "max_norm"),
        (lambda: tasks.clip_by_global_norm({"g": np.ones(2)}, -1.0), ValueError, "max_norm"),
        (lambda: tasks.clip_by_global_norm({}, 1.0), ValueError, "grads must have at least one leaf"),
        (
            lambda: tasks.checkpointed_residual_block(
                {**GOOD_MLP, "w2": np.ones((3, 2))}, np.ones((1, 2)), np.ones((1, 2))
            ),
            ValueError,
            r"params\['b2'\] has shape \(1,\)",
        ),
        (
            lambda: tasks.checkpointed_residual_block({**GOOD_MLP}, np.ones((1, 2)), np.ones((1, 2))),
            ValueError,
            r"params\['w2'\] has shape \(3, 1\); expected \(3, 2\)",
        ),
    ],
)
def test_bad_input_raises_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_bad_max_norm_is_caught_under_jit_when_static():
    with pytest.raises(ValueError, match="max_norm"):
        jax.jit(tasks.clip_by_global_norm, static_argnums=1)({"g": jnp.ones(2)}, -2.0)
