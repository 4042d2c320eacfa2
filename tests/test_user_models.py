"""Three of issue 27's real models re-created: the structure users bring, trained as they would.

* **flax's imagenet ResNet**: Linen blocks of convolutions with ``nn.BatchNorm(axis_name="batch")``
  (written for ``pmap``). Through ``leanstep.frameworks.linen.apply(..., axis_name="batch")`` it
  trains with no glue: in float32 with one microbatch its parameters and running statistics equal
  its own ``pmap`` loop's (one device); with bf16, a dynamic loss scale, 4 microbatches, clipping
  and remat its loss falls like the loop's, its running statistics stay float32, and every
  convolution and matmul runs in bf16 (a PrecisionWarning would fail the test: pytest turns
  warnings into errors). Before 0.8.1: JAX's "unbound axis name: batch".
* **flax's lm1b TransformerLM**: model code that casts with ``x.astype(config.dtype)``. Built with
  ``dtype=jnp.bfloat16`` every matmul runs in bf16; built with float32 or None (which
  ``astype`` reads as float32), leanstep warns once, with the advice for code that casts so
  (before, the advice said ``dtype=None``, under which such a model still computes in float32).
* **Equinox's stateful example**: ``eqx.nn.BatchNorm`` (mode "ema") with ``eqx.nn.State`` and no
  casts in the model, a submodule wrapped by ``leanstep.blocks.remat``: trains under bf16 with every
  technique (before 0.8.1: JAX's dtype TypeError from the layer's ``lax.select``), its running
  statistics float32 and near its own float32 loop's, every matmul in bf16.

The fourth, the NNX MNIST CNN with BatchNorm and Dropout, is tests/test_frameworks.py's.
"""

from __future__ import annotations

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from leanstep.frameworks import equinox as leqx
from leanstep.frameworks import linen as llinen
from test_frameworks import EVERYTHING, TX, assert_trees_close, falls_like, run, token_batches

# --- the imagenet ResNet's structure ---------------------------------------------------------------


