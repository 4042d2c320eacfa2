"""Tests for leanstep.blocks.precision: Precision policies, their strings, casts and wrap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.bits import count_differences, leaves_bit_equal
from leanstep.blocks.precision import Precision, get_precision

BF16 = jnp.bfloat16
F32 = jnp.dtype(jnp.float32)


def eager(fn, *args):
    """Op-by-op execution: every bf16 result really is a bf16 array."""
    with jax.disable_jit():
        return fn(*args)


# ------------------------------------------------------------------ Precision

ALL = [jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)]


def test_fields_are_normalized_and_static():
    p = Precision("float32", BF16, np.float32, strict=True)
    assert p.param_dtype == F32 and isinstance(p.param_dtype, np.dtype)
    assert p.compute_dtype == jnp.dtype(BF16) and p.output_dtype == F32
    assert p == Precision(jnp.float32, "bfloat16", jnp.float32, strict=True)
    assert hash(p) == hash(Precision(jnp.float32, "bfloat16", jnp.float32, strict=True))
    # Usable as a static jit argument: its settings reach the trace.
    f = jax.jit(lambda x, prec: prec.cast_to_compute(x), static_argnums=1)
    assert f(jnp.ones(2), p).dtype == jnp.dtype(BF16)
    with pytest.raises(TypeError):
        Precision(F32, F32, F32, True)  # strict is keyword-only
    assert Precision(F32, F32, F32, strict=np.True_).strict is True  # a NumPy bool becomes a bool


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"compute_dtype": jnp.int32}, ValueError, "compute_dtype=int32"),
        ({"param_dtype": jnp.complex64}, ValueError, "param_dtype=complex64"),
        ({"output_dtype": "float8_e4m3fn"}, ValueError, "output_dtype=float8_e4m3fn"),
        ({"output_dtype": object()}, TypeError, "output_dtype=<object"),
        ({"strict": "yes"}, TypeError, "strict must be a bool, got str 'yes'"),
    ],
)
def test_bad_fields_raise(kwargs, error, match):
    fields = {"param_dtype": F32, "compute_dtype": BF16, "output_dtype": F32, **kwargs}
    with pytest.raises(error, match=match):
        Precision(**fields)


def test_casts_touch_only_floating_leaves():
    p = Precision(jnp.float32, jnp.bfloat16, jnp.float16)
    ints, flags, cplx = jnp.arange(3), jnp.array([True, False]), jnp.ones(2, jnp.complex64)
    tree = {
        "f32": jnp.ones(2),
        "f16": jnp.ones(2, jnp.float16),
        "np": np.ones(2, np.float32),
        "ints": ints,
        "flags": flags,
        "cplx": cplx,
        "py": 1.5,
        "none": None,
    }
    for cast, dtype in [
        (p.cast_to_param, F32),
        (p.cast_to_compute, jnp.dtype(BF16)),
        (p.cast_to_output, jnp.dtype(jnp.float16)),
    ]:
        out = cast(tree)
        assert out["f32"].dtype == out["f16"].dtype == out["np"].dtype == dtype
        assert isinstance(out["np"], np.ndarray)  # NumPy stays NumPy (as in jmp)
        assert out["ints"] is ints and out["flags"] is flags and out["cplx"] is cplx
        assert out["py"] == 1.5 and out["none"] is None
    np.testing.assert_array_equal(p.cast_to_compute(jnp.array([1.00390625])), [1.0])


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        # jmp's grammar: params default f32, compute follows params, output follows compute.
        ("p=f32,c=bf16,o=f32", ("float32", "bfloat16", "float32")),
        ("params=float32,compute=bfloat16,output=float32", ("float32", "bfloat16", "float32")),
        ("c=f16", ("float32", "float16", "float16")),
        ("p=f16,c=bf16", ("float16", "bfloat16", "bfloat16")),
        ("p=bf16", ("bfloat16", "bfloat16", "bfloat16")),
        ("o=bf16", ("float32", "float32", "bfloat16")),
        ("p=full,c=half,o=f64", ("float32", "float16", "float64")),
        ("half", ("float16",) * 3),
        ("full", ("float32",) * 3),
        ("bf16", ("bfloat16",) * 3),
        (" P = F32 , C = BFloat16 ", ("float32", "bfloat16", "bfloat16")),
    ],
)
@pytest.mark.parametrize("strict", [False, True])
def test_jmp_strings_parse(spec, expected, strict):
    p = Precision.from_string(spec + (",strict" if strict else ""))
    assert (p.param_dtype.name, p.compute_dtype.name, p.output_dtype.name) == expected
    assert p.strict is strict
    assert get_precision(spec) == Precision(*expected)
    assert get_precision("strict," + spec).strict  # the flag may come first too


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(ALL), st.sampled_from(ALL), st.sampled_from(ALL), st.booleans())
def test_string_round_trip(param, compute, output, strict):
    p = Precision(param, compute, output, strict=strict)
    assert Precision.from_string(str(p)) == p
    assert get_precision(str(p)) == p and get_precision(p) is p
    assert str(p).endswith(",strict") == strict


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("p=f32,c=bf8", r"unknown dtype name 'bf8'.*expected one of .*bfloat16"),
        ("param=f32", r"unknown key 'param'.*expected one of p, params"),
        ("p=f32,c=", r"unknown dtype name ''"),
        ("int8", r"unknown dtype name 'int8'"),
        ("p=f32,params=bf16", r"key 'params' sets param_dtype twice"),
        ("p=f32,,c=bf16", r"empty part"),
        ("", r"empty part"),
        ("bf16,c=f32", r"bare dtype 'bf16'"),
        ("strict", r"no dtype"),
        ("bf16,strict,strict", r"'strict' more than once"),
    ],
)
def test_bad_strings_name_the_bad_part(spec, match):
    with pytest.raises(ValueError, match=match):
        Precision.from_string(spec)


def test_non_string_specs_raise_type_error():
    with pytest.raises(TypeError, match="spec=3"):
        Precision.from_string(3)
    with pytest.raises(TypeError, match="spec=None"):
        get_precision(None)


def test_wrap_applies_strict_only_when_asked():
    def f(a, b):
        return (a.astype(BF16) * b.astype(BF16) + BF16(1)).astype(jnp.float32)

    assert Precision(F32, BF16, F32).wrap(f) is f
    wrapped = Precision(F32, BF16, F32, strict=True).wrap(f)
    a = jnp.linspace(1, 2, 64)
    assert wrapped.__name__ == "f"
    leaves_bit_equal(jax.jit(wrapped)(a, a), eager(f, a, a))
    assert count_differences(jax.jit(f)(a, a), eager(f, a, a)) > 0
