"""Tests for leanstep.blocks.rounding: strict_precision against op-by-op execution and float64 references."""

import functools
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax._src.ad_checkpoint import saved_residuals

from helpers.bits import count_differences, leaves_bit_equal
from leanstep.blocks.rounding import strict_precision

BF16 = jnp.bfloat16
F32 = jnp.dtype(jnp.float32)


def all_eqns(jaxpr):
    """Every equation of a jaxpr, including those of nested jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from all_eqns(sub)


def eager(fn, *args):
    """Op-by-op execution: every bf16 result really is a bf16 array."""
    with jax.disable_jit():
        return fn(*args)


# ------------------------------------------------- seed contract (the key test)


def seed_loss(params, x, y):
    w, b = params["w"].astype(BF16), params["b"].astype(BF16)
    pred = x.astype(BF16) @ w + b[None, :]
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


@functools.partial(jax.jit, static_argnames=("growth_interval", "strict"))
def seed_step(params, x, y, loss_scale, good_steps, lr, *, growth_interval, strict=True):
    loss_fn = strict_precision(seed_loss) if strict else seed_loss

    def scaled(p):
        loss = loss_fn(p, x, y)
        return loss_scale * loss, loss

    (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params)
    grads = jax.tree.map(lambda g: g / loss_scale, grads)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    new_params = jax.tree.map(lambda p, g: jnp.where(finite, p - lr * g, p), params, grads)
    count = jnp.where(finite, good_steps + 1, 0)
    grow = count >= growth_interval
    new_scale = jnp.where(finite, jnp.where(grow, 2 * loss_scale, loss_scale), jnp.maximum(loss_scale / 2, 1.0))
    return {
        "loss": loss,
        "params": new_params,
        "loss_scale": new_scale,
        "good_steps": jnp.where(grow, 0, count).astype(jnp.int32),
        "grads_finite": finite,
    }


SEED_CASES = [
    (
        ({"w": [[0.5], [-1.25]], "b": [0.1]}, [[1.0, 2.0], [0.5, -1.0]], [[-1.9], [1.5]], 1024.0, 0, 0.1, 2),
        {
            "loss": 0.005159,
            "params": {"w": [[0.494775], [-1.240137]], "b": [0.089697]},
            "loss_scale": 1024.0,
            "good_steps": 1,
            "grads_finite": True,
        },
    ),
    (
        ({"w": [[1.3], [0.7]], "b": [-0.2]}, [[0.9, 1.1], [-0.4, 2.2]], [[1.94], [0.81]], 512.0, 2, 0.05, 3),
        {
            "loss": 0.021242,
            "params": {"w": [[1.309521], [0.709766]], "b": [-0.19043]},
            "loss_scale": 1024.0,
            "good_steps": 0,
            "grads_finite": True,
        },
    ),
    (
        ({"w": [[0.5], [-1.25]], "b": [0.1]}, [[1.0, 2.0], [0.5, -1.0]], [[40.0], [-30.0]], 3e38, 0, 0.1, 2),
        {
            "loss": 1377.068848,
            "params": {"w": [[0.5], [-1.25]], "b": [0.1]},
            "loss_scale": 1.5e38,
            "good_steps": 0,
            "grads_finite": False,
        },
    ),
]


def seed_inputs(case):
    params, x, y, scale, good, lr, growth = case
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    return (({k: f32(v) for k, v in params.items()}, f32(x), f32(y), f32(scale), jnp.int32(good), f32(lr)), growth)


@pytest.mark.parametrize(("case", "expected"), SEED_CASES)
def test_seed_contract_reproduces_with_strict_precision(case, expected):
    args, growth = seed_inputs(case)
    out = seed_step(*args, growth_interval=growth)
    np.testing.assert_array_almost_equal(out["loss"], expected["loss"], decimal=6)
    for name in ("w", "b"):
        np.testing.assert_array_almost_equal(out["params"][name], expected["params"][name], decimal=6)
    np.testing.assert_allclose(out["loss_scale"], expected["loss_scale"], rtol=1e-6)
    assert int(out["good_steps"]) == expected["good_steps"]
    assert bool(out["grads_finite"]) is expected["grads_finite"]
    assert out["loss_scale"].dtype == F32 and out["good_steps"].dtype == jnp.int32


def test_seed_contract_unwrapped_jit_keeps_excess_precision():
    """Without the wrapper XLA skips a bf16 rounding and misses the contract."""
    args, growth = seed_inputs(SEED_CASES[0][0])
    plain = seed_step(*args, growth_interval=growth, strict=False)
    assert abs(float(plain["loss"]) - 0.005159) > 1e-4  # 0.005010 on XLA:CPU
    # Op by op, the unwrapped step is what the contract describes.
    reference = eager(functools.partial(seed_step.__wrapped__, growth_interval=growth, strict=False), *args)
    leaves_bit_equal(seed_step(*args, growth_interval=growth), reference)


# ---------------------------------------------------- strict rounding, bit-exact


def mlp_loss(params, x, y):
    h = jnp.tanh(x.astype(BF16) @ params["w1"].astype(BF16) + params["b1"].astype(BF16)[None, :])
    out = (h @ params["w2"].astype(BF16) + params["b2"].astype(BF16)[None, :]).astype(jnp.float32)
    return jnp.mean((out - y) ** 2), out


def make_mlp(seed, batch=6, d_in=5, hidden=8, d_out=3):
    k = jax.random.split(jax.random.key(seed), 6)
    params = {
        "w1": jax.random.normal(k[0], (d_in, hidden)),
        "b1": jax.random.normal(k[1], (hidden,)),
        "w2": jax.random.normal(k[2], (hidden, d_out)) / 2,
        "b2": jax.random.normal(k[3], (d_out,)),
    }
    return params, jax.random.normal(k[4], (batch, d_in)), jax.random.normal(k[5], (batch, d_out))


MLP_GRAD = jax.value_and_grad(mlp_loss, has_aux=True)
STRICT_MLP_GRAD = jax.value_and_grad(strict_precision(mlp_loss), has_aux=True)
JIT_STRICT_MLP_GRAD = jax.jit(STRICT_MLP_GRAD)


@pytest.mark.parametrize("seed", [0, 1])
def test_mlp_jit_equals_op_by_op_bitwise(seed):
    args = make_mlp(seed)
    reference = eager(MLP_GRAD, *args)  # a device that rounds every op
    leaves_bit_equal(JIT_STRICT_MLP_GRAD(*args), reference)
    leaves_bit_equal(eager(STRICT_MLP_GRAD, *args), reference)
    leaves_bit_equal(jax.jit(strict_precision(mlp_loss))(*args), reference[0])
    # Unwrapped, jit differs in value and gradient, so the equalities above say something.
    assert count_differences(jax.jit(MLP_GRAD)(*args)[1], reference[1]) > 0


def bf16_round(a):
    return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def numpy_mlp_reference(params, x, y):
    """float64 NumPy, rounded to bf16 after every operation, forward and backward."""
    r = bf16_round
    p = {k: r(v) for k, v in params.items()}
    xb, y = r(x), np.asarray(y, np.float64)
    h = r(np.tanh(r(r(xb @ p["w1"]) + p["b1"])))
    out = r(r(h @ p["w2"]) + p["b2"])
    loss = np.mean((out - y) ** 2)
    g_out = r(2 * (out - y) / out.size)
    g_h = r(g_out @ p["w2"].T)
    g_pre = r(g_h * r(1 - r(h * h)))
    grads = {"w1": r(xb.T @ g_pre), "b1": r(g_pre.sum(0)), "w2": r(h.T @ g_out), "b2": r(g_out.sum(0))}
    return loss, out, grads


@pytest.mark.parametrize("seed", [0, 3])
def test_mlp_matches_rounded_float64_reference(seed):
    params, x, y = make_mlp(seed)
    (loss, out), grads = JIT_STRICT_MLP_GRAD(params, x, y)
    ref_loss, ref_out, ref_grads = numpy_mlp_reference(params, x, y)
    # Outputs are bf16 values: equal, or one bf16 ulp apart where a dot's
    # accumulation order decides a rounding.
    ulp = 2.0 ** (np.floor(np.log2(np.abs(ref_out))) - 7)
    assert np.all(np.abs(np.asarray(out, np.float64) - ref_out) <= ulp)
    assert np.mean(np.asarray(out, np.float64) == ref_out) > 0.9
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
    for name, ref in ref_grads.items():
        scale = np.max(np.abs(ref))
        np.testing.assert_allclose(grads[name], ref, rtol=2**-6, atol=2**-5 * scale)


def _native_float16_arithmetic() -> bool:
    """A CPU whose XLA computes fused float16 chains unrounded (AVX512-FP16; see strict_precision)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return jax.default_backend() == "cpu" and "avx512_fp16" in cpuinfo.split()


