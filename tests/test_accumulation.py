"""Tests for leanstep.blocks.accumulation against full-batch jax.value_and_grad and float64 sums."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.chip import SIX_DECIMALS_ON_TPU, on_tpu
from leanstep.blocks.accumulation import init_grad_accumulator, microbatched_value_and_grad
from leanstep.blocks.microbatches import split_microbatches
from leanstep.common.jaxprs import scan_operands

# --- the seed's two-layer network, on a dict batch {"x", "y", "mask"} -----------------------


def forward(params: dict, x: jax.Array) -> jax.Array:
    # Rank promotion is an error in the test setup, so the bias broadcast is spelled out.
    hidden = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    return hidden @ params["w2"] + params["b2"][None, :]


def mean_loss(params: dict, batch: dict) -> jax.Array:
    """Mean over rows of the (masked) squared error summed over outputs."""
    error = (forward(params, batch["x"]) - batch["y"]) ** 2
    if "mask" in batch:
        error = error * batch["mask"]
    return jnp.mean(jnp.sum(error, axis=1))


def sum_and_count(params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Token-weighted form: masked squared-error sum and the number of valid entries."""
    error = (forward(params, batch["x"]) - batch["y"]) ** 2
    return jnp.sum(error * batch["mask"]), jnp.sum(batch["mask"])


def token_mean_loss(params: dict, batch: dict) -> jax.Array:
    loss_sum, count = sum_and_count(params, batch)
    return loss_sum / jax.lax.stop_gradient(count)


@partial(jax.jit, static_argnames=("num_microbatches", "token_weighted"))
def accumulated(params: dict, batch: dict, num_microbatches: int, token_weighted: bool = False):
    loss_fn = sum_and_count if token_weighted else mean_loss
    return microbatched_value_and_grad(loss_fn, num_microbatches, token_weighted=token_weighted)(params, batch)


full_batch = jax.jit(jax.value_and_grad(mean_loss))
full_batch_token = jax.jit(jax.value_and_grad(token_mean_loss))