def image_batches(steps: int, rows: int = 8) -> list[dict]:
    """Two batches of images, taken in turn, whose class (0, 1, 2) shifts their brightness."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(2):
        y = rng.integers(0, 3, rows).astype(np.int32)
        x = rng.normal(size=(rows, 6, 6, 1)).astype(np.float32) + (y - 1.0)[:, None, None, None]
        out.append({"x": jnp.asarray(x), "y": jnp.asarray(y)})
    return [out[t % 2] for t in range(steps)]


class ResNetBlock(nn.Module):
    filters: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=self.dtype, axis_name="batch"
        )
        y = nn.relu(norm()(conv(self.filters, (3, 3))(x)))
        y = norm(scale_init=nn.initializers.zeros)(conv(self.filters, (3, 3))(y))
        return nn.relu(conv(self.filters, (1, 1), name="conv_proj")(x) + y)


class ResNet(nn.Module):
    dtype: jnp.dtype = jnp.float32
    remat: str = "none"

    @nn.compact
    def __call__(self, x, train: bool = True):
        block = leanstep.blocks.remat(ResNetBlock, self.remat, static_argnums=(2,))
        x = block(4, self.dtype, name="block_0")(x.astype(self.dtype), train)  # named: one tree for every policy
        return nn.Dense(3, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))


def resnet_loss(module):
    def loss_fn(params, model_state, batch):
        logits, model_state = llinen.apply(module, params, model_state, batch["x"], axis_name="batch")
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["y"]).mean(), (
            model_state
        )

    return loss_fn


RESNET_TX = optax.adam(0.05)


def resnet_reference(module, variables, batches):
    """The imagenet example's way: a pmap'd step over axis "batch" (one device here), batch_stats
    from the mutable apply, optax on the params."""
    params, stats = variables["params"], variables["batch_stats"]
    opt_state = RESNET_TX.init(params)

    def train_step(params, stats, opt_state, batch):
        def loss_fn(params):
            logits, updates = module.apply(
                {"params": params, "batch_stats": stats}, batch["x"], mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, updates["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        grads = jax.lax.pmean(grads, "batch")
        updates, opt_state = RESNET_TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, loss

    p_step = jax.pmap(train_step, axis_name="batch", devices=jax.devices()[:1])
    lead = lambda tree: jax.tree.map(lambda a: a[None], tree)
    params, stats, opt_state = lead(params), lead(stats), lead(opt_state)
    losses = []
    for batch in batches:
        params, stats, opt_state, loss = p_step(params, stats, opt_state, lead(batch))
        losses.append(float(loss[0]))
    first = lambda tree: jax.tree.map(lambda a: a[0], tree)
    return first(params), first(stats), losses


@pytest.fixture(scope="module")
def resnet_runs():
    batches = image_batches(16, rows=8)
    variables = ResNet().init(jax.random.key(0), batches[0]["x"], train=False)
    params, model_state = llinen.split(variables)
    ref_params, ref_stats, _ = resnet_reference(ResNet(), variables, batches[:4])
    _, _, long_losses = resnet_reference(ResNet(), variables, batches)
    plain = leanstep.make_train_step(resnet_loss(ResNet()), has_state=True)
    plain_state, _ = run(plain, leanstep.TrainState.create(params, RESNET_TX, model_state=model_state), batches[:4])
    everything = leanstep.make_train_step(
        resnet_loss(ResNet(dtype=jnp.bfloat16, remat="dots")), has_state=True, **EVERYTHING
    )
    state = leanstep.TrainState.create(params, RESNET_TX, loss_scale="dynamic", model_state=model_state)
    state, losses = run(everything, state, batches)
    return {
        "plain": plain_state,
        "ref": (ref_params, ref_stats),
        "losses": losses,
        "ref_losses": long_losses,
        "state": state,
        "jaxpr": jax.make_jaxpr(everything.__wrapped__)(state, batches[0]),
    }


def test_a_resnet_with_batchnorm_axis_name_equals_its_pmap_loop_in_float32(resnet_runs):
    ref_params, ref_stats = resnet_runs["ref"]
    assert_trees_close(resnet_runs["plain"].params, ref_params)
    assert_trees_close(resnet_runs["plain"].model_state["batch_stats"], ref_stats)


def test_a_resnet_with_every_technique_learns_like_its_loop(resnet_runs):
    falls_like(resnet_runs["losses"], resnet_runs["ref_losses"])


def test_its_running_statistics_stay_float32_and_move(resnet_runs):
    stats = resnet_runs["state"].model_state["batch_stats"]
    leaves = jax.tree.leaves(stats)
    assert leaves and all(leaf.dtype == jnp.float32 for leaf in leaves)
    means = [
        np.asarray(v["mean"]) for v in jax.tree.leaves(stats, is_leaf=lambda d: isinstance(d, dict) and "mean" in d)
    ]
    assert any(np.abs(m).max() > 1e-3 for m in means)


def _matmul_kinds(jaxpr) -> set:
    from leanstep.common.jaxprs import MATMUL_PRIMITIVES, weighted_equations

    return {
        (eqn.primitive.name, tuple(str(v.aval.dtype) for v in eqn.invars[:2]))
        for eqn, _ in weighted_equations(jaxpr.jaxpr)
        if eqn.primitive.name in MATMUL_PRIMITIVES
    }


def test_every_convolution_and_matmul_of_the_bf16_resnet_runs_in_bf16(resnet_runs):
    kinds = _matmul_kinds(resnet_runs["jaxpr"])
    assert {name for name, _ in kinds} >= {"conv_general_dilated", "dot_general"}
    assert all(dtypes == ("bfloat16", "bfloat16") for _, dtypes in kinds), kinds


def test_without_axis_name_the_module_fails_naming_its_axis_name():
    """The bare apply of a pmap-written module has no axis to reduce over: JAX's "unbound axis name"
    until issue 41 (item 16), now one line naming the module's axis_name= (tests/test_user_mistakes.py)."""
    x = image_batches(1)[0]["x"]
    params, model_state = llinen.split(ResNet().init(jax.random.key(0), x, train=False))
    with pytest.raises(ValueError, match="ResNet reduces over the axis name 'batch'.*pass axis_name='batch'"):
        llinen.apply(ResNet(), params, model_state, x)


