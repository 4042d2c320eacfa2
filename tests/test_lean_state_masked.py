"""Lean optimizer state under optimizers that give each parameter to one of several parts (issue 57,
item 1): Muon (optax's and ``leanstep train``'s default), ``optax.masked``, ``optax.partition`` and
``optax.multi_transform``.

Their states hold each moment as a tree of the parameters' structure with ``optax.MaskedNode`` at
the parameters another part owns. 0.12 compared such a tree with the parameters' structure, found
no match, and kept every moment in float32 under ``moments="int8"`` or ``"bfloat16"``, silently.
The references: the bytes of the state's leaves against the bytes each moment's leaves must take
(1 an element and 4 a block of 256 along the last axis; 2 an element in bfloat16), and the
optimizer in float32 whose moments, and nothing else, go through 8 bits after each update.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from leanstep.blocks.moments import QuantizedArray, dequantize, quantize
from leanstep.models import build_model
from leanstep.training.build import build_optimizer
from leanstep.training.config import RunConfig

PARAMS = {"w": jnp.ones((64, 32)), "b": jnp.ones(32), "v": jnp.ones((3, 300))}
MASK = {"w": True, "b": False, "v": True}


def _optimizers() -> dict[str, tuple[optax.GradientTransformation, dict[str, int]]]:
    """name -> (optimizer, {param: number of moments kept for it}) on :data:`PARAMS`."""
    adam, sgd = optax.adam(1e-3), optax.sgd(1e-2, momentum=0.9)
    labels = {"w": "adam", "b": "sgd", "v": "adam"}
    return {
        # Muon for the 2-D matrices (its mu), Adam for the bias (mu and nu)
        "muon": (optax.contrib.muon(0.02), {"w": 1, "v": 1, "b": 2}),
        "masked": (optax.masked(adam, MASK), {"w": 2, "v": 2, "b": 0}),
        "partition": (optax.partition({"adam": adam, "sgd": sgd}, labels), {"w": 2, "v": 2, "b": 1}),
        "multi_transform": (optax.multi_transform({"adam": adam, "sgd": sgd}, labels), {"w": 2, "v": 2, "b": 1}),
    }


def _bytes(tree) -> int:
    """The bytes of a tree's leaves (XLA's argument size pads them to a TPU's tiles)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _form_bytes(shape: tuple[int, ...], moments: str) -> int:
    """One moment's bytes of a leaf of ``shape``, from its elements and blocks."""
    elements = math.prod(shape)
    if moments == "bfloat16":
        return 2 * elements
    blocks = math.prod(shape[:-1]) * -(-shape[-1] // 256)
    return elements + 4 * blocks


@pytest.mark.parametrize("moments", ["int8", "bfloat16"])
@pytest.mark.parametrize("name", list(_optimizers()))
def test_every_moment_of_a_masked_optimizer_is_compressed_to_its_bytes(name, moments):
    tx, counts = _optimizers()[name]
    full = _bytes(leanstep.TrainState.create(PARAMS, tx).opt_state)
    lean = _bytes(leanstep.TrainState.create(PARAMS, tx, moments=moments).opt_state)
    saved = sum(n * (4 * math.prod(PARAMS[k].shape) - _form_bytes(PARAMS[k].shape, moments)) for k, n in counts.items())
    assert full - lean == saved


def _through_8_bits(state):
    """The reference's state map: every moment field of optax's states through 8 bits, MaskedNodes as they are."""
    signed = {("ScaleByAdamState", "mu"): True, ("ScaleByAdamState", "nu"): False}
    signed |= {("MuonState", "mu"): True, ("TraceState", "trace"): True}
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        kind = type(state).__name__
        return type(state)(
            *(
                jax.tree.map(lambda x, s=signed[kind, f]: dequantize(quantize(x, signed=s, block_size=256)), v)
                if (kind, f) in signed
                else _through_8_bits(v)
                for f, v in zip(state._fields, state)
            )
        )
    if isinstance(state, (tuple, list)):
        return type(state)(_through_8_bits(x) for x in state)
    if isinstance(state, dict):
        return {k: _through_8_bits(v) for k, v in state.items()}
    return state


@pytest.mark.parametrize("name", list(_optimizers()))
def test_8_bit_moments_of_a_masked_optimizer_equal_float32_with_its_moments_through_8_bits(name):
    tx = _optimizers()[name][0]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), PARAMS)
    gradients = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(6)]

    def run(tx, after):
        @jax.jit
        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), after(state)

        p, state = params, after(tx.init(params))
        for grads in gradients:
            p, state = step(p, state, grads)
        return p

    reference = run(tx, _through_8_bits)
    lean = run(leanstep.blocks.compress_moments(tx, "int8"), lambda state: state)
    for key in params:
        assert np.asarray(lean[key]).tobytes() == np.asarray(reference[key]).tobytes(), key