def make_problem(seed: int, b: int, d: int, h: int, k: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    params = {"w1": normal(d, h), "b1": normal(h), "w2": normal(h, k), "b2": normal(k)}
    mask = rng.random((b, k)) < 0.6
    mask[0, 0] = True  # at least one valid entry in the batch
    batch = {"x": normal(b, d), "y": normal(b, k), "mask": jnp.asarray(mask, jnp.float32)}
    return params, batch


def assert_trees_close(got: object, want: object, rtol: float = 2e-5, atol: float = 2e-6) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def rows_of(batch: dict, start: int, stop: int) -> dict:
    """Rows ``start:stop`` of every leaf: one microbatch, sliced independently of the code."""
    return jax.tree.map(lambda leaf: leaf[start:stop], batch)


def divisors(n: int) -> list[int]:
    return [m for m in range(1, n + 1) if n % m == 0]


def every_divisor(params: dict, batch: dict, counts: tuple[int, ...]) -> tuple:
    """Accumulated results for each count, and the full-batch references, in one program."""
    results = {
        n: (
            microbatched_value_and_grad(mean_loss, n)(params, batch),
            microbatched_value_and_grad(sum_and_count, n, token_weighted=True)(params, batch),
        )
        for n in counts
    }
    references = (
        jax.value_and_grad(mean_loss)(params, batch),
        jax.value_and_grad(token_mean_loss)(params, batch),
    )
    return results, references


# One compile per hypothesis example; XLA's CPU optimisations are turned down because
# compiling, not running, is what these tiny programs spend their time on.
every_divisor_jit = jax.jit(
    every_divisor,
    static_argnames="counts",
    compiler_options={
        "xla_backend_optimization_level": 0,
        "xla_llvm_disable_expensive_passes": True,
    },
)


@pytest.mark.float32_matmuls
@settings(max_examples=12, deadline=None)
@given(
    b=st.integers(1, 8),
    d=st.integers(1, 4),
    h=st.integers(1, 4),
    k=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_equals_full_batch_for_every_divisor(b: int, d: int, h: int, k: int, seed: int) -> None:
    params, batch = make_problem(seed, b, d, h, k)
    counts = tuple(divisors(b))
    results, (want_mean, want_token) = every_divisor_jit(params, batch, counts=counts)
    assert sorted(results) == list(counts)
    for num_microbatches in counts:
        (loss, grads), token_result = results[num_microbatches]
        assert loss.dtype == jnp.float32 and loss.shape == ()
        assert_trees_close((loss, grads), want_mean)
        assert_trees_close(token_result, want_token)


def seed_params(raw: dict) -> dict:
    return {key: jnp.asarray(value, jnp.float32) for key, value in raw.items()}


SEED_EXAMPLES = [
    (
        {"w1": [[0.5, -0.5], [0.25, 1.0]], "b1": [0.0, 0.1], "w2": [[1.0], [-1.0]], "b2": [0.2]},
        [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.5]],
        [[0.5], [-0.5], [0.0], [1.0]],
        2,
        1.060169,
        {
            "w1": [[1.155724, -0.689779], [-0.270026, 0.043908]],
            "b1": [-0.483697, -0.012093],
            "w2": [[0.588589], [-0.749159]],
            "b2": [-0.487136],
        },
    ),
    (
        {
            "w1": [[0.3, 0.0, -0.2]],
            "b1": [0.1, -0.1, 0.0],
            "w2": [[0.5, 0.5], [1.0, -1.0], [0.0, 0.2]],
            "b2": [0.0, 0.0],
        },
        [[0.5], [-1.5], [2.0]],
        [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]],
        1,
        0.735669,
        {
            "w1": [[0.245756, -1.287083, 0.158517]],
            "b1": [-0.72046, -0.369854, -0.116445],
            "w2": [[-0.219351, 0.189402], [0.102495, 0.065263], [0.088264, -0.165526]],
            "b2": [-1.028366, -0.654801],
        },
    ),
    (
        {"w1": [[0.2, -0.4], [0.6, 0.1]], "b1": [0.0, 0.0], "w2": [[-0.7], [0.9]], "b2": [0.1]},
        [[0.1, 0.2], [0.3, -0.4], [-0.5, 0.6], [0.7, 0.8], [-0.9, -1.0], [1.1, 0.0]],
        [[0.0], [1.0], [0.0], [1.0], [0.0], [1.0]],
        6,
        0.942053,
        {
            "w1": [[0.6885, -0.985434], [0.193408, -0.426145]],
            "b1": [0.627196, -0.786288],
            "w2": [[-0.475989], [0.420651]],
            "b2": [-0.96138],
        },
    ),
]


@pytest.mark.parametrize(("params", "x", "y", "num_microbatches", "loss", "grads"), SEED_EXAMPLES)
def test_seed_examples(params: dict, x: list, y: list, num_microbatches: int, loss: float, grads: dict) -> None:
    if on_tpu():
        pytest.skip(SIX_DECIMALS_ON_TPU)
    batch = {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.float32)}
    got_loss, got_grads = accumulated(seed_params(params), batch, num_microbatches)
    assert got_loss.dtype == jnp.float32 and got_loss.shape == ()
    np.testing.assert_allclose(float(got_loss), loss, rtol=0, atol=1e-6)
    assert sorted(got_grads) == ["b1", "b2", "w1", "w2"]
    for key, value in grads.items():
        assert got_grads[key].dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got_grads[key]), value, rtol=0, atol=1e-6)


# --- the traced program ---------------------------------------------------------------------


def sub_jaxprs(eqn: object) -> list[object]:
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "eqns"):
                found.append(item)
            elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
                found.append(item.jaxpr)
    return found


def walk(jaxpr: object, *, into_scans: bool) -> list[object]:
    """Every equation of ``jaxpr`` and its sub-jaxprs (scan bodies only if asked)."""
    eqns = []
    for eqn in jaxpr.eqns:
        eqns.append(eqn)
        if eqn.primitive.name != "scan" or into_scans:
            for sub in sub_jaxprs(eqn):
                eqns.extend(walk(sub, into_scans=into_scans))
    return eqns


