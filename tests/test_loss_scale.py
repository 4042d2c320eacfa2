"""Tests for leanstep.blocks.loss_scale: the state machine against a plain-Python model."""

import dataclasses
import re
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.chip import TPU_DIVISION_ULPS, on_tpu
from helpers.loss_scale_settings import CUSTOM, settings_of
from leanstep.blocks.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
)

F32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = 2**31 - 1
adjust_jit = jax.jit(lambda state, finite: state.adjust(finite))
identity_jit = jax.jit(lambda state: state)


def state_tuple(state):
    return float(state.loss_scale), int(state.good_steps), int(state.bad_steps)


# ---------------------------------------------------------------- plain-Python reference model


def round_f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def model_adjust(scale, good, bad, finite, cfg):
    """The documented rule on plain floats and ints.

    A float64 product of two float32 values is exact, and clamping to a float32 bound before
    rounding equals rounding before clamping, so ``round_f32`` once gives float32 arithmetic.
    """
    if finite:
        good, bad = good + 1, 0
        if good >= cfg["growth_interval"]:
            scale = round_f32(min(scale * cfg["growth_factor"], cfg["max_loss_scale"]))
            good = 0
    else:
        good, bad = 0, bad + 1
        if bad >= cfg["hysteresis"]:
            scale = round_f32(max(scale * cfg["backoff_factor"], cfg["min_loss_scale"]))
            bad = 0
    return scale, good, bad


@jax.jit
def run_scan(state, finites):
    def body(carry, finite):
        carry = carry.adjust(finite)
        return carry, (carry.loss_scale, carry.good_steps, carry.bad_steps)

    return jax.lax.scan(body, state, finites)


settings_strategy = st.fixed_dictionaries(
    dict(
        growth_interval=st.integers(1, 8),
        growth_factor=st.sampled_from([2.0, 1.5, 3.0, 1.1, 4.0]),
        backoff_factor=st.sampled_from([0.5, 0.25, 0.9, 1 / 3]),
        min_loss_scale=st.sampled_from([1.0, 0.5, 1.7, 2.0**-20]),
        max_loss_scale=st.sampled_from([2.0**8, 1000.0, 2.0**24, F32_MAX]),
        hysteresis=st.integers(1, 4),
    )
)


@settings(max_examples=40, deadline=None)
@given(
    cfg=settings_strategy,
    unit=st.floats(0.0, 1.0),
    counters=st.tuples(st.integers(0, 7), st.integers(0, 3)),
    p_finite=st.sampled_from([0.5, 0.8, 0.95]),
    seed=st.integers(0, 2**32 - 1),
)
def test_adjust_matches_python_model_over_long_sequences(cfg, unit, counters, p_finite, seed):
    # Float settings are documented to be applied rounded to float32.
    cfg = {k: round_f32(v) if isinstance(v, float) else v for k, v in cfg.items()}
    lo, hi = cfg["min_loss_scale"], cfg["max_loss_scale"]
    initial = lo * (hi / lo) ** unit  # log-uniform in [lo, hi]
    state = DynamicLossScale.create(min(max(initial, lo), hi), **cfg)
    good, bad = counters[0] % cfg["growth_interval"], counters[1] % cfg["hysteresis"]
    state = dataclasses.replace(state, good_steps=jnp.int32(good), bad_steps=jnp.int32(bad))
    finites = np.random.default_rng(seed).random(256) < p_finite

    final, (scales, goods, bads) = run_scan(state, jnp.asarray(finites))

    scales, goods, bads = np.asarray(scales), np.asarray(goods), np.asarray(bads)
    scale = float(state.loss_scale)
    for step, finite in enumerate(finites.tolist()):
        scale, good, bad = model_adjust(scale, good, bad, finite, cfg)
        assert (float(scales[step]), int(goods[step]), int(bads[step])) == (scale, good, bad), step
    assert state_tuple(final) == (scale, good, bad)
    assert np.all(np.isfinite(scales))
    assert np.all(scales >= np.float32(lo)) and np.all(scales <= np.float32(hi))
    assert settings_of(final) == settings_of(state)


# ---------------------------------------------------------------- settings survive transformations