def test_the_runs_muon_keeps_its_moments_in_the_form_asked():
    """``build_optimizer(RunConfig(optimizer="muon"))`` on the tiny transformer: 0.12 kept 54,300 bytes for each form."""
    model = build_model("transformer", "tiny")
    params = jax.eval_shape(model.init, jax.random.key(0))
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    tx, _ = build_optimizer(RunConfig(optimizer="muon"))
    sizes = {
        m: _bytes(leanstep.TrainState.create(params, tx, moments=m).opt_state) for m in ("float32", "bfloat16", "int8")
    }
    leaves = jax.tree.leaves(params)
    # Muon keeps one moment of each stacked matrix, Adam two of every other leaf
    moments = [(p.shape, 1 if p.ndim == 3 else 2) for p in leaves]
    for form in ("bfloat16", "int8"):
        saved = sum(n * (4 * math.prod(s) - _form_bytes(s, form)) for s, n in moments)
        assert sizes["float32"] - sizes[form] == saved, form
    state = leanstep.TrainState.create(params, tx, moments="int8").opt_state
    assert any(
        isinstance(x, QuantizedArray) for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, QuantizedArray))
    )


def test_a_masked_optimizer_whose_only_params_shaped_state_is_weights_is_refused_naming_it():
    tx = optax.masked(optax.contrib.schedule_free_sgd(1e-2), MASK)
    with pytest.raises(ValueError, match=r"^moments 'int8': .*ScheduleFreeState\.z.*no moment.*moments='float32'$"):
        leanstep.TrainState.create(PARAMS, tx, moments="int8")


def test_a_muon_step_with_8_bit_moments_trains_and_skips_as_the_float32_one():
    """Through leanstep's step: the loss falls as with float32 moments, and a non-finite step keeps the compressed state bit for bit."""

    def loss(params, batch):
        return jnp.mean((jnp.tanh(batch["x"] @ params["w"]) @ params["v"] - batch["y"]) ** 2) + jnp.sum(
            params["b"] ** 2
        )

    rng = np.random.default_rng(1)
    params = {
        "w": jnp.asarray(rng.normal(size=(16, 32)) * 0.3, jnp.float32),
        "v": jnp.asarray(rng.normal(size=(32, 4)) * 0.3, jnp.float32),
        "b": jnp.asarray(rng.normal(size=(8,)), jnp.float32),
    }
    batch = {
        "x": jnp.asarray(rng.normal(size=(32, 16)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(32, 4)), jnp.float32),
    }
    step = leanstep.make_train_step(loss, num_microbatches=2, max_grad_norm=1.0)
    losses = {}
    for moments in ("float32", "int8"):
        state = leanstep.TrainState.create(params, optax.contrib.muon(0.02), moments=moments)
        for _ in range(30):
            state, metrics = step(state, batch)
        losses[moments] = float(metrics.loss)
    assert losses["int8"] < 0.5 * float(loss(params, batch))
    assert abs(losses["int8"] - losses["float32"]) < 0.1 * losses["float32"]
    before = [np.asarray(x).copy() for x in jax.tree.leaves(state.opt_state)]  # the step donates the state
    bad = {"x": batch["x"].at[0, 0].set(jnp.nan), "y": batch["y"]}
    state, metrics = step(state, bad)
    assert bool(metrics.skipped)
    for a, b in zip(before, jax.tree.leaves(state.opt_state), strict=True):
        assert a.tobytes() == np.asarray(b).tobytes()