def test_float16_is_rounded_with_its_own_bits():
    def f(a, b):
        return jnp.exp(a.astype(jnp.float16) * b.astype(jnp.float16) + jnp.float16(1)).astype(jnp.float32)

    a = jnp.linspace(-2.0, 2.0, 256)
    grad = jax.grad(lambda a, b: jnp.sum(f(a, b) * b), argnums=(0, 1))
    strict_grad = jax.grad(lambda a, b: jnp.sum(strict_precision(f)(a, b) * b), argnums=(0, 1))
    # Rounding float16 results to bfloat16's bits would break these equalities.
    pairs = [
        (jax.jit(strict_precision(f))(a, a[::-1]), eager(f, a, a[::-1])),
        (jax.jit(strict_grad)(a, a[::-1]), eager(grad, a, a[::-1])),
    ]
    if not _native_float16_arithmetic():
        for compiled, op_by_op in pairs:
            leaves_bit_equal(compiled, op_by_op)
    else:  # the documented limit: XLA:CPU fuses float16 chains unrounded there;
        # the jaxpr checks below still pin float16's bits
        for compiled, op_by_op in pairs:
            for x, y in zip(jax.tree.leaves(compiled), jax.tree.leaves(op_by_op)):
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2.0**-7, atol=2.0**-14)
    program = str(jax.make_jaxpr(strict_grad)(a, a))
    assert "reduce_precision[exponent_bits=5 mantissa_bits=10]" in program
    assert "exponent_bits=8" not in program


