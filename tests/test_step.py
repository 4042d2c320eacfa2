"""Tests for leanstep.step.train_step: every claim of the composed step against an independent reference.

References: full-batch ``jax.value_and_grad`` + optax written out by hand, float64 NumPy, a
plain-Python model of the dynamic loss scale, and the step's own jaxpr (``jit=False``) for
claims about *where* things happen. Steps donate their state, so whatever a test compares is
copied to the host *before* the call (:func:`snapshot`).
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend import core as jex_core

from helpers.chip import TPU_TRANSCENDENTAL_TOLERANCE, float32_matmuls, on_tpu
from leanstep.blocks.clipping import clip_by_global_norm_transform
from leanstep.blocks.loss_scale import DynamicLossScale, StaticLossScale
from leanstep.common.jaxprs import scan_operands
from leanstep.step.state import StepMetrics, TrainState
from leanstep.step.train_step import make_train_step

F32_MAX = float(np.finfo(np.float32).max)
BATCH = 12

# --- shared model, data and helpers ----------------------------------------------------------


def mlp(params: dict, x: jax.Array) -> jax.Array:
    # Rank promotion is an error in the test setup, so bias broadcasts are spelled out.
    hidden = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    return hidden @ params["w2"] + params["b2"][None, :]


def mse_loss(params: dict, batch: dict) -> jax.Array:
    return jnp.mean((mlp(params, batch["x"]) - batch["y"]) ** 2)


def compute_dtype_loss(params: dict, batch: dict) -> jax.Array:
    """``mse_loss`` with the inputs cast to the parameters' (compute) dtype and a float32 error;
    the step casts parameters only, the batch is passed as given."""
    x = batch["x"].astype(params["w1"].dtype)
    return jnp.mean((mlp(params, x).astype(jnp.float32) - batch["y"]) ** 2)


def init_mlp(seed: int = 0, sizes: tuple[int, int, int] = (3, 4, 2)) -> dict:
    rng = np.random.default_rng(seed)
    d_in, d_hidden, d_out = sizes
    return {
        "w1": rng.normal(size=(d_in, d_hidden)).astype(np.float32) / np.sqrt(d_in),
        "b1": rng.normal(size=(d_hidden,)).astype(np.float32) * 0.1,
        "w2": rng.normal(size=(d_hidden, d_out)).astype(np.float32) / np.sqrt(d_hidden),
        "b2": np.zeros((d_out,), np.float32),
    }


def make_batch(seed: int, size: int = BATCH, d_in: int = 3, d_out: int = 2) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(size, d_in)).astype(np.float32)
    y = np.sin(x @ rng.normal(size=(d_in, d_out))).astype(np.float32)
    return {"x": x, "y": y}


def mse_float64(params: dict, batch: dict) -> float:
    """``mse_loss`` in float64 NumPy."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    hidden = np.tanh(np.asarray(batch["x"], np.float64) @ p["w1"] + p["b1"])
    return float(np.mean((hidden @ p["w2"] + p["b2"] - batch["y"]) ** 2))


def filled(abstract, seed: int = 0):
    """Random float32 values for a tree of ``jax.ShapeDtypeStruct`` (no op-by-op init to compile)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (0.5 * rng.normal(size=s.shape)).astype(np.float32), abstract)


def snapshot(tree):
    """Host copies of every leaf: a donating step deletes the buffers it was given."""
    return jax.tree.map(lambda leaf: np.array(leaf, copy=True), tree)


def assert_bit_identical(actual, expected) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype and a.shape == e.shape
        assert np.array_equal(a, e) and a.tobytes() == e.tobytes()


def assert_trees_close(actual, expected, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def microbatch(batch: dict, num_microbatches: int, index: int) -> dict:
    rows = jax.tree.leaves(batch)[0].shape[0] // num_microbatches
    return jax.tree.map(lambda leaf: leaf[index * rows : (index + 1) * rows], batch)


def grad_probe(learning_rate: float = 1.0) -> optax.GradientTransformation:
    """SGD that keeps the gradient it was handed in its state: reads the step's gradient exactly."""

    def init(params):
        return {"grad": jax.tree.map(jnp.zeros_like, params)}

    def update(grads, state, params=None):
        del state, params
        return jax.tree.map(lambda g: -learning_rate * g, grads), {"grad": grads}

    return optax.GradientTransformation(init, update)


def reference_step(loss_fn, optimizer):
    """The hand-written full-batch step: value_and_grad on the whole batch, then optax."""

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


# --- 1. order, read from the jaxpr of the un-jitted step ------------------------------------


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, jex_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jex_core.Jaxpr):
                yield item


