"""FP8 quantize-dequantize against an independent reference: float64 NumPy, each float32 operation
rounded to float32 as IEEE does it, and the FP8 and bfloat16 casts done by ``ml_dtypes``.

Per operation (``leanstep.blocks.fp8``): the scale from an amax and a margin, the quotient, the
clip (saturation), the cast to e4m3 / e5m2, the product back, the cast to the compute dtype; the
amax and its history; and the matmul's delayed and current scaling end to end (the operands it
quantizes, the gradient it quantizes, the state it returns).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import leanstep
from helpers.chip import TPU_DIVISION_ULPS, on_tpu
from leanstep.blocks.fp8 import amax_of, fp8_max, new_scale, qdq, record_amax
from leanstep.common.jaxprs import equations

FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def f32(x) -> np.ndarray:
    """float64 -> float32, the one rounding of a float32 operation's exact result."""
    return np.asarray(x, np.float64).astype(np.float32)


def ref_scale(amax: np.ndarray, scale: np.ndarray, fmt: str, margin: float) -> np.ndarray:
    amax, scale = np.asarray(amax, np.float32), np.asarray(scale, np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        factor = f32(f32(np.float64(fp8_max(fmt)) / amax.astype(np.float64)) * np.float64(f32(2.0**-margin)))
        fresh = f32(1.0 / factor.astype(np.float64))
    usable = (amax > 0) & np.isfinite(amax) & np.isfinite(factor)
    return np.where(usable, fresh, scale).astype(np.float32)


def ref_qdq(x: np.ndarray, fmt: str, scale: float, out_dtype) -> np.ndarray:
    limit = np.float64(fp8_max(fmt))
    s = np.float64(np.float32(scale))
    inverse = np.float64(f32(1.0 / s))
    quotient = f32(np.asarray(x, np.float32).astype(np.float64) * inverse)
    clipped = np.clip(quotient.astype(np.float64), -limit, limit).astype(np.float32)  # exact: both float32
    quantized = clipped.astype(FORMATS[fmt])
    product = f32(quantized.astype(np.float64) * s)
    return product.astype(out_dtype)


def _inputs(rng: np.random.Generator, dtype) -> list[np.ndarray]:
    normal = rng.normal(size=512)
    return [
        (normal * 3).astype(dtype),  # ordinary values
        (normal * 1e4).astype(dtype),  # far past 448 * scale: saturates
        (normal * 1e-6).astype(dtype),  # FP8 subnormals and zeros
        np.array([0.0, -0.0, 448.0, -448.0, 464.0, 57344.0, -6e4, 1e-9, 3.5, -3.5], dtype),  # edges, ties
    ]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("scale", [1.0, 0.013671875, 3.7, 1e-3])
def test_qdq_equals_the_float64_reference_per_operation(fmt, dtype, scale):
    """On a TPU v5e, before an optimization barrier kept them, XLA folded qdq's converts away and it
    returned its input unquantized: this test, run there, is what found it (issue 41)."""
    rng = np.random.default_rng(0)
    run = jax.jit(lambda x, s: qdq(x, fmt, s))
    constant = jax.jit(lambda x: qdq(x, fmt, jnp.float32(scale)))  # XLA folds what it knows: the same
    for x in _inputs(rng, dtype):
        got = np.asarray(run(jnp.asarray(x), jnp.float32(scale)))
        np.testing.assert_array_equal(np.asarray(constant(jnp.asarray(x))).astype(np.float32), got.astype(np.float32))
        want = ref_qdq(x, fmt, scale, dtype)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_qdq_saturates_at_the_formats_largest_value_and_keeps_the_sign():
    x = jnp.array([1e30, -1e30, 1e5], jnp.float32)
    assert np.asarray(qdq(x, "e4m3", jnp.float32(1.0))).tolist() == [448.0, -448.0, 448.0]
    assert np.asarray(qdq(x, "e5m2", jnp.float32(2.0))).tolist() == [114688.0, -114688.0, 98304.0]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("margin", [0, 1, 2.5])
def test_the_scale_equals_the_reference_with_its_margin_and_edge_amaxes(fmt, margin):
    rng = np.random.default_rng(1)
    amax = np.concatenate(
        [np.abs(rng.normal(size=64)) * 10.0 ** rng.integers(-8, 8, size=64), [0.0, np.inf, np.nan, 1e-45, 3e38]]
    ).astype(np.float32)
    old = np.float32(0.25)
    got = np.asarray(jax.jit(lambda a: new_scale(a, old, fmt, margin=margin))(jnp.asarray(amax)))
    finite = (amax > 1e-30) & np.isfinite(amax)
    if on_tpu():
        # Two float32 divisions, each within TPU_DIVISION_ULPS; and the chip divides through a
        # reciprocal that flushes below 2**-126, so an amax of 2**126 or more gets an inf scale
        # there (issue 41, reported): compared up to it.
        ordinary = amax < 2.0**126
        finite &= ordinary
        np.testing.assert_array_max_ulp(
            got[ordinary], ref_scale(amax, old, fmt, margin)[ordinary], 2 * TPU_DIVISION_ULPS
        )
    else:
        np.testing.assert_array_equal(got, ref_scale(amax, old, fmt, margin))
    # The scale keeps 2**margin of headroom: the amax quantizes to max / 2**margin (exactly, up to rounding).
    np.testing.assert_allclose((amax / got)[finite], fp8_max(fmt) / 2.0**margin, rtol=1e-6)


def test_the_amax_and_the_history_equal_the_reference():
    x = np.random.default_rng(2).normal(size=(7, 5)).astype(ml_dtypes.bfloat16)
    assert float(amax_of(jnp.asarray(x))[0]) == float(np.max(np.abs(x.astype(np.float64))))
    history = np.arange(1.0, 6.0, dtype=np.float32)
    want = np.roll(history, -1)
    want[0] = 9.0
    np.testing.assert_array_equal(np.asarray(record_amax(jnp.asarray(history), jnp.array([9.0]))), want)
    recipe = leanstep.Fp8Recipe(amax="most_recent")
    assert float(recipe.history_amax(jnp.asarray(want))) == 9.0
    assert float(leanstep.Fp8Recipe().history_amax(jnp.asarray(history))) == 5.0


# --- the matmul, end to end -------------------------------------------------------------------------


#: The FP8 matmul's only rounding past the FP8 casts: its bfloat16 product (float32 sums of exact
#: products of FP8 values, times the scales); references dequantize exactly, in float64.
BF16_OUT = 2.0**-8


def _matmul_case(recipe, meta):
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(6, 8)) * 5).astype(ml_dtypes.bfloat16)
    w = (rng.normal(size=(8, 3)) * 0.2).astype(ml_dtypes.bfloat16)
    g = (rng.normal(size=(6, 3)) * 1e3).astype(ml_dtypes.bfloat16)

    def f(x, w, meta):
        y = leanstep.blocks.fp8_matmul(x, w, meta, recipe)
        return jnp.sum(y.astype(jnp.float32) * jnp.asarray(g, jnp.float32)), y

    (_, y), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(jnp.asarray(x), jnp.asarray(w), meta)
    return x, w, g, y, grads