@pytest.mark.parametrize("bad", ["", 3])
def test_a_bad_axis_name_is_named(bad):
    x = image_batches(1)[0]["x"]
    params, model_state = llinen.split(ResNet().init(jax.random.key(0), x, train=False))
    with pytest.raises(TypeError, match="axis_name must be a non-empty string"):
        llinen.apply(ResNet(), params, model_state, x, axis_name=bad)


# --- the lm1b TransformerLM's casts ------------------------------------------------------------------


class CastingMlp(nn.Module):
    dtype: jnp.dtype | None

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x)).astype(self.dtype)
        return x + nn.Dense(16, dtype=self.dtype)(nn.gelu(h))


class CastingLM(nn.Module):
    """lm1b's habit: the model code casts activations with ``astype(config.dtype)``."""

    dtype: jnp.dtype | None = jnp.float32
    remat: str = "none"

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(32, 16)(tokens).astype(self.dtype)
        x = leanstep.blocks.remat(CastingMlp, self.remat)(self.dtype, name="mlp")(x)  # named: one tree for every policy
        return nn.Dense(32, dtype=self.dtype)(x.astype(self.dtype))


def lm1b_loss(module):
    def loss_fn(params, batch):  # the small loss adapter "unchanged model code" means
        logits = module.apply({"params": params}, batch["tokens"][:, :-1])
        labels = batch["tokens"][:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()

    return loss_fn


def _lm1b_jaxpr(dtype):
    batch = token_batches(1)[0]
    params = CastingLM().init(jax.random.key(0), batch["tokens"][:, :-1])["params"]
    step = leanstep.make_train_step(lm1b_loss(CastingLM(dtype=dtype)), jit=False, **EVERYTHING)
    return jax.make_jaxpr(step)(leanstep.TrainState.create(params, TX, loss_scale="dynamic"), batch)


def test_an_lm1b_style_model_built_in_bf16_runs_every_matmul_in_bf16():
    _lm1b_jaxpr(jnp.bfloat16)  # a PrecisionWarning would be an error here


@pytest.mark.parametrize("dtype", [jnp.float32, None], ids=["float32", "None"])
def test_an_lm1b_style_model_left_in_float32_warns_once_with_advice_that_fits_it(dtype):
    with pytest.warns(leanstep.blocks.PrecisionWarning) as record:
        _lm1b_jaxpr(dtype)
    messages = [str(w.message) for w in record if issubclass(w.category, leanstep.blocks.PrecisionWarning)]
    assert len(messages) == 1, messages
    assert "none of the loss's" in messages[0] and "100.0% of their FLOPs" in messages[0]
    assert "x.astype(dtype)" in messages[0] and "None means float32" in messages[0]


# --- Equinox's stateful example: BatchNorm and eqx.nn.State, no casts in the model -------------------


class StatefulNet(eqx.Module):
    """The structure of Equinox's stateful example (docs/examples/stateful.ipynb): Linear, BatchNorm
    (default mode "ema"), Linear; the model code has no dtype casts of its own."""

    hidden: eqx.Module
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key, remat: str = "none"):
        k1, k2 = jax.random.split(key)
        hidden = eqx.nn.Linear(36, 16, key=k1)
        self.hidden = hidden if remat == "none" else leanstep.blocks.remat(hidden, remat)
        self.norm = eqx.nn.BatchNorm(16, axis_name="batch", momentum=0.9, mode="ema")  # the default, named
        self.head = eqx.nn.Linear(16, 3, key=k2)

    def __call__(self, x, state):
        h, state = self.norm(self.hidden(x.reshape(-1)), state)
        return self.head(jax.nn.relu(h)), state