def test_float32_programs_are_left_alone():
    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    w, x = jnp.ones((3, 2)) / 3, jnp.arange(6.0).reshape(2, 3)
    assert "reduce_precision" not in str(jax.make_jaxpr(jax.grad(strict_precision(f)))(w, x))
    leaves_bit_equal(jax.jit(jax.grad(strict_precision(f)))(w, x), jax.jit(jax.grad(f))(w, x))


# ------------------------------------------------- transformations and control flow


def rnn_loss(params, xs):
    """A bf16 tanh RNN over lax.scan; a cond picks the readout."""
    w, u = params["w"].astype(BF16), params["u"].astype(BF16)

    def cell(h, x):
        h = jnp.tanh(h @ w + x.astype(BF16) @ u)
        return h, jnp.sum(h)

    h, sums = lax.scan(cell, jnp.zeros(w.shape[0], BF16), xs)
    h = lax.cond(jnp.sum(h) > 0, lambda h: h * BF16(1.5), lambda h: h - BF16(0.25), h)
    h = h * params["g"].astype(BF16)
    return jnp.sum(h.astype(jnp.float32) ** 2) + jnp.sum(sums.astype(jnp.float32))


def test_scan_and_cond_inside_fn_match_op_by_op():
    k = jax.random.split(jax.random.key(7), 4)
    params = {
        "w": jax.random.normal(k[0], (4, 4)) / 2,
        "u": jax.random.normal(k[1], (3, 4)),
        "g": jax.random.normal(k[3], (4,)),
    }
    xs = jax.random.normal(k[2], (5, 3))
    grad = jax.value_and_grad(rnn_loss)
    reference = eager(grad, params, xs)  # disable_jit runs scan and cond as Python
    leaves_bit_equal(jax.jit(jax.value_and_grad(strict_precision(rnn_loss)))(params, xs), reference)
    assert count_differences(jax.jit(grad)(params, xs)[1], reference[1]) > 0
    # The loop and branches stay loops and branches, with rounding inside.
    program = jax.make_jaxpr(jax.grad(strict_precision(rnn_loss)))(params, xs)
    for name in ("scan", "cond"):
        bodies = [
            sub
            for eqn in all_eqns(program.jaxpr)
            if eqn.primitive.name == name
            for sub in jax.extend.core.jaxprs_in_params(eqn.params)
        ]
        assert bodies and all(any(e.primitive.name == "reduce_precision" for e in all_eqns(b)) for b in bodies)