@pytest.mark.parametrize("margin", [0, 1])
def test_delayed_scaling_quantizes_with_the_histories_scales_and_records_the_new_amaxes(margin):
    recipe = leanstep.Fp8Recipe(history=4, margin=margin)
    history = jnp.array([7.0, 30.0, 0.0, 2.0], jnp.float32)  # its max (30) sets the scale
    meta = leanstep.blocks.Fp8Meta(*(jnp.ones(1) * 0.5, history) * 3)
    x, w, g, y, (dx, dw, new) = _matmul_case(recipe, meta)
    s_x = ref_scale(np.float32(30.0), np.float32(0.5), "e4m3", margin)
    s_g = ref_scale(np.float32(30.0), np.float32(0.5), "e5m2", margin)
    xq, wq = ref_qdq(x, "e4m3", s_x, np.float64), ref_qdq(w, "e4m3", s_x, np.float64)
    np.testing.assert_allclose(np.asarray(y, np.float32), xq @ wq, rtol=BF16_OUT)
    # dx is g_q @ w_q^T with g quantized to e5m2 with s_g: FP8 operands into the dot, exact products.
    gq = ref_qdq(np.asarray(g), "e5m2", s_g, np.float64)
    np.testing.assert_allclose(np.asarray(dx, np.float32), gq @ wq.T, rtol=BF16_OUT)
    np.testing.assert_allclose(np.asarray(dw, np.float32), xq.T @ gq, rtol=BF16_OUT)
    # The state's "gradient" is its new value: the new scale, and the amax as the newest entry.
    assert float(new.input_scale[0]) == float(s_x) and float(new.grad_scale[0]) == float(s_g)
    assert float(new.input_history[0]) == float(np.max(np.abs(x)))
    assert float(new.kernel_history[0]) == float(np.max(np.abs(w)))
    assert float(new.grad_history[0]) == float(np.max(np.abs(g)))
    np.testing.assert_array_equal(np.asarray(new.input_history[1:]), [0.0, 2.0, 7.0])