def stateful_net_loss(model, model_state, batch):
    logits, model_state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        batch["x"], model_state
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["y"]).mean(), model_state


def stateful_reference(batches):
    """Equinox's own loop in float32: filter_value_and_grad, optax on the inexact arrays."""
    model, model_state = eqx.nn.make_with_state(StatefulNet)(jax.random.key(0))
    opt_state = RESNET_TX.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def train_step(model, model_state, opt_state, batch):
        (loss, model_state), grads = eqx.filter_value_and_grad(stateful_net_loss, has_aux=True)(
            model, model_state, batch
        )
        updates, opt_state = RESNET_TX.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), model_state, opt_state, loss

    losses = []
    for batch in batches:
        model, model_state, opt_state, loss = train_step(model, model_state, opt_state, batch)
        losses.append(float(loss))
    return model_state, losses


@pytest.fixture(scope="module")
def stateful_runs():
    batches = image_batches(16)
    ref_state, ref_losses = stateful_reference(batches)
    model, model_state = eqx.nn.make_with_state(StatefulNet)(jax.random.key(0), remat="dots")
    params, static = leqx.split(model)
    step = leanstep.make_train_step(leqx.stateful_loss(static, stateful_net_loss), has_state=True, **EVERYTHING)
    state = leanstep.TrainState.create(params, RESNET_TX, loss_scale="dynamic", model_state=model_state)
    state, losses = run(step, state, batches)
    jaxpr = jax.make_jaxpr(step.__wrapped__)(state, batches[0])
    return {"state": state, "losses": losses, "ref_losses": ref_losses, "ref_state": ref_state, "jaxpr": jaxpr}


def test_the_equinox_stateful_example_learns_under_bf16_with_every_technique(stateful_runs):
    falls_like(stateful_runs["losses"], stateful_runs["ref_losses"])


def test_the_equinox_running_statistics_stay_float32_and_move(stateful_runs):
    """Float32 between steps; their values against a float32 reference of the same trajectory are
    tests/test_model_state_dtypes.py's (this run's weights take another path: bf16, clipping)."""
    _, fresh = eqx.nn.make_with_state(StatefulNet)(jax.random.key(0))
    ours, initial = jax.tree.leaves(stateful_runs["state"].model_state), jax.tree.leaves(fresh)
    floats = [(a, b) for a, b in zip(ours, initial, strict=True) if jnp.issubdtype(b.dtype, jnp.floating)]
    assert floats and all(a.dtype == jnp.float32 for a, _ in floats)
    assert all(np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-3 for a, b in floats)


def test_every_matmul_of_the_equinox_model_runs_in_bf16(stateful_runs):
    assert _matmul_kinds(stateful_runs["jaxpr"]) == {("dot_general", ("bfloat16", "bfloat16"))}


def test_an_lm1b_style_model_learns_under_bf16_with_every_technique_like_its_loop():
    batches = token_batches(16)
    params = CastingLM().init(jax.random.key(0), batches[0]["tokens"][:, :-1])["params"]
    loss_fn, opt_state, ref_losses = lm1b_loss(CastingLM()), RESNET_TX.init(params), []
    ref_params = params

    @jax.jit
    def own_step(params, opt_state, batch):  # lm1b's loop, float32
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = RESNET_TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for batch in batches:
        ref_params, opt_state, loss = own_step(ref_params, opt_state, batch)
        ref_losses.append(float(loss))
    step = leanstep.make_train_step(lm1b_loss(CastingLM(dtype=jnp.bfloat16, remat="dots")), **EVERYTHING)
    _, losses = run(step, leanstep.TrainState.create(params, RESNET_TX, loss_scale="dynamic"), batches)
    falls_like(losses, ref_losses)