@jax.custom_vjp
def clipped_identity(x):
    return x


clipped_identity.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g * BF16(0.9), -1, 1),))


def rules_loss(w, x):
    """bf16 code through custom_jvp (softmax), custom_vjp, an inner jit and a while loop."""
    logits = jax.jit(lambda a, b: a @ b)(x.astype(BF16), w.astype(BF16) * BF16(1.3))
    probs = clipped_identity(jax.nn.softmax(logits * BF16(3), axis=-1))
    scale = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * BF16(1.1)), (0, jnp.sum(probs)))[1]
    return jnp.sum((probs * lax.stop_gradient(scale)).astype(jnp.float32) ** 2)


def test_custom_rules_jit_and_while_inside_fn_match_op_by_op():
    k = jax.random.split(jax.random.key(11), 2)
    w, x = jax.random.normal(k[0], (5, 7)), jax.random.normal(k[1], (4, 5))
    reference = eager(jax.value_and_grad(rules_loss), w, x)
    leaves_bit_equal(jax.jit(jax.value_and_grad(strict_precision(rules_loss)))(w, x), reference)
    assert count_differences(jax.jit(jax.value_and_grad(rules_loss))(w, x)[1], reference[1]) > 0
    program = str(jax.make_jaxpr(strict_precision(rules_loss))(w, x))
    assert "while[" in program and "custom_jvp_call" not in program  # inlined, rounded


def deep_loss(params, x, *, remat):
    def layer(h, w):
        return jnp.tanh(h @ w.astype(BF16)) * BF16(1.25)

    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable) if remat else layer
    h = x.astype(BF16)
    for w in params:
        h = layer(h, w)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def test_checkpoint_inside_fn_keeps_values_and_recomputes():
    k = jax.random.split(jax.random.key(3), 4)
    params, x = [jax.random.normal(k[i], (6, 6)) for i in range(3)], jax.random.normal(k[3], (4, 6))
    remat = strict_precision(functools.partial(deep_loss, remat=True))
    plain = strict_precision(functools.partial(deep_loss, remat=False))
    reference = eager(jax.value_and_grad(functools.partial(deep_loss, remat=False)), params, x)
    leaves_bit_equal(jax.jit(jax.value_and_grad(remat))(params, x), reference)

    # Equal gradients cannot show recomputation; the saved residuals can. The
    # wrapper saves exactly what JAX saves for the unwrapped function: with
    # remat only each layer's (4, 6) input, without it also tanh, 1 - tanh^2, ...
    def residuals(f):
        return sorted((r.shape, str(r.dtype)) for r, _ in saved_residuals(f, params, x) if r.shape)

    for fn, strict_fn in [
        (functools.partial(deep_loss, remat=True), remat),
        (functools.partial(deep_loss, remat=False), plain),
    ]:
        assert residuals(strict_fn) == residuals(fn)
    activation = ((4, 6), "bfloat16")
    assert residuals(remat).count(activation) == 3 < residuals(plain).count(activation)