def test_current_scaling_quantizes_each_tensor_with_its_own_amax():
    recipe = leanstep.Fp8Recipe("current", margin=1)
    x, w, g, y, (dx, dw, _) = _matmul_case(recipe, None)
    scale = lambda t: ref_scale(np.max(np.abs(np.asarray(t, np.float32))), np.float32(1.0), "e4m3", 1)
    xq = ref_qdq(x, "e4m3", scale(x), np.float64)
    wq = ref_qdq(w, "e4m3", scale(w), np.float64)
    s_g = ref_scale(np.max(np.abs(np.asarray(g, np.float32))), np.float32(1.0), "e5m2", 1)
    gq = ref_qdq(np.asarray(g), "e5m2", s_g, np.float64)
    np.testing.assert_allclose(np.asarray(y, np.float32), xq @ wq, rtol=BF16_OUT)
    np.testing.assert_allclose(np.asarray(dx, np.float32), gq @ wq.T, rtol=BF16_OUT)
    np.testing.assert_allclose(np.asarray(dw, np.float32), xq.T @ gq, rtol=BF16_OUT)
    assert not np.array_equal(xq, np.asarray(x, np.float32))  # quantized: FP8 loses bits


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scaling": "dynamic"}, "Fp8Recipe.scaling"),
        ({"history": 0}, "Fp8Recipe.history"),
        ({"amax": "mean"}, "Fp8Recipe.amax"),
        ({"margin": -1}, "Fp8Recipe.margin"),
        ({"forward": "e3m4"}, "FP8 format"),
    ],
)
def test_a_bad_recipe_is_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        leanstep.Fp8Recipe(**kwargs)


def test_delayed_scaling_without_a_meta_and_current_scaling_with_one_are_refused():
    x = jnp.ones((2, 2), jnp.bfloat16)
    with pytest.raises(TypeError, match="Fp8Meta.create"):
        leanstep.blocks.fp8_matmul(x, x)
    with pytest.raises(TypeError, match="meta=None"):
        leanstep.blocks.fp8_matmul(x, x, leanstep.blocks.Fp8Meta.create(), leanstep.Fp8Recipe("current"))


# --- FP8 operands reach the dot itself -------------------------------------------------------------


def test_the_forward_and_both_transposes_are_dots_of_fp8_operands():
    # XLA's GPU compiler strips a quantize-dequantize pair around a bf16 dot (no FP8 GEMM, and no
    # FP8 rounding left: benchmarks/fp8_gemm_forms.py on an H200); FP8 operands into the dot stay.
    recipe = leanstep.Fp8Recipe(history=4)
    meta = leanstep.blocks.Fp8Meta.create(recipe)
    x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.bfloat16)
    loss = lambda x, w, m: leanstep.blocks.fp8_matmul(x, w, m, recipe).astype(jnp.float32).sum()
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, w, meta)
    dots = [e for e in equations(jaxpr) if e.primitive.name == "dot_general"]
    operands = sorted(tuple(str(v.aval.dtype) for v in e.invars) for e in dots)
    assert operands == [
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("float8_e5m2", "float8_e4m3fn"),
        ("float8_e5m2", "float8_e4m3fn"),
    ]


@pytest.mark.parametrize(
    ("lhs", "rhs", "dims"),
    [
        ((3, 4), (4, 5), (((1,), (0,)), ((), ()))),
        ((4, 3), (5, 4), (((0,), (1,)), ((), ()))),
        ((2, 3, 4), (2, 4, 5), (((2,), (1,)), ((0,), (0,)))),
        ((2, 6, 3, 4), (3, 4, 7, 2), (((3, 2), (1, 0)), ((0,), (3,)))),
    ],
)
def test_fp8_dot_general_transposes_as_jax_transposes_dot_general(lhs, rhs, dims):
    # Current scaling of integers in [-3, 3] and one 3.5: the scales are powers of two (3.5 / 448,
    # 3.5 / 57344) and every value exact in FP8, so the FP8 matmul and its gradients must be the
    # plain dot_general's exactly, whatever the dimension numbers.
    rng = np.random.default_rng(0)

    def exact(shape):
        values = rng.integers(-3, 4, size=shape).astype(np.float32)
        values.flat[0] = 3.5
        return jnp.asarray(values)

    x, w = exact(lhs), exact(rhs)
    recipe = leanstep.Fp8Recipe("current")
    y, vjp = jax.vjp(lambda a, b: leanstep.blocks.fp8_dot_general(a, b, dims, recipe=recipe), x, w)
    want, want_vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims, precision="highest"), x, w)
    g = exact(y.shape)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    for got, ref in zip(vjp(g), want_vjp(g)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