def test_settings_survive_jit_scan_tree_map_and_vmap():
    state = DynamicLossScale.create(8.0, **CUSTOM)
    expected = settings_of(state)
    assert expected == CUSTOM

    jitted = identity_jit(state)
    adjusted = adjust_jit(state, jnp.array(True))
    scanned, _ = jax.lax.scan(lambda s, f: (s.adjust(f), None), state, jnp.array([True, False]))
    mapped = jax.tree.map(lambda x: x + 0, state)
    batched = jax.tree.map(lambda x: jnp.stack([x, x]), state)
    vmapped = jax.vmap(lambda s, f: s.adjust(f))(batched, jnp.array([True, False]))
    for out in (jitted, adjusted, scanned, mapped, vmapped):
        assert type(out) is DynamicLossScale
        assert settings_of(out) == expected


def test_settings_survive_jit_in_behaviour():
    # jmp's bug: a round trip reset min_loss_scale to its default. Here the floor is 0.5,
    # so backing off from 0.5 must stay at 0.5 (the default floor 1.0 would give 1.0).
    state = identity_jit(DynamicLossScale.create(0.5, **CUSTOM))
    for _ in range(4):
        state = adjust_jit(state, jnp.array(False))
    assert state_tuple(state) == (0.5, 0, 0)
    # Ceiling 4096 and factor 3: 2048 grows to 4096, not to 6144.
    state = identity_jit(dataclasses.replace(state, loss_scale=jnp.float32(2048.0)))
    for _ in range(3):
        state = adjust_jit(state, jnp.array(True))
    assert state_tuple(state) == (4096.0, 0, 0)


def test_unflatten_with_placeholder_leaves_does_not_validate_data():
    state = DynamicLossScale.create(8.0, **CUSTOM)
    as_none = jax.tree.map(lambda _: None, state)
    assert as_none.loss_scale is None and settings_of(as_none) == CUSTOM
    treedef = jax.tree.structure(state)
    rebuilt = jax.tree.unflatten(treedef, [object()] * treedef.num_leaves)
    assert settings_of(rebuilt) == CUSTOM


def test_create_accepts_a_traced_initial_scale():
    out = jax.jit(lambda s: DynamicLossScale.create(s, **CUSTOM).adjust(jnp.array(False)))(jnp.float32(64.0))
    assert state_tuple(out) == (64.0, 0, 1)  # hysteresis 2: the first overflow is tolerated


def test_static_and_noop_round_trip_and_are_loss_scales():
    static = StaticLossScale.create(256.0)
    scanned, _ = jax.lax.scan(lambda s, f: (s.adjust(f), None), static, jnp.array([True, False]))
    assert float(identity_jit(static).loss_scale) == 256.0 == float(scanned.loss_scale)
    noop = identity_jit(NoOpLossScale())
    assert type(noop) is NoOpLossScale and jax.tree.leaves(noop) == []
    for loss_scale in (static, noop, DynamicLossScale.create()):
        assert isinstance(loss_scale, LossScale)
        assert loss_scale.loss_scale.dtype == jnp.float32


# ---------------------------------------------------------------- the seed rule's edge cases


def seed_state(loss_scale, good_steps, growth_interval):
    """As the seed's step builds it: traced scale and count, max at float32's maximum."""
    return DynamicLossScale(
        loss_scale=jnp.float32(loss_scale),
        good_steps=jnp.int32(good_steps),
        bad_steps=jnp.int32(0),
        growth_interval=growth_interval,
        max_loss_scale=F32_MAX,
    )


@pytest.mark.parametrize(
    "scale, good, interval, finite, expected",
    [
        (1024.0, 0, 2, True, (1024.0, 1)),  # seed example 1: count below the interval
        (512.0, 2, 3, True, (1024.0, 0)),  # seed example 2: count reaches 3, doubles, resets
        (1024.0, 1, 2, True, (2048.0, 0)),
        (1024.0, 1, 3, True, (1024.0, 2)),
        (3e38, 0, 2, False, (float(np.float32(3e38)) / 2, 0)),  # seed example 3
        (3e38, 1, 2, True, (F32_MAX, 0)),  # 6e38 overflows float32; capped, not inf
        (F32_MAX, 1, 2, True, (F32_MAX, 0)),
        (1.5, 0, 2, False, (1.0, 0)),  # halving floors at 1.0
        (1.0, 1, 2, False, (1.0, 0)),  # floor holds; good_steps reset
        (3.0, 2, 3, False, (1.5, 0)),
        (0.5, 0, 2, False, (1.0, 0)),  # below the floor: halving is lifted to 1.0
    ],
)
def test_seed_rule_edge_cases(scale, good, interval, finite, expected):
    out = adjust_jit(seed_state(scale, good, interval), jnp.array(finite))
    assert (float(out.loss_scale), int(out.good_steps)) == expected
    assert int(out.bad_steps) == 0
    assert out.loss_scale.dtype == jnp.float32 and out.good_steps.dtype == jnp.int32