@pytest.mark.parametrize(("b", "num_microbatches"), [(8, 4), (8, 1), (8, 8), (6, 3)])
def test_traced_program_is_one_scan_with_grad_inside(b: int, num_microbatches: int) -> None:
    # Shapes chosen so no parameter shape equals a batch-leaf shape.
    params, batch = make_problem(0, b, 3, 2, 1)
    rows = b // num_microbatches
    fn = microbatched_value_and_grad(mean_loss, num_microbatches)
    closed = jax.make_jaxpr(fn)(params, batch)

    scans = [e for e in walk(closed.jaxpr, into_scans=True) if e.primitive.name == "scan"]
    assert len(scans) == 1
    scan = scans[0]
    assert scan.params["length"] == num_microbatches
    outside = [e for e in walk(closed.jaxpr, into_scans=False) if e.primitive.name == "dot_general"]
    assert outside == []

    body = scan.params["jaxpr"].jaxpr
    body_dots = [e for e in walk(body, into_scans=True) if e.primitive.name == "dot_general"]
    # Forward x@W1, h@W2 plus backward dW2, dh, dW1: value_and_grad runs in the body.
    assert len(body_dots) == 5

    num_consts, num_carry, _ = map(len, scan_operands(scan))
    xs = body.invars[num_consts + num_carry :]
    batch_leaves = jax.tree.leaves(batch)
    assert sorted(v.aval.shape for v in xs) == sorted((rows,) + x.shape[1:] for x in batch_leaves)
    full_shapes = {x.shape for x in batch_leaves}
    assert not any(v.aval.shape in full_shapes for v in body.invars[:num_consts])


# --- precision --------------------------------------------------------------------------------


def linear_sum(w: jax.Array, batch: dict) -> jax.Array:
    return jnp.sum(w * batch["x"])


def test_bfloat16_gradients_accumulate_in_float32() -> None:
    # 1024 microbatches of one row; microbatch j's bf16 gradient is exactly x_j in [1, 1.03].
    num_microbatches = 1024
    x = (1 + np.random.default_rng(0).integers(0, 4, num_microbatches) / 128).astype(ml_dtypes.bfloat16)
    w, batch = jnp.asarray(1.0, jnp.bfloat16), {"x": jnp.asarray(x)}
    expected = float(np.sum(x.astype(np.float64))) / num_microbatches

    loss, grad = jax.jit(microbatched_value_and_grad(linear_sum, num_microbatches))(w, batch)
    assert grad.dtype == jnp.float32 and loss.dtype == jnp.float32
    # Sums of 1024 bf16 values with 8-bit mantissas are exact in float32.
    assert float(grad) == expected and float(loss) == expected

    # The case discriminates: summing in bf16 stalls at 512 and halves the gradient.
    bf16_sum = ml_dtypes.bfloat16(0)
    for value in x:
        bf16_sum = ml_dtypes.bfloat16(bf16_sum + value)
    assert abs(float(bf16_sum) / num_microbatches - expected) > 0.4
    optax_grad = optax.microbatch(
        jax.grad(linear_sum),
        argnums=1,
        microbatch_size=1,
        accumulator=optax.microbatching.AccumulationType.MEAN,
    )(w, batch)
    assert abs(float(optax_grad) - expected) > 0.4
    _, bf16_grad = jax.jit(microbatched_value_and_grad(linear_sum, num_microbatches, accum_dtype=jnp.bfloat16))(
        w, batch
    )
    assert bf16_grad.dtype == jnp.bfloat16 and abs(float(bf16_grad) - expected) > 0.4