def test_vmap_and_per_example_gradients():
    params, x, y = make_mlp(4, batch=4)
    per_example = jax.vmap(lambda xi, yi: STRICT_MLP_GRAD(params, xi[None], yi[None]))
    batched = jax.jit(per_example)(x, y)
    for i in range(x.shape[0]):
        leaves_bit_equal(
            jax.tree.map(lambda leaf, i=i: leaf[i], batched), JIT_STRICT_MLP_GRAD(params, x[i : i + 1], y[i : i + 1])
        )


def test_under_outer_scan_matches_python_loop():
    params, x, y = make_mlp(5, batch=6)
    xs, ys = x.reshape(3, 2, -1), y.reshape(3, 2, -1)

    @jax.jit
    def accumulate(params, xs, ys):
        def body(total, batch):
            return jax.tree.map(jnp.add, total, STRICT_MLP_GRAD(params, *batch)[1]), None

        return lax.scan(body, jax.tree.map(jnp.zeros_like, params), (xs, ys))[0]

    total = jax.tree.map(jnp.zeros_like, params)
    for i in range(3):
        total = jax.tree.map(jnp.add, total, JIT_STRICT_MLP_GRAD(params, xs[i], ys[i])[1])
    leaves_bit_equal(accumulate(params, xs, ys), total)


def test_pytrees_kwargs_statics_and_closures():
    def f(params, x, *, scale, name, steps):
        assert isinstance(scale, float) and name == "layer"
        out = (x.astype(BF16) @ params["w"].astype(BF16)) * BF16(scale)
        return {"sum": jnp.sum(out.astype(jnp.float32)), "count": steps + 1}

    params, x = {"w": jnp.linspace(-1, 1, 6).reshape(3, 2)}, jnp.linspace(0.1, 0.9, 6).reshape(2, 3)
    wrapped = strict_precision(f)
    out = jax.jit(wrapped, static_argnames=("name", "scale"))(params, x, scale=1.1, name="layer", steps=jnp.int32(2))
    assert int(out["count"]) == 3 and out["count"].dtype == jnp.int32
    leaves_bit_equal(out, eager(functools.partial(f, scale=1.1, name="layer", steps=jnp.int32(2)), params, x))

    def loss(p, x):
        return wrapped(p, x, scale=1.1, name="layer", steps=jnp.int32(0))["sum"]

    def closing(p):  # the wrapper closes over a traced p; gradients still flow to it
        return strict_precision(lambda x: loss(p, x))(x)

    leaves_bit_equal(jax.jit(jax.grad(closing))(params), jax.jit(jax.grad(loss))(params, x))


def test_forward_mode_is_refused():
    f = strict_precision(lambda x: jnp.sin(x.astype(BF16)).astype(jnp.float32))
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(f, (jnp.ones(2),), (jnp.ones(2),))


def test_strict_precision_keeps_each_equations_name_stack():
    # The audit and the planner find FP8 matmuls by their name scope: a strict program that dropped
    # it made `leanstep verify` call FP8 operands a compute-dtype failure (bf16 strict, FP8 current).
    from leanstep.blocks.rounding import strict_precision
    from leanstep.common.jaxprs import equations

    def f(x, w):
        with jax.named_scope("leanstep_fp8_current_e4m3_e5m2"):
            return (x @ w).sum()

    x = jnp.ones((4, 4), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(jax.grad(strict_precision(f)))(x, x)
    stacks = [str(e.source_info.name_stack) for e in equations(jaxpr) if e.primitive.name == "dot_general"]
    assert len(stacks) == 3 and all("leanstep_fp8_current_e4m3_e5m2" in s for s in stacks), stacks