def test_counters_saturate_instead_of_wrapping():
    base = DynamicLossScale.create(8.0, growth_interval=INT32_MAX, hysteresis=INT32_MAX, max_loss_scale=F32_MAX)
    full = dataclasses.replace(base, good_steps=jnp.int32(INT32_MAX), bad_steps=jnp.int32(INT32_MAX))
    # A wrapped count would be negative and never reach the interval.
    assert state_tuple(adjust_jit(full, jnp.array(True))) == (16.0, 0, 0)
    assert state_tuple(adjust_jit(full, jnp.array(False))) == (4.0, 0, 0)


def test_hysteresis_tolerates_consecutive_overflows_only():
    state = DynamicLossScale.create(64.0, hysteresis=3)
    trace = []
    for finite in (False, False, True, False, False, False):
        state = adjust_jit(state, jnp.array(finite))
        trace.append(state_tuple(state))
    assert trace == [(64.0, 0, 1), (64.0, 0, 2), (64.0, 1, 0), (64.0, 0, 1), (64.0, 0, 2), (32.0, 0, 0)]


@pytest.mark.parametrize("loss_scale", [DynamicLossScale.create(), StaticLossScale.create(2.0), NoOpLossScale()])
def test_adjust_rejects_non_bool_or_non_scalar_flags(loss_scale):
    with pytest.raises(ValueError, match=r"grads_finite must be a scalar, got shape \(2,\)"):
        loss_scale.adjust(jnp.array([True, False]))
    with pytest.raises(TypeError, match="grads_finite must be a bool array, got dtype int32"):
        loss_scale.adjust(jnp.int32(1))


# ---------------------------------------------------------------- all_finite


def reference_all_finite(tree):
    floats = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return all(bool(np.isfinite(np.asarray(x, np.float64)).all()) for x in floats)


FLOAT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@settings(max_examples=40, deadline=None)
@given(
    dtypes=st.lists(st.sampled_from(FLOAT_DTYPES), min_size=3, max_size=3),
    shape=st.sampled_from([(), (3,), (2, 3)]),
    poison=st.sampled_from([None, np.nan, np.inf, -np.inf]),
    target=st.integers(0, 2),
    position=st.integers(0, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_all_finite_matches_numpy(dtypes, shape, poison, target, position, seed):
    rng = np.random.default_rng(seed)
    leaves = [rng.normal(size=shape).astype(np.float32) for _ in dtypes]
    if poison is not None:
        flat = leaves[target].reshape(-1)
        flat[position % flat.size] = poison
        leaves[target] = flat.reshape(shape)
    leaves = [jnp.asarray(x, dtype) for x, dtype in zip(leaves, dtypes)]
    tree = {"a": leaves[0], "b": [leaves[1], jnp.int32(INT32_MAX)], "c": (leaves[2],)}
    got = all_finite(tree)
    assert got.dtype == jnp.bool_ and got.shape == ()
    assert bool(got) == reference_all_finite(tree) == (poison is None)


def test_all_finite_ignores_non_float_leaves_and_accepts_empty_trees():
    assert bool(all_finite({})) and bool(all_finite([None]))
    assert bool(all_finite({"i": jnp.arange(3), "b": jnp.array([True, False])}))
    assert not bool(all_finite({"i": jnp.arange(3), "x": jnp.array([1.0, np.nan], jnp.float16)}))
    assert not bool(jax.jit(all_finite)({"x": jnp.float32(1.0), "y": jnp.full((2,), -jnp.inf)}))


# ---------------------------------------------------------------- scale and unscale


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    exponent=st.integers(0, 10),
    seed=st.integers(0, 2**32 - 1),
)
def test_unscale_keeps_dtypes_and_is_exact_for_powers_of_two(dtype, exponent, seed):
    # Magnitudes in [2**-4, 2**10] keep x / 2**10 a normal number even in float16.
    rng = np.random.default_rng(seed)
    values = rng.choice([-1.0, 1.0], size=(2, 3)) * 2.0 ** rng.uniform(-4, 10, size=(2, 3))
    grads = {"w": jnp.asarray(values, dtype), "count": jnp.arange(3)}
    out = DynamicLossScale.create(2.0**exponent).unscale(grads)
    assert out["w"].dtype == dtype and out["count"] is grads["count"]
    np.testing.assert_array_equal(np.asarray(out["w"], np.float64) * 2.0**exponent, np.asarray(grads["w"], np.float64))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("loss_scale", [3.0, 1000.0, 12345.678, 2.0**64])
def test_unscale_multiplies_by_the_float32_reciprocal(dtype, loss_scale):
    values = np.array([[1.0, -7.5, 300.0], [0.3, 42.0, -1e3]])
    out = StaticLossScale.create(loss_scale).unscale(jnp.asarray(values, dtype))
    # NumPy float32: the leaf widened to float32, times fl32(1 / S), cast back to the dtype.
    inverse = np.float32(1.0) / np.float32(loss_scale)
    expected = (np.asarray(values, dtype).astype(np.float32) * inverse).astype(dtype)
    assert out.dtype == dtype
    if on_tpu() and jnp.dtype(dtype) == jnp.float32:  # the chip's float32 division is not correctly rounded
        np.testing.assert_array_max_ulp(np.asarray(out), expected, maxulp=TPU_DIVISION_ULPS)
        return
    np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(expected, np.float64))


