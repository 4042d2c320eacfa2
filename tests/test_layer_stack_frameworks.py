"""The update inside the backward pass for framework models (leanstep.frameworks.*.layer_stack): a
Flax Linen nn.scan model, an NNX model with nnx.vmap-made layers run by nnx.scan and an Equinox model
with eqx.filter_vmap-made layers, each as its LayerStack: the model's own loss, and the step against
the standard step on it (AdamW, the clip acting, M 1 and 2, float32); a model that breaks the LayerStack
contract refused in one line naming it, before the model is traced."""

from __future__ import annotations

import traceback

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from leanstep import StepSpec, TrainState, make_train_step
from leanstep.frameworks import equinox as leqx
from leanstep.frameworks import linen as llinen
from leanstep.frameworks import nnx as lnnx

LAYERS, WIDTH = 3, 8


def _batch(seed=1):
    k = jax.random.split(jax.random.key(seed), 2)
    return {"x": jax.random.normal(k[0], (4, 3)), "y": jax.random.normal(k[1], (4, 2))}


def _mse(out, batch):
    return jnp.mean((out - batch["y"]) ** 2)


# Flax Linen: the layers an nn.scan, the model setup-style with embed and head methods.
class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + jnp.tanh(nn.Dense(WIDTH)(x)), None


class LinenModel(nn.Module):
    def setup(self):
        self.inp, self.out = nn.Dense(WIDTH), nn.Dense(2)
        scan = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
        self.blocks = scan()

    def embed(self, batch):
        return self.inp(batch["x"])

    def head(self, x, batch):
        return _mse(self.out(x), batch)

    def __call__(self, batch):
        x, _ = self.blocks(self.embed(batch), None)
        return self.head(x, batch)


class LinenLoop(nn.Module):
    """Its layers a Python loop of modules: no stacked parameters."""

    def setup(self):
        self.inp, self.out = nn.Dense(WIDTH), nn.Dense(2)
        self.layers = [LinenBlock() for _ in range(LAYERS)]

    def embed(self, batch):
        return self.inp(batch["x"])

    def head(self, x, batch):
        return _mse(self.out(x), batch)

    def __call__(self, batch):
        x = self.embed(batch)
        for block in self.layers:
            x, _ = block(x, None)
        return self.head(x, batch)


def _linen():
    model = LinenModel()
    params, _ = llinen.split(model.init(jax.random.key(0), _batch()))
    stack = llinen.layer_stack(model, "blocks", layer=LinenBlock(), embed="embed", head="head")
    return stack, params, lambda p, batch: model.apply({"params": p}, batch)


# NNX: the layers made by nnx.vmap over the constructor, run by nnx.scan.
class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.linear(x))


