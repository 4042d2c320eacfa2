"""The int8 step composes (leanstep.blocks.int8 in the tiny transformer, one device): microbatches in one
scan, the dynamic loss scale and its skip, clipping, lean state, int8 products in the compiled step,
the frameworks' modules, and a checkpointed run resumed bit for bit.

Gradients are read exactly as the optimizer got them (``int8_models.keep_gradient``); a difference is
``largest_difference``: the largest ``|a - b|`` of a leaf over its largest ``|a|``. The meshes, remat
and the bf16 microbatch tolerances are in tests/test_int8_meshes.py (one subprocess, 4 simulated
devices, XLA's excess precision off).
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import leanstep
from helpers.bits import leaves_bit_equal
from helpers.fp8_models import D_HIDDEN, D_IN, D_OUT
from helpers.fp8_models import batch as mlp_batch
from helpers.int8_models import BF16, TX, batch, bit_equal, gradient, largest_difference, model, params
from leanstep.blocks.int8 import Int8Recipe, int8_matmul
from leanstep.blocks.loss_scale import DynamicLossScale
from leanstep.blocks.moments import QuantizedArray
from test_accumulation import walk
from test_fp8_train import _argv, _final_state

#: M=1 against M=4 in float32 compute: measured 3.3e-7 (summation order only).
F32_MICROBATCHES = 4e-6


def _loss(weight_grad: str | None = "compute"):
    m = model(weight_grad)
    return lambda p, b: m.loss(p, b)


@pytest.fixture(scope="module")
def float32_gradients() -> dict:
    """weight_grad -> M -> the gradient of one float32-compute step (M=1 and M=4)."""
    out: dict = {}
    for weight_grad in ("compute", "int8"):
        for m in (1, 4):
            step = leanstep.make_train_step(_loss(weight_grad), precision="float32", num_microbatches=m)
            state, _ = step(leanstep.TrainState.create(params(), TX), batch())
            out.setdefault(weight_grad, {})[m] = gradient(state)
    return out


def test_four_microbatches_give_one_microbatchs_gradient_within_float32_rounding(float32_gradients):
    """The forward and input-gradient products quantize per token, the same in any microbatch; each
    microbatch's cotangent is 4x the whole batch's (a power of two: the same int8 values), so with
    weight_grad="compute" only the order of the float32 sums changes. A scale computed over a
    microbatch's rows (per tensor, or per column over tokens) would not hold it: the int8 weight
    gradient, whose per-column scales read the microbatch's rows, is the control (measured 1.3%)."""
    got = largest_difference(float32_gradients["compute"][1], float32_gradients["compute"][4])
    assert got <= F32_MICROBATCHES, got
    control = largest_difference(float32_gradients["int8"][1], float32_gradients["int8"][4])
    assert 100 * F32_MICROBATCHES < control < 0.05, control  # int8's step is 1/127: a few steps of it


def test_the_four_microbatch_step_is_one_scan_with_every_int8_product_inside():
    """One ``scan`` of length 4 outside any other (the layers' scans run inside it), and the int8
    products (s8 x s8 -> s32) all in its body: 4 forward and 4 input-gradient products a layer."""
    step = leanstep.make_train_step(_loss(), precision=BF16, num_microbatches=4)
    closed = step.trace(leanstep.TrainState.create(params(), TX), batch()).jaxpr
    outer = [e for e in walk(closed.jaxpr, into_scans=False) if e.primitive.name == "scan"]
    assert [e.params["length"] for e in outer] == [4]

    def int8_dots(eqns):
        return [
            e
            for e in eqns
            if e.primitive.name == "dot_general" and {v.aval.dtype for v in e.invars} == {jnp.dtype(jnp.int8)}
        ]

    assert not int8_dots(walk(closed.jaxpr, into_scans=False))
    inside = int8_dots(walk(outer[0].params["jaxpr"].jaxpr, into_scans=True))
    assert len(inside) == 8 and all(e.outvars[0].aval.dtype == jnp.int32 for e in inside)


# --- the dynamic loss scale, its skip, and clipping ----------------------------------------------------