@pytest.mark.parametrize("loss_scale", [3e38, F32_MAX, 2.0**127, 2.0**64 * 3])
def test_unscale_by_a_huge_scale_does_not_flush_to_zero(loss_scale):
    # 1 / 3e38 is a float32 denormal that XLA flushes to zero, and XLA turns x / S into
    # x * (1 / S), so a plain reciprocal or division would give exactly 0 here.
    grads = jnp.array([1e30, -3e35, 7e20], jnp.float32)
    out = np.asarray(jax.jit(lambda s, g: s.unscale(g))(StaticLossScale.create(loss_scale), grads))
    exact = np.asarray(grads, np.float64) / np.float64(np.float32(loss_scale))
    np.testing.assert_allclose(out, exact, rtol=2.0**-22, atol=0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_scale_keeps_the_loss_dtype(dtype):
    loss = jnp.asarray(0.375, dtype)
    out = DynamicLossScale.create(1024.0).scale(loss)
    assert out.dtype == dtype and float(out) == 384.0
    assert StaticLossScale.create(3.0).scale(1.1).dtype == jnp.float32
    with pytest.raises(TypeError, match="loss must be a floating array, got dtype int32"):
        StaticLossScale.create(3.0).scale(jnp.int32(2))


def test_noop_returns_inputs_unchanged():
    loss, grads = jnp.float32(2.5), {"w": jnp.ones(2, jnp.bfloat16)}
    noop = NoOpLossScale()
    assert noop.scale(loss) is loss and noop.unscale(grads) is grads
    assert noop.adjust(jnp.array(False)) is noop and float(noop.loss_scale) == 1.0


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(growth_interval=0), ValueError, "growth_interval must be an int in [1, 2**31 - 1], got 0"),
        (dict(growth_interval=2**31), ValueError, "growth_interval must be an int in [1, 2**31 - 1], got 2147483648"),
        (dict(growth_interval=1.5), TypeError, "growth_interval must be an int, got float 1.5"),
        (dict(growth_interval=True), TypeError, "growth_interval must be an int, got bool True"),
        (dict(growth_factor=1.0), ValueError, "growth_factor must be > 1 in float32, got 1.0"),
        (dict(growth_factor=1 + 1e-9), ValueError, "growth_factor must be > 1 in float32, got 1.000000001"),
        (dict(growth_factor=float("inf")), ValueError, "growth_factor must be finite in float32"),
        (dict(growth_factor="2"), TypeError, "growth_factor must be a real number, got str '2'"),
        (dict(backoff_factor=0.0), ValueError, "backoff_factor must be in (0, 1) in float32, got 0.0"),
        (dict(backoff_factor=1.0), ValueError, "backoff_factor must be in (0, 1) in float32, got 1.0"),
        (
            dict(backoff_factor=float("nan")),
            ValueError,
            "backoff_factor must be finite in float32 (|x| <= 3.402823e+38), got nan",
        ),
        (
            dict(min_loss_scale=0.0),
            ValueError,
            "min_loss_scale must be >= 1.175494e-38 (smallest normal float32), got 0.0",
        ),
        (dict(min_loss_scale=-1.0), ValueError, "min_loss_scale must be >= "),
        (dict(min_loss_scale=1e-40), ValueError, "got 1e-40"),
        (
            dict(max_loss_scale=float("inf")),
            ValueError,
            "max_loss_scale must be finite in float32 (|x| <= 3.402823e+38), got inf",
        ),
        (
            dict(max_loss_scale=1e39),
            ValueError,
            "max_loss_scale must be finite in float32 (|x| <= 3.402823e+38), got 1e+39",
        ),
        (dict(max_loss_scale=0.5), ValueError, "max_loss_scale must be >= min_loss_scale=1.0, got 0.5"),
        (dict(hysteresis=0), ValueError, "hysteresis must be an int in [1, 2**31 - 1], got 0"),
        (dict(hysteresis=2.0), TypeError, "hysteresis must be an int, got float 2.0"),
        (dict(initial_scale=0.0), ValueError, "initial_scale must be finite and > 0 in float32, got 0.0"),
        (dict(initial_scale=-4), ValueError, "initial_scale must be finite and > 0 in float32, got -4.0"),
        (dict(initial_scale=float("nan")), ValueError, "initial_scale must be finite and > 0 in float32, got nan"),
        (dict(initial_scale=1e39), ValueError, "initial_scale must be finite and > 0 in float32, got 1e+39"),
        (
            dict(initial_scale=2.0**25),
            ValueError,
            "initial_scale must be in [min_loss_scale=1.0, max_loss_scale=16777216.0], got 33554432.0",
        ),
        (
            dict(initial_scale=0.5),
            ValueError,
            "initial_scale must be in [min_loss_scale=1.0, max_loss_scale=16777216.0], got 0.5",
        ),
        (dict(initial_scale=[1.0, 2.0]), ValueError, "initial_scale must be a scalar, got shape (2,)"),
        (dict(initial_scale=True), TypeError, "initial_scale must be a real number, got bool True"),
    ],
)
def test_create_rejects_bad_settings_naming_them(kwargs, error, text):
    with pytest.raises(error, match=re.escape(text)):
        DynamicLossScale.create(**kwargs)