class NnxModel(nnx.Module):
    def __init__(self, rngs, norm=False):
        self.inp, self.out = nnx.Linear(3, WIDTH, rngs=rngs), nnx.Linear(WIDTH, 2, rngs=rngs)
        self.blocks = nnx.vmap(NnxBlock)(rngs.split(LAYERS))
        self.norm = nnx.BatchNorm(WIDTH, rngs=rngs) if norm else None

    def __call__(self, batch):
        forward = nnx.scan(lambda x, block: block(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        return _mse(self.out(forward(self.inp(batch["x"]), self.blocks)), batch)


def _nnx():
    model = NnxModel(nnx.Rngs(0))
    graphdef, params, _ = lnnx.split(model)
    stack = lnnx.layer_stack(
        model,
        "blocks",
        embed=lambda m, batch: m.inp(batch["x"]),
        layer=lambda block, x: block(x),
        head=lambda m, x, batch: _mse(m.out(x), batch),
    )
    return stack, params, lnnx.loss(graphdef, lambda m, batch: m(batch))


# Equinox: the layers made by eqx.filter_vmap over the constructor, run by lax.scan.
class EqxBlock(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(WIDTH, WIDTH, key=key)

    def __call__(self, x):
        return x + jnp.tanh(jax.vmap(self.linear)(x))


class EqxModel(eqx.Module):
    inp: eqx.nn.Linear
    layers: EqxBlock | list
    out: eqx.nn.Linear

    def __init__(self, key, stacked=True):
        keys = jax.random.split(key, 3)
        self.inp, self.out = eqx.nn.Linear(3, WIDTH, key=keys[0]), eqx.nn.Linear(WIDTH, 2, key=keys[1])
        layer_keys = jax.random.split(keys[2], LAYERS)
        self.layers = eqx.filter_vmap(EqxBlock)(layer_keys) if stacked else [EqxBlock(k) for k in layer_keys]

    def __call__(self, batch):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)
        body = lambda x, layer: (eqx.combine(layer, static)(x), None)
        x, _ = jax.lax.scan(body, jax.vmap(self.inp)(batch["x"]), dynamic)
        return _mse(jax.vmap(self.out)(x), batch)


def _equinox():
    model = EqxModel(jax.random.key(0))
    params, static = leqx.split(model)
    stack = leqx.layer_stack(
        model,
        "layers",
        embed=lambda m, batch: jax.vmap(m.inp)(batch["x"]),
        layer=lambda block, x: block(x),
        head=lambda m, x, batch: _mse(jax.vmap(m.out)(x), batch),
    )
    return stack, params, leqx.loss(static, lambda m, batch: m(batch))


FRAMEWORKS = {"linen": _linen, "nnx": _nnx, "equinox": _equinox}


def _relative(a, b) -> float:
    """The largest difference of two leaves over the first's largest magnitude (0 where equal)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size == 0 or np.array_equal(a, b, equal_nan=True):
        return 0.0
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30))


def _run(loss, spec, state, steps):
    step, metrics = make_train_step(loss, spec), []
    for t in range(steps):
        state, m = step(state, _batch(1 + t % 2))
        metrics.append(m)
    return state, metrics


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_the_stack_is_the_models_own_loss(framework):
    stack, params, model_loss = FRAMEWORKS[framework]()
    assert float(stack(params, _batch())) == pytest.approx(float(model_loss(params, _batch())), rel=1e-6)
    top, stacked = stack.split(params)
    assert {jnp.shape(leaf)[0] for leaf in jax.tree.leaves(stacked)} == {LAYERS}
    assert len(jax.tree.leaves(top)) + len(jax.tree.leaves(stacked)) == len(jax.tree.leaves(params))


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_the_update_in_the_backward_pass_equals_the_standard_step(framework, microbatches):
    stack, params, _ = FRAMEWORKS[framework]()
    norm = (
        float(jax.tree.reduce(jnp.add, jax.tree.map(lambda g: jnp.sum(g * g), jax.grad(stack)(params, _batch()))))
        ** 0.5
    )
    spec = StepSpec.from_keywords(num_microbatches=microbatches, max_grad_norm=norm / 2, loss_scale="dynamic")
    make = lambda: TrainState.create(params, optax.adamw(1e-2, weight_decay=0.1), spec)
    a, ma = _run(stack, spec, make(), 4)
    b, mb = _run(stack, spec.replace(update_in_backward=True), make(), 4)
    assert type(b.params) is type(params)  # the framework's own tree: an nnx.State, an eqx.Module
    assert all(bool(m.clipped) for m in ma + mb) and not any(bool(m.skipped) for m in ma + mb)
    worst = max(_relative(x, y) for x, y in zip(jax.tree.leaves((a, ma)), jax.tree.leaves((b, mb)), strict=True))
    assert worst <= 1e-6, worst
    assert float(mb[2].loss) < float(mb[0].loss)  # the same batch, two steps later


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_lean_states_and_bfloat16_compute_compose(framework):
    """bf16-sr masters and int8 moments: the standard step's masters bit for bit (float32 compute);
    bfloat16 compute: the same losses to 1e-4 (the two programs' fusions round in other places)."""
    stack, params, _ = FRAMEWORKS[framework]()
    spec = StepSpec.from_keywords(
        num_microbatches=2, max_grad_norm=1.0, loss_scale="dynamic", master="bfloat16-sr", moments="int8"
    )
    make = lambda: TrainState.create(params, optax.adamw(1e-2, weight_decay=0.1), spec)
    a, _ = _run(stack, spec, make(), 3)
    b, _ = _run(stack, spec.replace(update_in_backward=True), make(), 3)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True))
    spec = spec.replace(precision="compute=bfloat16")
    (_, standard), (_, layerwise) = (_run(stack, s, make(), 3) for s in (spec, spec.replace(update_in_backward=True)))
    np.testing.assert_allclose([float(m.loss) for m in layerwise], [float(m.loss) for m in standard], rtol=1e-4)


def _refusal(call) -> str:
    """The one-line message ``call`` is refused with, checked to be raised before Flax or Equinox ran."""
    with pytest.raises((TypeError, ValueError)) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and "the LayerStack contract" in message, message
    files = [frame.filename for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert not any("/flax/" in f or "/equinox/" in f for f in files[files.index(__file__) + 1 :]), files
    return message


def test_a_linen_model_without_nn_scan_is_refused_naming_the_contract():
    model, batch = LinenLoop(), _batch()
    params, _ = llinen.split(model.init(jax.random.key(0), batch))
    spec = StepSpec(update_in_backward=True)
    state = TrainState.create(params, optax.adamw(1e-2), spec)
    stack = llinen.layer_stack(model, "blocks", layer=LinenBlock(), embed="embed", head="head")
    assert "no stacked layers under 'blocks'" in _refusal(lambda: make_train_step(stack, spec)(state, batch))
    # One unscanned layer's params look stacked (kernel (8, 8), bias (8,)): its rows are not the layer's.
    stack = llinen.layer_stack(model, "layers_0", layer=LinenBlock(), embed="embed", head="head")
    with pytest.raises(
        ValueError, match=r"a row of params at 'layers_0' is .* but LinenBlock's own .*LayerStack contract"
    ):
        make_train_step(stack, spec)(state, batch)
    with pytest.raises(TypeError, match="embed must be a method of LinenLoop.*LayerStack contract"):
        llinen.layer_stack(model, "blocks", layer=LinenBlock(), embed="embedding", head="head")


def test_nnx_models_that_break_the_contract_are_refused_naming_it():
    class Listed(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])

    functions = {"embed": lambda m, b: b["x"], "layer": lambda block, x: block(x), "head": lambda m, x, b: 0.0}
    assert "is a List, not one module" in _refusal(lambda: lnnx.layer_stack(Listed(nnx.Rngs(0)), "blocks", **functions))
    normed = NnxModel(nnx.Rngs(0), norm=True)
    assert "not nnx.Param (BatchStat)" in _refusal(lambda: lnnx.layer_stack(normed, "blocks", **functions))
    assert "no module at 'layers'" in _refusal(lambda: lnnx.layer_stack(NnxModel(nnx.Rngs(0)), "layers", **functions))
    # One unstacked layer: its kernel (3, 8) and bias (8,) do not share a leading axis.
    assert "leading axes differ" in _refusal(lambda: lnnx.layer_stack(NnxModel(nnx.Rngs(0)), "inp", **functions))


def test_equinox_models_that_break_the_contract_are_refused_naming_it():
    functions = {"embed": lambda m, b: b["x"], "layer": lambda block, x: block(x), "head": lambda m, x, b: 0.0}
    listed = EqxModel(jax.random.key(0), stacked=False)
    assert "is a list, not one module" in _refusal(lambda: leqx.layer_stack(listed, "layers", **functions))
    model = EqxModel(jax.random.key(0))
    assert "no module at 'blocks'" in _refusal(lambda: leqx.layer_stack(model, "blocks", **functions))
    # An MLP's weights (8, 3), (2, 8) do not share a leading axis. (An eqx.nn.Linear's weight (out, in)
    # and bias (out,) do: shapes cannot tell one such layer from a stack, docs/in-backward.md says so.)
    mlp = eqx.tree_at(lambda m: m.layers, model, eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(1)))
    assert "leading axes differ" in _refusal(lambda: leqx.layer_stack(mlp, "layers", **functions))
    assert "model must be an eqx.Module" in _refusal(lambda: leqx.layer_stack({"layers": 1}, "layers", **functions))


def test_a_plain_loss_function_is_refused_naming_the_contract():
    _, _, model_loss = _equinox()
    spec = StepSpec(update_in_backward=True)
    message = _refusal(lambda: make_train_step(model_loss, spec))
    assert "needs the loss as a leanstep.LayerStack" in message