def _eqns(jaxpr, *, into_scan: bool = True):
    """Every equation, recursively; with ``into_scan=False`` scan bodies are not entered."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "scan" and not into_scan:
            continue
        for sub in _sub_jaxprs(eqn):
            yield from _eqns(sub, into_scan=into_scan)


_CONSTANT = (False, True, False)  # (depends on the scale, only on scale and constants, holds 1/scale)


def _reciprocal_events(jaxpr, flags_in, inside_scan=False, events=None):
    """Follows the loss scale through ``jaxpr``; records where a reciprocal of it is formed.

    Each variable carries ``(dep, pure, recip)``: it depends on the scale; it depends on the
    scale and constants only; it was derived from ``1 / f(scale)``. An event is
    ``("recip", inside_scan)`` for a division by a pure function of the scale (or a negative
    power of one), and ``("recip_into_scan", True)`` for such a value handed to a scan.
    """
    events = [] if events is None else events
    env = dict(zip(jaxpr.invars, flags_in))
    env.update({v: _CONSTANT for v in jaxpr.constvars})

    def read(atom):
        return _CONSTANT if isinstance(atom, jex_core.Literal) else env[atom]

    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        dep, pure, recip = any(f[0] for f in ins), all(f[1] for f in ins), any(f[2] for f in ins)
        subs = list(_sub_jaxprs(eqn))
        name = eqn.primitive.name
        if subs:
            in_scan = inside_scan or name == "scan"
            if name == "scan" and recip:
                events.append(("recip_into_scan", True))
            outs = None
            for sub in subs:
                if len(sub.invars) == len(ins):
                    mapped = ins
                elif len(sub.invars) == len(ins) - 1:  # cond: the branch index is not passed on
                    mapped = ins[1:]
                else:
                    mapped = [(dep, False, recip)] * len(sub.invars)
                sub_outs = _reciprocal_events(sub, mapped, in_scan, events)
                if name != "scan" and len(sub_outs) == len(eqn.outvars) and len(subs) == 1:
                    outs = sub_outs
            if outs is None:
                outs = [(dep, False, recip)] * len(eqn.outvars)
            env.update(zip(eqn.outvars, outs))
            continue
        scale_only = lambda f: f[0] and f[1]
        if (name == "div" and scale_only(ins[1])) or (
            name in ("integer_pow", "pow", "rsqrt")
            and scale_only(ins[0])
            and (name != "integer_pow" or eqn.params["y"] < 0)
        ):
            events.append(("recip", inside_scan))
            recip = True
        env.update({v: (dep, pure, recip) for v in eqn.outvars})
    return [read(a) for a in jaxpr.outvars]


def _scale_events(fn, args, scale_leaf):
    closed = jax.make_jaxpr(fn)(*args)
    leaves = jax.tree.leaves(args)
    (index,) = [i for i, leaf in enumerate(leaves) if leaf is scale_leaf]
    flags = [(i == index, i == index, False) for i in range(len(leaves))]
    events = []
    _reciprocal_events(closed.jaxpr, flags, events=events)
    return events


def test_reciprocal_tracker_catches_unscaling_inside_a_scan():
    # The checker used below must be able to fail: unscaling per scan step, or handing 1/S
    # to the scan, are both reported; unscaling after the scan is the only clean case.
    scale, xs = jnp.float32(8.0), jnp.arange(3.0)

    def inside(scale, xs):
        return jax.lax.scan(lambda c, x: (c + (x * scale) * (1.0 / scale), None), 0.0, xs)[0]

    def handed_in(scale, xs):
        inverse = 1.0 / scale
        return jax.lax.scan(lambda c, x: (c + x * scale * inverse, None), 0.0, xs)[0]

    def after(scale, xs):
        return jax.lax.scan(lambda c, x: (c + x * scale, None), 0.0, xs)[0] / scale

    assert ("recip", True) in _scale_events(inside, (scale, xs), scale)
    assert ("recip_into_scan", True) in _scale_events(handed_in, (scale, xs), scale)
    assert _scale_events(after, (scale, xs), scale) == [("recip", False)]


@pytest.mark.parametrize("num_microbatches", [2, 4])
def test_jaxpr_one_scan_with_grad_inside_in_compute_dtype_float32_carry(num_microbatches):
    seen = []

    def loss_fn(params, batch):
        seen.append({k: v.dtype for k, v in params.items()})
        return compute_dtype_loss(params, batch)

    opt = optax.adamw(1e-3)
    state = TrainState.create(init_mlp(), opt, loss_scale="dynamic")
    step = make_train_step(
        loss_fn,
        precision="params=float32,compute=bfloat16,output=float32",
        num_microbatches=num_microbatches,
        max_grad_norm=1.0,
        jit=False,
    )
    closed = jax.make_jaxpr(step)(state, make_batch(0))
    scans = [e for e in _eqns(closed.jaxpr) if e.primitive.name == "scan"]
    assert len(scans) == 1
    (scan,) = scans
    assert scan.params["length"] == num_microbatches
    outside = [e.primitive.name for e in _eqns(closed.jaxpr, into_scan=False)]
    assert "dot_general" not in outside
    body_dots = [e for e in _eqns(scan.params["jaxpr"].jaxpr) if e.primitive.name == "dot_general"]
    # Forward and backward matmuls of both layers: value_and_grad runs inside the body,
    # on parameters already cast to the compute dtype.
    assert len(body_dots) >= 4
    for eqn in body_dots:
        assert {v.aval.dtype for v in eqn.invars} == {jnp.dtype(jnp.bfloat16)}
    assert seen and all(set(d.values()) == {jnp.dtype(jnp.bfloat16)} for d in seen)
    num_carry = len(scan_operands(scan)[1])
    carry_dtypes = [v.aval.dtype for v in scan.outvars[:num_carry]]
    assert carry_dtypes and all(d == jnp.float32 for d in carry_dtypes if jnp.issubdtype(d, jnp.floating))
    # The gradient accumulator is among the carries: one float32 array per parameter shape.
    carry_shapes = sorted(v.aval.shape for v in scan.outvars[:num_carry] if v.aval.shape)
    assert carry_shapes == sorted(np.shape(p) for p in init_mlp().values())


def test_one_microbatch_runs_without_a_scan():
    """A one-step scan costs a loop (6x for convolutions on XLA:CPU): with M = 1 there is none,
    and the same forward and backward matmuls run, once, in the compute dtype."""
    state = TrainState.create(init_mlp(), optax.adamw(1e-3), loss_scale="dynamic")
    kw = dict(precision="compute=bfloat16", max_grad_norm=1.0, jit=False)
    one = jax.make_jaxpr(make_train_step(compute_dtype_loss, num_microbatches=1, **kw))(state, make_batch(0))
    two = jax.make_jaxpr(make_train_step(compute_dtype_loss, num_microbatches=2, **kw))(state, make_batch(0))
    assert not [e for e in _eqns(one.jaxpr) if e.primitive.name in ("scan", "while")]
    dots = [e for e in _eqns(one.jaxpr) if e.primitive.name == "dot_general"]
    (scan,) = [e for e in _eqns(two.jaxpr) if e.primitive.name == "scan"]
    assert len(dots) == len([e for e in _eqns(scan.params["jaxpr"].jaxpr) if e.primitive.name == "dot_general"])
    assert all({v.aval.dtype for v in e.invars} == {jnp.dtype(jnp.bfloat16)} for e in dots)


def test_unscale_happens_once_after_the_scan():
    opt = optax.sgd(0.1)
    state = TrainState.create(init_mlp(), opt, loss_scale=StaticLossScale.create(3.0))
    step = make_train_step(mse_loss, precision="compute=bfloat16", num_microbatches=3, max_grad_norm=1.0, jit=False)
    events = _scale_events(step, (state, make_batch(0)), state.loss_scale.loss_scale)
    assert ("recip", False) in events  # the unscale exists, outside the scan
    assert ("recip", True) not in events
    assert ("recip_into_scan", True) not in events


def test_gradients_accumulate_in_float32():
    # 16 bfloat16 microbatch gradients: summed in bfloat16 they lose ~5e-4, in float32 nothing.
    values = np.random.default_rng(0).uniform(1.0, 2.0, 16).astype(ml_dtypes.bfloat16)

    def loss_fn(params, batch):
        return jnp.mean(batch["x"].astype(params["w"].dtype) * params["w"])

    opt = grad_probe()
    state = TrainState.create({"w": jnp.ones((1,))}, opt)
    step = make_train_step(loss_fn, precision="compute=bfloat16", num_microbatches=16)
    state, _ = step(state, {"x": values.astype(np.float32)})
    float32_sum = float(np.float32(np.sum(values.astype(np.float64)) / 16))
    bfloat16_sum = ml_dtypes.bfloat16(0)
    for value in values:
        bfloat16_sum = ml_dtypes.bfloat16(float(bfloat16_sum) + float(value))
    assert abs(float(bfloat16_sum) / 16 - float32_sum) > 1e-4  # the case tells them apart
    np.testing.assert_allclose(np.asarray(state.opt_state["grad"]["w"]), [float32_sum], rtol=1e-7)


# --- 2. k microbatches == one full batch -----------------------------------------------------

OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2)}


@pytest.fixture(scope="module", params=sorted(OPTIMIZERS))
def full_batch_trajectory(request):
    """Params after each of 3 hand-written full-batch steps (one compile per optimizer)."""
    opt = OPTIMIZERS[request.param]()
    ref = reference_step(mse_loss, opt)
    params, opt_state = jax.tree.map(jnp.asarray, init_mlp()), opt.init(init_mlp())
    trajectory = []
    with float32_matmuls():  # as the test that compares with it (module scope: outside its marker)
        for t in range(3):
            params, opt_state, loss = ref(params, opt_state, make_batch(t))
            trajectory.append((snapshot(params), snapshot(opt_state), float(loss)))
    return request.param, trajectory


@pytest.mark.float32_matmuls
@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 4, 6, 12])
def test_microbatches_match_full_batch(full_batch_trajectory, num_microbatches):
    name, trajectory = full_batch_trajectory
    opt = OPTIMIZERS[name]()
    state = TrainState.create(init_mlp(), opt)
    step = make_train_step(mse_loss, num_microbatches=num_microbatches)
    for t, (params, opt_state, loss) in enumerate(trajectory):
        state, metrics = step(state, make_batch(t))
        assert_trees_close(state.params, params)
        assert_trees_close(state.opt_state, opt_state)
        np.testing.assert_allclose(float(metrics.loss), loss, rtol=1e-5)
        assert not bool(metrics.skipped)


# --- 3. clipping after accumulation, of the unscaled gradient ---------------------------------


def test_clipping_is_of_the_accumulated_unscaled_gradient():
    # Microbatch gradients (10, 0) and (-6, 8): mean (2, 4), norm sqrt(20).
    def loss_fn(params, batch):
        return jnp.mean(batch["x"] @ params["w"])

    x = np.array([[10.0, 0.0], [10.0, 0.0], [-6.0, 8.0], [-6.0, 8.0]], np.float32)
    opt = grad_probe()
    state = TrainState.create({"w": jnp.zeros(2)}, opt, loss_scale=StaticLossScale.create(2.0**12))
    step = make_train_step(loss_fn, num_microbatches=2, max_grad_norm=1.0)
    state, metrics = step(state, {"x": x})

    full = x.astype(np.float64).mean(axis=0)
    after_accumulation = full * min(1.0, 1.0 / np.linalg.norm(full))
    per_microbatch = np.mean([g * min(1.0, 1.0 / np.linalg.norm(g)) for g in x[::2].astype(np.float64)], axis=0)
    scaled = 2.0**12 * full
    clipped_scaled = scaled * min(1.0, 1.0 / np.linalg.norm(scaled)) / 2.0**12
    got = np.asarray(state.opt_state["grad"]["w"])
    np.testing.assert_allclose(got, after_accumulation, rtol=1e-6)
    assert np.linalg.norm(per_microbatch - after_accumulation) > 0.4
    assert np.linalg.norm(clipped_scaled - after_accumulation) > 0.9
    np.testing.assert_allclose(float(metrics.grad_norm), np.sqrt(20.0), rtol=1e-6)
    assert bool(metrics.clipped) and not bool(metrics.skipped)
    np.testing.assert_allclose(np.asarray(state.params["w"]), -after_accumulation, rtol=1e-6)


@pytest.mark.float32_matmuls
def test_clipping_matches_optax_reference_on_an_mlp():
    batch = make_batch(3)
    loss, grads = jax.jit(jax.value_and_grad(mse_loss))(init_mlp(), batch)
    full_norm = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads))))
    max_norm = 0.5 * full_norm
    ref_opt = optax.chain(optax.clip_by_global_norm(max_norm), optax.sgd(0.5))
    params, _, _ = reference_step(mse_loss, ref_opt)(init_mlp(), ref_opt.init(init_mlp()), batch)

    opt = optax.sgd(0.5)
    state = TrainState.create(init_mlp(), opt, loss_scale="dynamic")
    step = make_train_step(mse_loss, num_microbatches=3, max_grad_norm=max_norm)
    state, metrics = step(state, batch)
    assert_trees_close(state.params, params)
    np.testing.assert_allclose(float(metrics.grad_norm), full_norm, rtol=1e-5)
    np.testing.assert_allclose(float(metrics.loss), float(loss), rtol=1e-6)
    # Clipping each microbatch to max_norm instead (float64) gives a clearly different update.
    grad_fn = jax.jit(jax.grad(mse_loss))
    per_mb = [
        jax.tree.map(lambda g: np.asarray(g, np.float64), grad_fn(init_mlp(), microbatch(batch, 3, j)))
        for j in range(3)
    ]
    norms = [np.sqrt(sum(np.sum(g**2) for g in jax.tree.leaves(tree))) for tree in per_mb]
    per_mb_params = jax.tree.map(
        lambda p, *g: p - 0.5 * sum(gj * min(1.0, max_norm / n) for gj, n in zip(g, norms)) / 3, init_mlp(), *per_mb
    )
    gap = max(np.max(np.abs(a - b)) for a, b in zip(jax.tree.leaves(per_mb_params), jax.tree.leaves(params)))
    assert gap > 1e-3


# --- 4. a non-finite microbatch skips the whole step; training recovers ----------------------

GROWTH_INTERVAL = 5


def _scale_model(scale, good, finite):
    """Plain-Python dynamic loss scale (factor 2, hysteresis 1, bounds [1, 2**24])."""
    if not finite:
        return max(scale / 2, 1.0), 0
    good += 1
    if good >= GROWTH_INTERVAL:
        return min(scale * 2, 2.0**24), 0
    return scale, good


@pytest.fixture(scope="module")
def skipping_step():
    opt = optax.adamw(1e-2, weight_decay=1e-2)
    step = make_train_step(mse_loss, num_microbatches=3, max_grad_norm=10.0)

    def fresh_state():
        scale = DynamicLossScale.create(2.0**10, growth_interval=GROWTH_INTERVAL)
        return TrainState.create(init_mlp(), opt, loss_scale=scale)

    return step, fresh_state


def test_the_step_counter_saturates_and_says_so():
    """From 2**31 - 2: one step counts to 2**31 - 1; every later one leaves it there, reports
    step_saturated, and (uses_rng) draws the same keys as the other saturated steps."""
    top = int(np.iinfo(np.int32).max)

    def loss(params, batch, key):
        noise = jax.random.normal(key, batch["x"].shape)
        return jnp.mean((batch["x"] + noise) @ params["w"]), noise

    step = make_train_step(loss, has_aux=True, uses_rng=True, donate=False, num_microbatches=1)
    state = TrainState.create({"w": jnp.ones((3, 1))}, optax.sgd(0.0))
    state = dataclasses.replace(state, step=jnp.asarray(top - 1, jnp.int32))
    counts, flags, noises = [], [], []
    for _ in range(3):
        state, metrics = step(state, {"x": jnp.ones((2, 3))})
        counts.append(int(state.step))
        flags.append(bool(metrics.step_saturated))
        noises.append(np.asarray(metrics.aux))
    assert counts == [top, top, top] and flags == [False, True, True]
    assert not np.array_equal(noises[0], noises[1]) and np.array_equal(noises[1], noises[2])


def _poisoned(batch: dict, value: float, row: int = 5) -> dict:
    x = batch["x"].copy()
    x[row, 1] = value  # row 5 is in microbatch 1 of 3; the other two are clean
    return {"x": x, "y": batch["y"]}


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_microbatch_skips_the_step_bit_identically(skipping_step, bad):
    step, fresh_state = skipping_step
    state = fresh_state()
    for t in range(2):
        state, _ = step(state, make_batch(t))
    before = snapshot(state)
    state, metrics = step(state, _poisoned(make_batch(2), bad))
    assert bool(metrics.skipped) and not bool(metrics.clipped)
    assert int(metrics.consecutive_skips) == 1 and int(state.consecutive_skips) == 1
    assert_bit_identical(snapshot(state.params), before.params)
    assert_bit_identical(snapshot(state.opt_state), before.opt_state)
    assert int(state.opt_state[0].count) == 2  # adamw's count did not advance
    assert float(metrics.loss_scale) == 2.0**10
    assert float(state.loss_scale.loss_scale) == 2.0**9
    assert int(state.step) == 3

    state, metrics = step(state, _poisoned(make_batch(3), bad))
    assert bool(metrics.skipped) and int(state.consecutive_skips) == 2
    assert float(state.loss_scale.loss_scale) == 2.0**8
    assert_bit_identical(snapshot(state.params), before.params)

    state, metrics = step(state, make_batch(4))
    assert not bool(metrics.skipped) and int(metrics.consecutive_skips) == 0
    assert int(state.opt_state[0].count) == 3
    assert not np.array_equal(np.asarray(state.params["w1"]), before.params["w1"])


def test_training_recovers_after_a_skip(skipping_step):
    step, fresh_state = skipping_step
    state = fresh_state()
    batch = make_batch(7)
    scale, good = 2.0**10, 0
    losses, skipped = [], []
    for t in range(31):
        state, metrics = step(state, _poisoned(batch, np.nan) if t == 0 else batch)
        skipped.append(bool(metrics.skipped))
        losses.append(float(metrics.loss))
        assert float(metrics.loss_scale) == scale
        scale, good = _scale_model(scale, good, not skipped[-1])
        assert float(state.loss_scale.loss_scale) == scale
    assert skipped == [True] + [False] * 30
    assert scale == 2.0**9 * 2**6 and scale > 2.0**10  # backed off once, regrew six times
    assert losses[-1] < 0.7 * losses[1]


# --- 5. a loss that overflows only when scaled ------------------------------------------------


def test_overflow_only_when_scaled_backs_off_to_the_closed_form():
    def loss_fn(params, batch):
        return jnp.mean(batch["x"] @ params["w"])

    x = np.full((4, 2), 1.0e4, np.float32)  # gradient (1e4, 1e4), loss 2e4: finite unscaled
    initial = 2.0**120
    opt = optax.sgd(1e-6)
    scale = DynamicLossScale.create(initial, growth_interval=1000, max_loss_scale=2.0**127)
    state = TrainState.create({"w": jnp.ones(2)}, opt, loss_scale=scale)
    step = make_train_step(loss_fn)
    gradient = x.astype(np.float64).mean(axis=0)
    # Closed form: halvings until the scaled gradient fits under float32's maximum.
    expected_skips = next(k for k in range(200) if initial * 2.0**-k * np.max(np.abs(gradient)) <= F32_MAX)
    assert expected_skips == 6
    flags, params = [], np.ones(2)
    for _ in range(expected_skips + 3):
        before = snapshot(state.params)
        state, metrics = step(state, {"x": x})
        flags.append(bool(metrics.skipped))
        assert math.isfinite(float(metrics.loss))
        if flags[-1]:
            assert_bit_identical(snapshot(state.params), before)
        else:
            params = params - 1e-6 * gradient
        np.testing.assert_allclose(float(metrics.loss), float(np.mean(x.astype(np.float64) @ before["w"])), rtol=1e-6)
    assert flags == [True] * expected_skips + [False] * 3
    assert float(state.loss_scale.loss_scale) == initial * 2.0**-expected_skips
    np.testing.assert_allclose(np.asarray(state.params["w"]), params, rtol=1e-6)


# --- 6. token-weighted mean ------------------------------------------------------------------


def test_token_weighted_equals_full_batch_token_mean():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(8, 3, 2)).astype(np.float32)
    y = rng.normal(size=(8, 3)).astype(np.float32)
    # Valid tokens per microbatch of 2 rows: 6, 1, 3, 2.
    mask = np.array([[1, 1, 1], [1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 0], [1, 0, 1]], bool)
    batch = {"x": x, "y": y, "mask": mask}

    def sum_and_count(params, batch):
        error = (batch["x"] @ params["w"] - batch["y"]) ** 2
        return jnp.sum(jnp.where(batch["mask"], error, 0.0)), jnp.sum(batch["mask"])

    def token_mean(params, batch):
        loss_sum, count = sum_and_count(params, batch)
        return loss_sum / count

    params = {"w": np.array([0.5, -1.0], np.float32)}
    opt = grad_probe()
    state = TrainState.create(params, opt)
    step = make_train_step(sum_and_count, num_microbatches=4, token_weighted=True)
    state, metrics = step(state, batch)
    loss, grads = jax.jit(jax.value_and_grad(token_mean))(params, batch)
    np.testing.assert_allclose(float(metrics.loss), float(loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state.opt_state["grad"]["w"]), np.asarray(grads["w"]), rtol=1e-5)
    grad_fn = jax.jit(jax.grad(token_mean))
    mean_of_means = np.mean([np.asarray(grad_fn(params, microbatch(batch, 4, j))["w"]) for j in range(4)], axis=0)
    assert np.max(np.abs(mean_of_means - np.asarray(grads["w"]))) > 0.1


# --- 7. one compilation ----------------------------------------------------------------------


def test_step_compiles_once(skipping_step):
    compile_events = []

    def listener(event, duration, **kwargs):
        if event in ("/jax/core/compile/backend_compile_duration", "/jax/core/compile/jaxpr_trace_duration"):
            compile_events.append(event)

    step, fresh_state = skipping_step
    state, _ = step(fresh_state(), make_batch(0))  # compiled here or by an earlier test
    cached = step._cache_size()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        # New values, a skipped step and the state a step returned: all hit the same executable.
        for batch in (make_batch(1), _poisoned(make_batch(2), np.nan), make_batch(3)):
            state, _ = step(state, batch)
        state, _ = step(fresh_state(), make_batch(4))
        assert compile_events == []
        assert step._cache_size() == cached
        state, _ = step(state, make_batch(9, size=6))  # the counter sees a real recompile
        assert "/jax/core/compile/backend_compile_duration" in compile_events
        assert step._cache_size() == cached + 1
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# --- 8. plain pytree, Flax linen, Flax nnx, Equinox, chained optax clipping ------------------


def _matches_reference(loss_fn, params, opt, steps: int = 4) -> None:
    ref = reference_step(loss_fn, opt)
    ref_params, ref_opt_state = params, opt.init(params)
    state = TrainState.create(params, opt)
    step = make_train_step(loss_fn, num_microbatches=2)
    losses = []
    for t in range(steps):
        batch = make_batch(20, size=8)
        ref_params, ref_opt_state, ref_loss = ref(ref_params, ref_opt_state, batch)
        state, metrics = step(state, batch)
        assert_trees_close(state.params, ref_params)
        np.testing.assert_allclose(float(metrics.loss), float(ref_loss), rtol=1e-5)
        losses.append(float(metrics.loss))
    assert losses[-1] < losses[0]


def test_plain_pytree_with_chained_clip_transform():
    _matches_reference(mse_loss, init_mlp(1), optax.chain(clip_by_global_norm_transform(1.0), optax.adam(3e-2)))


def test_flax_linen_model():
    model = nn.Sequential([nn.Dense(4), nn.tanh, nn.Dense(2)])
    params = filled(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 3)))["params"])

    def loss_fn(p, batch):
        return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    _matches_reference(loss_fn, params, optax.adam(3e-2))


def test_flax_nnx_model():
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(0))))
    params = filled(abstract)

    def loss_fn(p, batch):
        return jnp.mean((nnx.merge(graphdef, p)(batch["x"]) - batch["y"]) ** 2)

    _matches_reference(loss_fn, params, optax.adam(3e-2))


def test_equinox_model():
    abstract = eqx.filter_eval_shape(
        eqx.nn.MLP, 3, 2, width_size=4, depth=1, activation=jnp.tanh, key=jax.random.key(0)
    )
    is_shape = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    arrays, rest = eqx.partition(abstract, is_shape)
    model = eqx.combine(filled(arrays), rest)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_fn(p, batch):
        return jnp.mean((jax.vmap(eqx.combine(p, static))(batch["x"]) - batch["y"]) ** 2)

    _matches_reference(loss_fn, params, optax.adam(3e-2))


# --- 9. aux and rng --------------------------------------------------------------------------


@pytest.mark.float32_matmuls
def test_aux_is_stacked_over_microbatches():
    def loss_fn(params, batch):
        prediction = mlp(params, batch["x"])
        return jnp.mean((prediction - batch["y"]) ** 2), {"sum": jnp.sum(prediction), "x0": batch["x"][:, 0]}

    opt = optax.sgd(0.1)
    state = TrainState.create(init_mlp(), opt)
    params = snapshot(state.params)
    step = make_train_step(loss_fn, num_microbatches=3, has_aux=True)
    batch = make_batch(5)
    state, metrics = step(state, batch)
    assert isinstance(metrics, StepMetrics)
    assert metrics.aux["sum"].shape == (3,) and metrics.aux["x0"].shape == (3, 4)
    tolerance = TPU_TRANSCENDENTAL_TOLERANCE if on_tpu() else 1e-5  # the chip's tanh (tests/helpers/chip.py)
    for j in range(3):
        mb = microbatch(batch, 3, j)
        hidden = np.tanh(mb["x"].astype(np.float64) @ params["w1"] + params["b1"])
        prediction_sum = np.sum(hidden @ params["w2"] + params["b2"])
        np.testing.assert_allclose(float(metrics.aux["sum"][j]), prediction_sum, rtol=tolerance, atol=tolerance)
        np.testing.assert_array_equal(np.asarray(metrics.aux["x0"][j]), mb["x"][:, 0])
    np.testing.assert_allclose(float(metrics.loss), mse_float64(params, batch), rtol=tolerance)


def test_rng_differs_per_microbatch_and_step_and_is_deterministic():
    def dropout_loss(params, batch, rng):
        keep = jax.random.bernoulli(rng, 0.5, batch["x"].shape)
        x = jnp.where(keep, 2.0 * batch["x"], 0.0)
        return jnp.mean((mlp(params, x) - batch["y"]) ** 2), jax.random.key_data(rng)

    opt = optax.sgd(0.1)
    step = make_train_step(dropout_loss, num_microbatches=3, has_aux=True, uses_rng=True, donate=False)
    batch = make_batch(6)
    state = TrainState.create(init_mlp(), opt, seed=0)
    next_state, metrics = step(state, batch)
    keys = np.asarray(metrics.aux)
    assert keys.shape == (3, 2) and keys.dtype == np.uint32
    assert len({tuple(k) for k in keys}) == 3
    # The loss used exactly those keys.
    reference = jax.jit(lambda p, mb, key: dropout_loss(p, mb, jax.random.wrap_key_data(key))[0])
    losses = [reference(state.params, microbatch(batch, 3, j), keys[j]) for j in range(3)]
    np.testing.assert_allclose(float(metrics.loss), float(np.mean(losses)), rtol=1e-5)
    # Same state and batch: the same keys and the same result, bit for bit.
    again_state, again = step(state, batch)
    assert_bit_identical(snapshot(again.aux), keys)
    assert_bit_identical(snapshot(again_state.params), snapshot(next_state.params))
    # Another step index or another seed: other keys (and here another update).
    later = dataclasses.replace(state, step=jnp.ones((), jnp.int32))
    later_state, later_metrics = step(later, batch)
    assert not {tuple(k) for k in np.asarray(later_metrics.aux)} & {tuple(k) for k in keys}
    assert not np.array_equal(np.asarray(later_state.params["w1"]), np.asarray(next_state.params["w1"]))
    assert_bit_identical(snapshot(step(next_state, batch)[1].aux), snapshot(later_metrics.aux))
    other_seed = TrainState.create(init_mlp(), opt, seed=1)
    assert not {tuple(k) for k in np.asarray(step(other_seed, batch)[1].aux)} & {tuple(k) for k in keys}


# --- 10. bf16 compute with a dynamic loss scale ------------------------------------------------


def test_bfloat16_compute_with_dynamic_scale_trains_on_float32_masters():
    seen = set()

    def loss_fn(params, batch):
        seen.update(p.dtype for p in jax.tree.leaves(params))
        return compute_dtype_loss(params, batch)

    opt = optax.adam(3e-2)
    state = TrainState.create(init_mlp(2, (3, 8, 2)), opt, loss_scale="dynamic")
    step = make_train_step(
        loss_fn, precision="params=float32,compute=bfloat16,output=float32", num_microbatches=2, max_grad_norm=5.0
    )
    batch = make_batch(8)
    losses = []
    for _ in range(20):
        state, metrics = step(state, batch)
        losses.append(float(metrics.loss))
        assert not bool(metrics.skipped)
    assert seen == {jnp.dtype(jnp.bfloat16)}
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(state.params))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim)
    assert losses[-1] < 0.5 * losses[0]
    # The bfloat16 loss tracks the float32 loss of the same masters.
    np.testing.assert_allclose(losses[-1], mse_float64(state.params, batch), rtol=0.1)


# --- 11. bad arguments -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"num_microbatches": 0}, ValueError, r"num_microbatches.*0"),
        ({"num_microbatches": -2}, ValueError, r"num_microbatches.*-2"),
        ({"num_microbatches": 2.0}, (TypeError, ValueError), r"num_microbatches.*2\.0"),
        ({"num_microbatches": True}, (TypeError, ValueError), r"num_microbatches.*True"),
        ({"max_grad_norm": 0.0}, ValueError, r"max_grad_norm.*0\.0"),
        ({"max_grad_norm": -1.0}, ValueError, r"max_grad_norm.*-1\.0"),
        ({"max_grad_norm": float("nan")}, ValueError, r"max_grad_norm.*nan"),
        ({"max_grad_norm": float("inf")}, ValueError, r"max_grad_norm.*inf"),
        ({"split": "rows"}, ValueError, r"unknown split='rows'"),
        ({"has_aux": 1}, TypeError, r"has_aux must be a bool"),
    ],
)
def test_bad_settings_raise_naming_the_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        make_train_step(mse_loss, **kwargs)


@pytest.mark.parametrize("optimizer", [optax.sgd, (lambda p: None, lambda u, s, p=None: (u, s)), None, "adam"])
def test_non_optax_optimizer_raises(optimizer):
    with pytest.raises(TypeError, match="optimizer must be an optax.GradientTransformation"):
        TrainState.create(init_mlp(), optimizer)


@pytest.mark.parametrize("optimizer", [optax.sgd(0.5), optax.sgd, "adam"])
def test_the_removed_optimizer_argument_is_a_type_error_naming_the_new_form(optimizer):
    """make_train_step(loss_fn, optimizer) was deprecated in 0.2 and is refused since 0.8."""
    with pytest.raises(
        TypeError, match=r"takes no optimizer since leanstep 0\.8.*TrainState\.create\(params, optimizer\)"
    ):
        make_train_step(mse_loss, optimizer)


def test_optimizer_is_static_state_metadata():
    opt = optax.adam(1e-3)
    state = TrainState.create(init_mlp(), opt)
    assert state.optimizer is opt and opt not in jax.tree.leaves(state)
    out = jax.jit(lambda s: s)(state)
    assert out.optimizer is opt
    with pytest.raises(TypeError, match="optimizer must be hashable"):
        TrainState.create(init_mlp(), optax.GradientTransformation([], lambda u, s, p=None: (u, s)))


def test_non_callable_loss_raises():
    with pytest.raises(TypeError, match="loss_fn must be callable, got str"):
        make_train_step("mse")


def test_indivisible_batch_raises_at_call_naming_the_sizes(skipping_step):
    step, fresh_state = skipping_step
    with pytest.raises(ValueError, match="batch size 10 is not divisible by num_microbatches=3"):
        step(fresh_state(), make_batch(0, size=10))


def test_integer_params_raise_naming_the_leaf():
    with pytest.raises(TypeError, match=r"params\['w'\] has dtype int32.*floating-point"):
        TrainState.create({"b": jnp.zeros(2), "w": jnp.arange(3)}, optax.sgd(0.1))