def test_constructor_validates_settings_too():
    with pytest.raises(ValueError, match=re.escape("backoff_factor must be in (0, 1) in float32, got 2.0")):
        DynamicLossScale(jnp.float32(1.0), jnp.int32(0), jnp.int32(0), backoff_factor=2.0)


def test_settings_are_stored_rounded_to_float32():
    state = DynamicLossScale.create(growth_factor=1.1, min_loss_scale=0.1)
    assert state.growth_factor == float(np.float32(1.1)) != 1.1
    assert state.min_loss_scale == float(np.float32(0.1))
    assert type(state.growth_interval) is int and type(state.growth_factor) is float


def test_static_create_validates():
    with pytest.raises(ValueError, match=re.escape("loss_scale must be finite and > 0 in float32, got inf")):
        StaticLossScale.create(float("inf"))


def test_a_created_dynamic_scale_can_be_donated_to_a_step():
    """Its good and bad step counts are two arrays: one zero array in both fields was refused by a
    donating step ("Attempt to donate the same buffer twice")."""
    import optax

    import leanstep

    state = leanstep.TrainState.create({"w": jnp.ones((2, 1))}, optax.sgd(0.1))
    state = state.replace(loss_scale=DynamicLossScale.create(8.0))
    step = leanstep.make_train_step(lambda p, b: jnp.sum((b["x"] @ p["w"]) ** 2), donate=True)
    state, metrics = step(state, {"x": jnp.ones((4, 2))})
    assert int(state.step) == 1 and not bool(metrics.skipped)