def _weighted(seed: int = 0, planted: bool = False) -> dict:
    """A batch with token weights (``mask``): all ones, or (planted) one of them inf, whose token's
    cotangent (inf / inf) enters the int8 products' backward non-finite."""
    mask = np.ones((8, 16), np.float32)
    mask[3, 5] = np.inf if planted else 1.0
    return {**batch(seed), "mask": mask}


@pytest.fixture(scope="module")
def scaled_steps() -> dict:
    """The bf16 int8 step under a dynamic loss scale: a step at scales 1 and 2**15 from the same
    state, then (from the 2**15 step's state) one with an inf planted, and the clipped step at 2**15."""
    step = leanstep.make_train_step(_loss(), precision=BF16)
    new = lambda s: leanstep.TrainState.create(params(), TX, loss_scale=DynamicLossScale.create(s))
    out = {s: step(new(s), _weighted()) for s in (1.0, 2.0**15)}
    before = jax.device_get(out[2.0**15][0])  # host copies: the step donates the state it is given
    out["planted"] = (before, *step(jax.device_put(before), _weighted(1, planted=True)))
    clipped = leanstep.make_train_step(_loss(), precision=BF16, max_grad_norm=0.1)
    out["clipped"] = clipped(new(2.0**15), _weighted())
    out["step"] = step
    return out


def test_a_power_of_two_loss_scale_gives_the_unscaled_step_bit_for_bit(scaled_steps):
    """q(S g) = q(g) and s(S g) = S s(g) for S a power of two, and unscaling is exact: measured bit
    for bit (params, gradient, loss, norm). A scale that reached the quantized values, or an unscale
    that missed one product, would not be."""
    (one, m1), (big, m15) = scaled_steps[1.0], scaled_steps[2.0**15]
    assert not bool(m1.skipped) and not bool(m15.skipped)
    leaves_bit_equal((one.params, gradient(one)), (big.params, gradient(big)))
    assert float(m1.loss) == float(m15.loss) and float(m1.grad_norm) == float(m15.grad_norm)


def test_a_non_finite_gradient_is_skipped_leaving_the_state_bit_identical_and_the_scale_halved(scaled_steps):
    """The planted inf: the step is skipped, params and optimizer state (the last gradient) bit for
    bit, and the scale halves. An update applied anyway would write non-finite values.

    (A huge scale overflows too: the int8 products dequantize their int32 sum times the gradient's
    scale before the weight's, so the int8 gradient overflows from a scale of 2**125-2**126, where
    the bf16 model's stays finite at 2**127; measured, far above the dynamic scale's 2**24 ceiling.)"""
    before, after, metrics = scaled_steps["planted"]
    assert bool(metrics.skipped) and not np.isfinite(float(metrics.grad_norm))
    leaves_bit_equal((before.params, before.opt_state), (after.params, after.opt_state))
    assert float(after.loss_scale.loss_scale) == 2.0**14 and int(after.consecutive_skips) == 1


def test_the_clip_reads_the_int8_gradient_unscaled(scaled_steps):
    """With the clip active (norm 0.61 against 0.1, at loss scale 2**15), the optimizer gets the
    unclipped step's int8 gradient times 0.1 / norm (measured within 1.7 float32 ulps), and the norm
    reported is that gradient's (float64 reference). A clip of the scaled gradient, of another
    gradient, or per microbatch would not give it."""
    (state, metrics), (plain, _) = scaled_steps["clipped"], scaled_steps[1.0]
    reference = gradient(plain)
    norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(reference)))
    assert bool(metrics.clipped) and float(metrics.grad_norm) == pytest.approx(norm, rel=1e-6) and norm > 0.5
    for got, want in zip(jax.tree.leaves(gradient(state)), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64) * 0.1 / norm, rtol=4e-7)


