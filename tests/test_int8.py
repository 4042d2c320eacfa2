"""The int8 matmul (leanstep.blocks.int8) against NumPy references that do not use it: the product
bit for bit against an int64 one, the straight-through gradients against float64 ones."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from leanstep.blocks import int8 as int8_module
from leanstep.blocks.int8 import Int8Recipe, int8_matmul, quantize_int8

SHAPES = [((4, 8), (8, 16)), ((3, 5, 7), (7, 11)), ((1, 1), (1, 1)), ((2, 3, 130), (130, 129))]


def _np_quantize(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """The quantizer in float32 NumPy, one correctly rounded operation at a time, as the module doc writes it."""
    x32 = np.asarray(x, np.float32)
    amax = np.maximum(np.max(np.abs(x32), axis=axis, keepdims=True), np.float32(1e-30))
    q = np.round(np.clip(x32 * (np.float32(127.0) / amax), np.float32(-127), np.float32(127)))
    return q.astype(np.int64), amax * np.float32(1 / 127)


def _operands(shapes, dtype, seed=0):
    xs, ws = shapes
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, xs, jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, ws, jnp.float32) * 0.1).astype(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_the_product_is_the_int64_products_dequantized_bit_for_bit(shapes, dtype):
    x, w = _operands(shapes, dtype)
    got = np.asarray(int8_matmul(x, w).astype(jnp.float32))
    x2 = np.asarray(x.astype(jnp.float32)).reshape(-1, x.shape[-1])
    qx, sx = _np_quantize(x2, 1)
    qw, sw = _np_quantize(np.asarray(w.astype(jnp.float32)), 0)
    acc = qx @ qw  # int64: exact
    assert np.abs(acc).max() < 2**31
    want = (acc.astype(np.float32) * sx * sw).astype(np.float32)
    want = np.asarray(jnp.asarray(want).astype(dtype).astype(jnp.float32)).reshape(got.shape)
    np.testing.assert_array_equal(got, want)


def test_quantize_int8_matches_numpy_and_its_error_is_half_a_step():
    x = jax.random.normal(jax.random.key(3), (64, 33)) * jnp.logspace(-3, 3, 33)[None, :]
    q, s = quantize_int8(x, axis=0)
    nq, ns = _np_quantize(np.asarray(x), 0)
    np.testing.assert_array_equal(np.asarray(q, np.int64), nq)
    np.testing.assert_array_equal(np.asarray(s), ns)
    assert np.all(np.abs(np.asarray(q, np.float64) * ns - np.asarray(x, np.float64)) <= 0.5 * ns * (1 + 1e-6))
    assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) == 127  # the largest magnitude of each column is ±127


@pytest.mark.parametrize("weight_grad", ["compute", "int8"])
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_gradients_are_the_straight_through_products_against_float64(shapes, weight_grad):
    x, w = _operands(shapes, jnp.float32, seed=1)
    recipe = Int8Recipe(weight_grad=weight_grad)
    y, pull = jax.vjp(lambda x, w: int8_matmul(x, w, recipe), x, w)
    g = jax.random.normal(jax.random.key(2), y.shape)
    dx, dw = pull(g)
    x2, g2 = np.asarray(x, np.float64).reshape(-1, x.shape[-1]), np.asarray(g).reshape(-1, w.shape[1])
    qg, sg = _np_quantize(g2, 1)
    qw, sw = _np_quantize(np.asarray(w), 1)
    want_dx = (qg * sg.astype(np.float64)) @ (qw * sw.astype(np.float64)).T
    np.testing.assert_allclose(np.asarray(dx, np.float64).reshape(want_dx.shape), want_dx, rtol=2e-6, atol=1e-6)
    if weight_grad == "compute":
        want_dw = x2.T @ np.asarray(g2, np.float64)
    else:
        qx, sx = _np_quantize(x2, 0)
        qg0, sg0 = _np_quantize(g2, 0)
        want_dw = (qx * sx.astype(np.float64)).T @ (qg0 * sg0.astype(np.float64))
    np.testing.assert_allclose(np.asarray(dw, np.float64), want_dw, rtol=2e-6, atol=1e-6)


def test_the_weight_gradient_in_blocks_of_rows_past_the_int32_limit(monkeypatch):
    monkeypatch.setattr(int8_module, "MAX_CONTRACTION", 5)  # 23 rows: five blocks of five, two rows of zeros
    x, w = _operands(((23, 4), (4, 3)), jnp.float32, seed=4)
    g = jax.random.normal(jax.random.key(5), (23, 3))
    _, pull = jax.vjp(lambda w: int8_matmul(x, w, Int8Recipe("int8")), w)
    (dw,) = pull(g)
    want = np.zeros((4, 3))
    xs, gs = np.pad(np.asarray(x), ((0, 2), (0, 0))), np.pad(np.asarray(g), ((0, 2), (0, 0)))
    for block in range(5):
        qx, sx = _np_quantize(xs[block * 5 : block * 5 + 5], 0)
        qg, sg = _np_quantize(gs[block * 5 : block * 5 + 5], 0)
        want += (qx * sx.astype(np.float64)).T @ (qg * sg.astype(np.float64))
    np.testing.assert_allclose(np.asarray(dw, np.float64), want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("weight_grad", ["compute", "int8"])
def test_a_power_of_two_loss_scale_quantizes_to_the_same_int8_values(weight_grad):
    x, w = _operands(((16, 32), (32, 24)), jnp.bfloat16, seed=6)
    g = jax.random.normal(jax.random.key(7), (16, 24), jnp.float32).astype(jnp.bfloat16)
    _, pull = jax.vjp(lambda x, w: int8_matmul(x, w, Int8Recipe(weight_grad)), x, w)
    plain = pull(g)
    scaled = pull(g * jnp.bfloat16(2.0**15))
    for a, b in zip(plain, scaled, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32) * 2.0**15, np.asarray(b, np.float32))


def test_a_token_quantizes_the_same_whatever_rows_share_its_call():
    x, w = _operands(((8, 4, 32), (32, 16)), jnp.bfloat16, seed=8)
    g = jax.random.normal(jax.random.key(9), (8, 4, 16)).astype(jnp.bfloat16)
    whole_y, pull = jax.vjp(lambda x: int8_matmul(x, w), x)
    (whole_dx,) = pull(g)
    halves = [jax.vjp(lambda x: int8_matmul(x, w), x[i : i + 4]) for i in (0, 4)]
    np.testing.assert_array_equal(np.concatenate([np.asarray(y) for y, _ in halves]), np.asarray(whole_y))
    parts = [pull_half(g[i : i + 4])[0] for (_, pull_half), i in zip(halves, (0, 4), strict=True)]
    np.testing.assert_array_equal(np.concatenate([np.asarray(p) for p in parts]), np.asarray(whole_dx))


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_a_non_finite_operand_or_gradient_makes_what_it_enters_non_finite(bad):
    x, w = _operands(((4, 8), (8, 6)), jnp.float32, seed=10)
    y = int8_matmul(x.at[1, 2].set(bad), w)
    assert not np.isfinite(np.asarray(y)[1]).any() and np.isfinite(np.asarray(y)[[0, 2, 3]]).all()
    assert not np.isfinite(np.asarray(int8_matmul(x, w.at[3, 1].set(bad)))[:, 1]).any()
    for weight_grad in ("compute", "int8"):
        _, pull = jax.vjp(functools.partial(int8_matmul, recipe=Int8Recipe(weight_grad)), x, w)
        dx, dw = pull(jnp.ones((4, 6)).at[2, 0].set(bad))
        assert not np.isfinite(np.asarray(dx)[2]).any(), weight_grad
        assert not np.isfinite(np.asarray(dw)).all(), weight_grad


def test_rows_of_zeros_are_zeros_not_nan():
    x = jnp.zeros((3, 4)).at[0].set(1.0)
    w = jnp.zeros((4, 2))
    y, pull = jax.vjp(lambda x, w: int8_matmul(x, w, Int8Recipe("int8")), x, w)
    dx, dw = pull(jnp.zeros((3, 2)))
    for value in (y, dx, dw):
        assert np.all(np.asarray(value) == 0)


@pytest.mark.parametrize(
    ("text", "recipe"),
    [
        ("none", None),
        ("on", Int8Recipe()),
        ("ON, weight_grad=int8", Int8Recipe("int8")),
        ("on,weight_grad=compute", Int8Recipe()),
    ],
)
def test_recipe_strings_read_and_write_back(text, recipe):
    assert Int8Recipe.from_string(text) == recipe
    if recipe is not None:
        assert Int8Recipe.from_string(recipe.to_string()) == recipe


@pytest.mark.parametrize(
    "text", ["", "int8", "on,weight_grad=fp8", "on,wgrad=int8", "on,weight_grad=int8,weight_grad=int8"]
)
def test_a_bad_recipe_string_is_one_line_naming_the_form(text):
    with pytest.raises(ValueError, match=r"int8 recipe .*(expected|weight_grad must be)"):
        Int8Recipe.from_string(text)


def test_bad_operands_are_refused_by_name():
    with pytest.raises(ValueError, match=r"x of shape \(\.\.\., k\) and w of shape \(k, n\)"):
        int8_matmul(jnp.ones((2, 3)), jnp.ones((4, 5)))
    with pytest.raises(TypeError, match="int8_matmul's x must be floating"):
        int8_matmul(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 5)))
    with pytest.raises(TypeError, match="recipe must be an Int8Recipe"):
        int8_matmul(jnp.ones((2, 3)), jnp.ones((3, 5)), "on")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exceeds 133144"):
        jax.eval_shape(int8_matmul, jax.ShapeDtypeStruct((1, 140_000), jnp.bfloat16), jnp.ones((140_000, 1)))


@pytest.mark.parametrize("policy", ["dots", "dots_no_batch", "full"])
def test_an_int8_transformer_saves_what_its_bf16_one_saves_never_an_int32_sum(policy):
    """Under "dots", jax.checkpoint_policies.dots_saveable alone saves each product's int32 sum:
    twice the bytes of the bf16 product (2.4 GB more on the 405M model); int8_remat_policy saves
    the dequantized product in its place."""
    from leanstep.inspection.residuals import saved_residuals_report
    from leanstep.models.registry import build_model

    reports = {}
    for recipe in (None, Int8Recipe()):
        model = build_model("transformer", "tiny", int8=recipe)
        params = model.init(jax.random.key(0))
        batch = {"tokens": jax.random.randint(jax.random.key(1), (2, model.seq_len + 1), 0, 256)}
        loss = functools.partial(model.loss, batch=batch, remat_policy=policy, compute_dtype=jnp.bfloat16)
        reports[recipe] = saved_residuals_report(loss, params)
    int8 = reports[Int8Recipe()]
    ints = [
        e for e in int8.entries if e.kind != "argument" and jnp.issubdtype(e.dtype, jnp.integer) and e.nbytes > 4096
    ]
    assert not ints, ints  # (the token ids, a few hundred bytes, are integers in both)
    assert int8.activation_bytes == reports[None].activation_bytes