def test_bfloat16_params_give_accum_dtype_grads_equal_to_float64_sum() -> None:
    if on_tpu():  # 1.4% apart on a v5e, products at "highest"
        pytest.skip(
            "XLA:TPU keeps bf16 intermediates in float32 where it chooses (excess precision), so the "
            "reference's per-microbatch bf16 gradients round elsewhere than the step's"
        )
    params, batch = make_problem(3, 8, 3, 4, 2)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    _, grads = accumulated(params, batch, 4)
    # Reference: each microbatch's own bf16 gradient, averaged in float64.
    grad_fn = jax.jit(jax.grad(mean_loss))
    parts = [grad_fn(params, rows_of(batch, 2 * j, 2 * j + 2)) for j in range(4)]
    for key in params:
        assert grads[key].dtype == jnp.float32
        want = np.mean([np.asarray(p[key], np.float64) for p in parts], axis=0)
        np.testing.assert_allclose(np.asarray(grads[key]), want, rtol=1e-6, atol=1e-7)


def test_scaled_loss_and_overflow_propagate() -> None:
    # A loss multiplied by a loss scale gives exactly scaled grads; an inf gradient in any
    # microbatch reaches the result so that a loss-scale check can see it.
    params, batch = make_problem(5, 4, 2, 3, 1)
    scale = 2.0**15
    scaled = microbatched_value_and_grad(lambda p, b: scale * mean_loss(p, b), 2)
    loss, grads = jax.jit(scaled)(params, batch)
    want_loss, want_grads = full_batch(params, batch)
    unscaled = (loss / scale, jax.tree.map(lambda g: g / scale, grads))
    assert_trees_close(unscaled, (want_loss, want_grads))

    x = jnp.array([1.0, 2.0, jnp.inf, 3.0])
    _, grad = microbatched_value_and_grad(linear_sum, 2)(jnp.float32(1.0), {"x": x})
    assert not bool(jnp.isfinite(grad))


# --- token weighting ----------------------------------------------------------------------------


@pytest.mark.float32_matmuls
def test_token_weighted_uses_total_count_not_mean_of_means() -> None:
    params, batch = make_problem(7, 6, 2, 3, 2)
    # Valid entries per microbatch of 2 rows: 4, 1, 0 (uneven, one empty).
    batch["mask"] = jnp.array([[1, 1], [1, 1], [1, 0], [0, 0], [0, 0], [0, 0]], jnp.float32)
    loss, grads = accumulated(params, batch, 3, token_weighted=True)
    want_loss, want_grads = full_batch_token(params, batch)
    assert_trees_close((loss, grads), (want_loss, want_grads))

    # The case discriminates: averaging per-microbatch means (leaving out the empty one,
    # which would be 0/0) gives a different loss.
    ratios = []
    for j in range(2):
        loss_sum, count = sum_and_count(params, rows_of(batch, 2 * j, 2 * j + 2))
        ratios.append(float(loss_sum) / float(count))
    assert abs(np.mean(ratios) - float(loss)) > 1e-3 * abs(float(loss))


@pytest.mark.float32_matmuls
def test_has_aux_is_stacked_along_microbatches() -> None:
    params, batch = make_problem(11, 6, 2, 3, 2)

    def loss_with_aux(p: dict, b: dict) -> tuple[jax.Array, dict]:
        out = forward(p, b["x"])
        loss = jnp.mean(jnp.sum((out - b["y"]) ** 2, axis=1))
        return loss, {"out": out, "y_sum": jnp.sum(b["y"])}

    fn = jax.jit(microbatched_value_and_grad(loss_with_aux, 3, has_aux=True))
    (loss, aux), grads = fn(params, batch)
    (want_loss, _), want_grads = jax.value_and_grad(loss_with_aux, has_aux=True)(params, batch)
    assert_trees_close((loss, grads), (want_loss, want_grads))
    assert aux["out"].shape == (3, 2, 2) and aux["y_sum"].shape == (3,)
    np.testing.assert_allclose(np.asarray(aux["out"]).reshape(6, 2), np.asarray(forward(params, batch["x"])), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(aux["y_sum"]), np.asarray(batch["y"]).reshape(3, -1).sum(axis=1), rtol=1e-6)

    def token_with_aux(p: dict, b: dict) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        return sum_and_count(p, b), jnp.sum(b["mask"])

    fn = microbatched_value_and_grad(token_with_aux, 2, has_aux=True, token_weighted=True)
    (loss, counts), grads = fn(params, batch)
    assert_trees_close((loss, grads), full_batch_token(params, batch))
    want_counts = np.asarray(batch["mask"]).reshape(2, -1).sum(axis=1)
    np.testing.assert_array_equal(np.asarray(counts), want_counts)