def test_the_step_runs_int8_products_the_bf16_step_does_not(scaled_steps):
    """The compiled step (XLA:CPU) runs the 8 int8 products of a layer (4 forward, 4 input
    gradient; the layers are one scan) as s8 x s8 -> s32 dots, and its other 13 dots in float32
    (XLA:CPU widens bf16 dots). Lowered, the same 8; 12 with weight_grad="int8"; none without int8."""
    state, _ = scaled_steps[1.0]
    compiled = scaled_steps["step"].lower(state, _weighted()).compile().as_text()
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", compiled))
    dots = re.findall(r"= (\w+)\[[^\]]*\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", compiled)
    kinds = [(types[a], types[b], out) for out, a, b in dots]
    assert kinds.count(("s8", "s8", "s32")) == 8 and len(kinds) == 21, kinds
    signature = re.compile(
        r"stablehlo\.dot_general[^\n]*: \(tensor<([\dx]*)x(\w+)>, tensor<([\dx]*)x(\w+)>\) -> tensor<[\dx]*x(\w+)>"
    )
    for weight_grad, count in (("compute", 8), ("int8", 12), (None, 0)):
        step = leanstep.make_train_step(_loss(weight_grad), precision=BF16)
        text = step.lower(leanstep.TrainState.create(params(), TX), batch()).as_text()
        lowered = [m.group(2, 4, 5) for m in signature.finditer(text)]
        assert lowered.count(("i8", "i8", "i32")) == count and len(lowered) == 21, (weight_grad, lowered)
        assert all(t == ("i8", "i8", "i32") or "i8" not in t for t in lowered)


# --- the frameworks' modules -------------------------------------------------------------------------

RECIPE = Int8Recipe()


def _weights():
    k1, k2 = jax.random.split(jax.random.key(0))
    return jax.random.normal(k1, (D_IN, D_HIDDEN)) * 0.3, jax.random.normal(k2, (D_HIDDEN, D_OUT)) * 0.3


def _mlp(x, w1, w2, matmul=lambda a, b: int8_matmul(a, b, RECIPE)):
    return matmul(jnp.tanh(matmul(x, w1)), w2)


def _mse(out, b):
    return jnp.mean((out.astype(jnp.float32) - b["y"]) ** 2)


@pytest.fixture(scope="module")
def mlp_gradients() -> dict:
    """The MLP's gradient by ``jax.grad`` on the same weights, no framework and no step: with
    ``int8_matmul`` (tests/test_int8.py holds it to NumPy) and with ``jnp.matmul``. In float32, where
    a program's fusions cannot keep an intermediate in more precision than another's (bf16 can:
    XLA's excess precision), so the step's gradient can be held to it bit for bit."""
    b = mlp_batch(0)

    def gradient_with(matmul):
        return list(jax.grad(lambda w: _mse(_mlp(b["x"], *w, matmul=matmul), b))(_weights()))

    return {"int8": gradient_with(lambda a, w: int8_matmul(a, w, RECIPE)), "float32": gradient_with(jnp.matmul)}


def _trains_one_step_as_int8_matmul_alone(loss, weights, mlp_gradients, model_state=None):
    state = leanstep.TrainState.create(weights, TX, model_state=model_state)
    step = leanstep.make_train_step(loss, precision="float32", has_state=model_state is not None)
    state, metrics = step(state, mlp_batch(0))
    assert not bool(metrics.skipped)
    got = jax.tree.leaves(gradient(state))
    assert [g.shape for g in got] == [(D_IN, D_HIDDEN), (D_HIDDEN, D_OUT)]
    for a, b in zip(got, mlp_gradients["int8"], strict=True):  # measured bit for bit
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert largest_difference(mlp_gradients["float32"], got) > 1e-2  # int8 ran: float32's is 5.0% away (measured)
    return state


def test_an_nnx_module_calling_int8_matmul_trains_through_the_step(mlp_gradients):
    """A Flax NNX module whose call is ``int8_matmul`` on its ``nnx.Param`` s, through
    ``leanstep.frameworks.nnx``: the step's gradient is ``int8_matmul``'s, bit for bit."""
    from flax import nnx

    from leanstep.frameworks import nnx as lnnx

    class Int8Mlp(nnx.Module):
        def __init__(self):
            w1, w2 = _weights()
            self.w1, self.w2 = nnx.Param(w1), nnx.Param(w2)

        def __call__(self, x):
            return _mlp(x, self.w1[...], self.w2[...])

    graphdef, weights, model_state = lnnx.split(Int8Mlp())
    loss = lnnx.loss(graphdef, lambda module, b: _mse(module(b["x"]), b))
    state = _trains_one_step_as_int8_matmul_alone(loss, weights, mlp_gradients, model_state)
    trained = lnnx.merge(graphdef, state.params, state.model_state)
    assert not np.array_equal(np.asarray(trained.w1[...]), np.asarray(_weights()[0]))


def test_an_equinox_module_calling_int8_matmul_trains_through_the_step(mlp_gradients):
    """An Equinox module holding the weights as fields, through ``leanstep.frameworks.equinox``."""
    eqx = pytest.importorskip("equinox")
    from leanstep.frameworks import equinox as leqx

    class Int8Mlp(eqx.Module):
        w1: jax.Array
        w2: jax.Array

        def __call__(self, x):  # on the whole batch: the scales are per token
            return _mlp(x, self.w1, self.w2)

    weights, static = leqx.split(Int8Mlp(*_weights()))
    loss = leqx.loss(static, lambda module, b: _mse(module(b["x"]), b))
    _trains_one_step_as_int8_matmul_alone(loss, weights, mlp_gradients)


# --- a lean run, checkpointed and resumed ---------------------------------------------------------

#: bf16 compute (on CPU --precision auto is float32), bfloat16 masters with stochastic rounding and
#: 8-bit moments, a faster warmup than the default's 30 steps; 2 microbatches, remat "dots", Muon
#: and a dynamic loss scale are the run's defaults.
LEAN = ["--precision", "compute=bfloat16", "--master", "bfloat16-sr", "--moments", "int8"]
LEAN += ["--lr", "1e-2", "--warmup-steps", "5", "--steps", "20"]


@pytest.fixture(scope="module")
def lean_runs(tmp_path_factory, tiny_corpus, cli) -> dict:
    """``leanstep train`` (in this process) 20 steps straight, and stopped at step 10 then resumed."""
    root = tmp_path_factory.mktemp("int8_runs")
    runs = {"straight": root / "straight", "resumed": root / "resumed"}
    for name, extra in (("straight", ()), ("resumed", ("--stop-at", "10")), ("resumed", ("--resume",))):
        result = cli(*_argv(tiny_corpus, runs[name], "--int8", "on", *LEAN, *extra))
        assert result.code == 0, result.err[-3000:]
    return runs


def _lines(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("tokens_per_sec", "elapsed_s")} for r in rows]


def test_lean_state_trains_the_int8_model_with_falling_loss_and_no_skip(lean_runs):
    """The int8 run with bf16 masters (stochastic rounding) and 8-bit moments: 20 steps, none
    skipped, the loss down by more than 1 nat (measured: 5.44 to 3.33, means of 4). A lean state the int8
    gradient broke (non-finite moments, masters that never move) would not train."""
    train = [r for r in _lines(lean_runs["straight"]) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 21)) and not any(r["skipped"] for r in train)
    losses = [r["loss"] for r in train]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 1.0, losses
    _, state = _final_state(lean_runs["straight"])
    assert state.master == "bfloat16-sr" and jax.tree.leaves(state.params)[0].dtype == jnp.bfloat16
    assert any(
        isinstance(x, QuantizedArray)
        for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, QuantizedArray))
    )


def test_an_int8_run_stopped_and_resumed_ends_bit_identical_to_a_straight_one(lean_runs):
    """Stopped at step 10 (a checkpoint) and resumed: every leaf of the final state, masters, 8-bit
    moments and the rounding key included, and every metrics line but the clock's, the same."""
    (step_a, a), (step_b, b) = _final_state(lean_runs["straight"]), _final_state(lean_runs["resumed"])
    assert step_a == step_b == 20
    assert bit_equal(jax.tree.leaves(a), jax.tree.leaves(b))
    assert _lines(lean_runs["straight"]) == _lines(lean_runs["resumed"])


def test_the_recipe_is_the_runs_and_a_resume_without_it_is_refused(lean_runs, cli, tiny_corpus):
    """Recorded as the run's and its step's; resumed with ``--int8 none`` the run would go on with
    other matmuls than its checkpoint's: refused (exit 2), naming int8, nothing trained."""
    run = lean_runs["resumed"]
    saved = json.loads((run / "config.json").read_text())
    assert saved["run"]["int8"] == saved["step"]["int8"] == "on"
    lines = (run / "metrics.jsonl").read_text()
    refused = cli(*_argv(tiny_corpus, run, "--int8", "none", *LEAN, "--resume", "--steps", "21"))
    assert refused.code == 2 and "int8" in refused.err, refused.err[-2000:]
    assert (run / "metrics.jsonl").read_text() == lines