# --- carry, errors -------------------------------------------------------------------


def test_init_grad_accumulator_is_zeros_in_accum_dtype() -> None:
    params = {"w": jnp.ones((2, 3), jnp.bfloat16), "b": [jnp.ones(1, jnp.float16)]}
    zeros = init_grad_accumulator(params)
    assert jax.tree.structure(zeros) == jax.tree.structure(params)
    for leaf, param in zip(jax.tree.leaves(zeros), jax.tree.leaves(params), strict=True):
        assert leaf.dtype == jnp.float32 and leaf.shape == param.shape
        assert not np.any(np.asarray(leaf))
    assert init_grad_accumulator(params, jnp.bfloat16)["w"].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    ("num_microbatches", "error"),
    [
        (0, ValueError),
        (-2, ValueError),
        (2.0, TypeError),
        (True, TypeError),
        ("2", TypeError),
        (None, TypeError),
    ],
)
def test_bad_num_microbatches(num_microbatches: object, error: type) -> None:
    with pytest.raises(error, match="num_microbatches"):
        microbatched_value_and_grad(mean_loss, num_microbatches)
    with pytest.raises(error, match="num_microbatches"):
        split_microbatches({"x": jnp.zeros(4)}, num_microbatches)


def test_numpy_int_num_microbatches_is_accepted() -> None:
    params, batch = make_problem(0, 4, 1, 1, 1)
    assert_trees_close(
        microbatched_value_and_grad(mean_loss, np.int64(2))(params, batch),
        full_batch(params, batch),
    )


def test_non_divisible_batch_raises_at_call_and_trace_time() -> None:
    params, batch = make_problem(0, 6, 1, 1, 1)
    fn = microbatched_value_and_grad(mean_loss, 4)
    message = "batch size 6 is not divisible by num_microbatches=4"
    with pytest.raises(ValueError, match=message):
        fn(params, batch)
    with pytest.raises(ValueError, match=message):
        jax.jit(fn)(params, batch)


def test_bad_accum_dtype_raises() -> None:
    with pytest.raises(TypeError, match="accum_dtype"):
        microbatched_value_and_grad(mean_loss, 2, accum_dtype=jnp.int32)


# --- splitters and the microbatch index --------------------------------------------------------


@pytest.mark.float32_matmuls
@pytest.mark.parametrize("split", ["strided", "presplit", "callable"])
def test_every_splitter_gives_the_full_batch_value_and_grad(split: str) -> None:
    """A row-mean loss does not depend on which rows go together; the reference is the full batch."""
    params, batch = make_problem(3, 12, 3, 4, 2)
    given = batch
    if split == "presplit":
        given = split_microbatches(batch, 3)
    splitter = (
        (lambda b, m: jax.tree.map(lambda x: x[::-1].reshape(m, -1, *x.shape[1:]), b)) if split == "callable" else split
    )
    fn = microbatched_value_and_grad(mean_loss, 3, split=splitter)
    assert_trees_close(jax.jit(fn)(params, given), full_batch(params, batch))


def test_with_index_hands_each_microbatch_its_index() -> None:
    """loss_fn(params, microbatch, index): index j with microbatch j, as the scan's input."""

    def loss_fn(w, microbatch, index):
        return jnp.mean(microbatch["x"] * w) * 0.0, (index, microbatch["x"][:, 0])

    batch = {"x": jnp.arange(8.0).reshape(8, 1)}
    (_, (indices, rows)), _ = jax.jit(microbatched_value_and_grad(loss_fn, 4, has_aux=True, with_index=True))(
        jnp.float32(1.0), batch
    )
    np.testing.assert_array_equal(indices, np.arange(4, dtype=np.int32))
    assert indices.dtype == jnp.int32
    np.testing.assert_array_equal(rows, np.arange(8.0).reshape(4, 2))
