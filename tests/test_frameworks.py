"""Real framework models, written each framework's usual way, trained through leanstep.

Each model is checked against its framework's own training loop (the reference, which
imports nothing from leanstep but the adapter's docs): in float32 with one microbatch the
parameters and the model state (BatchNorm statistics) equal the loop's after several steps;
with every technique on (bf16 compute, a dynamic loss scale, 4 microbatches, clipping, remat)
the loss falls as the loop's does.
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import leanstep
from leanstep.frameworks import equinox as leqx
from leanstep.frameworks import linen as llinen
from leanstep.frameworks import nnx as lnnx

EVERYTHING = dict(precision="params=float32,compute=bfloat16,output=float32", num_microbatches=4, max_grad_norm=1.0)
TX = optax.adamw(1e-2)


def image_batches(steps: int, rows: int = 8) -> list[dict]:
    """Two batches of images, taken in turn, whose class is the sign pattern of two pixels."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(2):
        x = rng.normal(size=(rows, 6, 6, 1)).astype(np.float32)
        y = (x[:, 1, 1, 0] > 0).astype(np.int32) + (x[:, 4, 4, 0] > 0).astype(np.int32)
        out.append({"x": jnp.asarray(x), "y": jnp.asarray(y)})
    return [out[t % 2] for t in range(steps)]


def assert_trees_close(a, b, rtol=2e-5, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol)


def falls_like(losses: list[float], reference: list[float]) -> None:
    """The loss falls by 40% or more and ends (last 4 steps) no worse than 1.3x the reference's, plus 0.05."""
    ours, theirs = np.mean(losses[-4:]), np.mean(reference[-4:])
    assert ours < 0.6 * np.mean(losses[:2]) and ours < 1.3 * theirs + 0.05, (losses, reference)


def run(step, state, batches):
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        assert not bool(metrics.skipped)
        losses.append(float(metrics.loss))
    return state, losses


# --- Flax NNX: a CNN with BatchNorm and Dropout ---------------------------------------------------


class CNN(nnx.Module):
    def __init__(self, *, remat: str = "none", rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.head = nnx.Linear(8 * 6 * 6, 3, rngs=rngs)
        self.remat = remat

    def features(self, x):
        return self.dropout(nnx.relu(self.bn(self.conv(x))))

    def __call__(self, x):
        x = (
            leanstep.blocks.remat(self.features, self.remat, prevent_cse=True)(x)
            if self.remat != "none"
            else self.features(x)
        )
        return self.head(x.reshape(x.shape[0], -1))


def cnn_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


SHORT = 4  # steps after which float32 with one microbatch must equal the framework's loop


def snapshot(tree):
    return jax.tree.map(lambda x: x.copy(), tree)


def nnx_reference(batches):
    """The NNX way: nnx.Optimizer, nnx.value_and_grad, nnx.jit. Returns the state after SHORT steps."""
    model = CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(cnn_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses, short = [], None
    for t, batch in enumerate(batches):
        losses.append(float(train_step(model, optimizer, batch)))
        short = snapshot(nnx.state(model)) if t + 1 == SHORT else short
    return short, losses


@pytest.fixture(scope="module")
def nnx_runs():
    batches = image_batches(12)
    short, ref_losses = nnx_reference(batches)
    graphdef, params, model_state = lnnx.split(CNN(rngs=nnx.Rngs(0)))
    state = leanstep.TrainState.create(params, TX, model_state=model_state)
    plain, _ = run(leanstep.make_train_step(lnnx.loss(graphdef, cnn_loss), has_state=True), state, batches[:SHORT])
    graphdef, params, model_state = lnnx.split(CNN(remat="dots", rngs=nnx.Rngs(0)))
    state = leanstep.TrainState.create(params, TX, model_state=model_state, loss_scale="dynamic")
    # nnx.BatchNorm's float32 statistics promote what follows them (the head) to float32: said once.
    with pytest.warns(
        leanstep.blocks.PrecisionWarning, match=r"1 of the loss's 2 matmuls and convolutions do not run in it"
    ):
        _, losses = run(
            leanstep.make_train_step(lnnx.loss(graphdef, cnn_loss), has_state=True, **EVERYTHING), state, batches
        )
    return {"graphdef": graphdef, "plain": plain, "short": short, "losses": losses, "ref_losses": ref_losses}


def test_nnx_float32_one_microbatch_equals_the_nnx_optimizer_loop(nnx_runs):
    trained = lnnx.merge(nnx_runs["graphdef"], nnx_runs["plain"].params, nnx_runs["plain"].model_state)
    reference = nnx.merge(nnx_runs["graphdef"], nnx_runs["short"])
    assert_trees_close(nnx.state(trained, nnx.Param), nnx.state(reference, nnx.Param))
    # BatchNorm's running statistics and the dropout stream's counter, too.
    assert_trees_close(nnx.state(trained, nnx.BatchStat), nnx.state(reference, nnx.BatchStat), rtol=1e-6)
    assert int(trained.dropout.rngs.count[...]) == int(reference.dropout.rngs.count[...]) == SHORT


def test_nnx_with_every_technique_learns_like_the_loop(nnx_runs):
    falls_like(nnx_runs["losses"], nnx_runs["ref_losses"])


# --- Flax Linen: a transformer with dropout and remat-able blocks ------------------------------


class Block(nn.Module):
    width: int
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.MultiHeadDotProductAttention(num_heads=2, dtype=self.dtype, deterministic=not train, dropout_rate=0.1)(
            h, mask=nn.make_causal_mask(x[..., 0])
        )
        x = x + nn.Dropout(0.1, deterministic=not train)(h)
        h = nn.Dense(2 * self.width, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
        return x + nn.Dense(self.width, dtype=self.dtype)(nn.gelu(h))


class LM(nn.Module):
    width: int = 16
    layers: int = 1
    remat: str = "none"
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        block = leanstep.blocks.remat(Block, self.remat, static_argnums=(2,))  # train is static
        x = nn.Embed(32, self.width, dtype=self.dtype)(tokens)
        for i in range(self.layers):  # named, so the params are the same under every policy
            x = block(self.width, self.dtype, name=f"block_{i}")(x, train)
        return nn.Dense(32, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


def token_batches(steps: int, rows: int = 8, length: int = 9) -> list[dict]:
    """Two batches of sequences counting up mod 32 from a random start, taken in turn."""
    rng = np.random.default_rng(1)
    two = [
        {"tokens": jnp.asarray((rng.integers(0, 32, (rows, 1)) + np.arange(length)) % 32, jnp.int32)} for _ in range(2)
    ]
    return [two[t % 2] for t in range(steps)]


def lm_loss(module):
    def loss_fn(params, batch, key):
        logits = module.apply({"params": params}, batch["tokens"][:, :-1], train=True, rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

    return loss_fn


def linen_reference(module, params, batches, seed=0):
    """The Linen way: optax on the params collection, a jitted step, dropout keys folded per step."""
    opt_state, loss_fn = TX.init(params), lm_loss(module)

    @jax.jit
    def train_step(params, opt_state, batch, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, key)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses, short, base = [], None, jax.random.key(seed)
    for t, batch in enumerate(batches):  # leanstep's keys: fold_in(fold_in(key, step), microbatch)
        params, opt_state, loss = train_step(
            params, opt_state, batch, jax.random.fold_in(jax.random.fold_in(base, t), 0)
        )
        losses.append(float(loss))
        short = snapshot(params) if t + 1 == SHORT else short
    return short, losses


@pytest.fixture(scope="module")
def linen_runs():
    batches = token_batches(12)
    params, model_state = llinen.split(LM().init(jax.random.key(0), batches[0]["tokens"][:, :-1]))
    assert model_state == {}
    short, ref_losses = linen_reference(LM(), params, batches)
    plain, _ = run(
        leanstep.make_train_step(lm_loss(LM()), uses_rng=True), leanstep.TrainState.create(params, TX), batches[:SHORT]
    )
    state = leanstep.TrainState.create(params, TX, loss_scale="dynamic")
    _, losses = run(leanstep.make_train_step(lm_loss(LM(remat="dots")), uses_rng=True, **EVERYTHING), state, batches)
    return {
        "short": short,
        "plain": plain,
        "losses": losses,
        "ref_losses": ref_losses,
        "params": params,
        "batch": batches[0],
    }


def test_linen_float32_one_microbatch_equals_the_linen_loop(linen_runs):
    assert_trees_close(linen_runs["plain"].params, linen_runs["short"])


def test_linen_with_every_technique_learns_like_the_loop(linen_runs):
    falls_like(linen_runs["losses"], linen_runs["ref_losses"])


def test_a_linen_model_built_in_float32_under_bf16_warns_once(linen_runs):
    step = leanstep.make_train_step(
        lm_loss(LM(dtype=jnp.float32)), uses_rng=True, precision="compute=bfloat16", jit=False
    )
    state = leanstep.TrainState.create(linen_runs["params"], TX)
    with pytest.warns(
        leanstep.blocks.PrecisionWarning,
        match=r"compute dtype bfloat16, but none of the loss's \d+ matmuls and convolutions "
        r"runs in it \(float32 x float32: \d+, 100.0% of their FLOPs\).*dtype=",
    ):
        jax.make_jaxpr(step)(state, linen_runs["batch"])


def test_linen_batch_stats_are_model_state():
    module = nn.Sequential([nn.Dense(4), nn.BatchNorm(use_running_average=False, momentum=0.5)])
    x = jnp.asarray(np.random.default_rng(2).normal(size=(8, 3)), jnp.float32)
    params, model_state = llinen.split(module.init(jax.random.key(0), x))

    def loss_fn(params, model_state, batch):
        y, model_state = llinen.apply(module, params, model_state, batch["x"])
        return jnp.mean(y**2), model_state

    state = leanstep.TrainState.create(params, optax.sgd(0.1), model_state=model_state)
    state, _ = leanstep.make_train_step(loss_fn, has_state=True)(state, {"x": x})
    _, updates = module.apply({"params": params, **model_state}, x, mutable=["batch_stats"])
    assert_trees_close(state.model_state, updates, rtol=1e-6)


# --- Equinox: a model with static fields and BatchNorm state -------------------------------------


class Net(eqx.Module):
    hidden: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear
    activation: Callable = eqx.field(static=True)
    width: int = eqx.field(static=True)

    def __init__(self, width: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.hidden = eqx.nn.Linear(36, width, key=k1)
        self.norm = eqx.nn.BatchNorm(width, axis_name="batch", momentum=0.9, mode="ema")
        self.head = eqx.nn.Linear(width, 3, key=k2)
        self.activation, self.width = jax.nn.relu, width

    def __call__(self, x, state):
        # Normalized in float32: eqx.nn.BatchNorm cannot mix a bf16 input with float32 statistics.
        h, state = self.norm(self.hidden(x.reshape(-1)).astype(jnp.float32), state)
        return self.head(self.activation(h).astype(x.dtype)), state


def net_loss(model, model_state, batch):
    logits, model_state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        batch["x"], model_state
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), model_state


def equinox_reference(batches):
    """The Equinox way: eqx.filter_value_and_grad, optax on the inexact arrays, eqx.filter_jit."""
    model, model_state = eqx.nn.make_with_state(Net)(16, jax.random.key(0))
    opt_state = TX.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def train_step(model, model_state, opt_state, batch):
        (loss, model_state), grads = eqx.filter_value_and_grad(net_loss, has_aux=True)(model, model_state, batch)
        updates, opt_state = TX.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), model_state, opt_state, loss

    losses, short = [], None
    for t, batch in enumerate(batches):
        model, model_state, opt_state, loss = train_step(model, model_state, opt_state, batch)
        losses.append(float(loss))
        short = snapshot((eqx.filter(model, eqx.is_inexact_array), model_state)) if t + 1 == SHORT else short
    return short, losses


@pytest.fixture(scope="module")
def equinox_runs():
    batches = image_batches(12)
    model, model_state = eqx.nn.make_with_state(Net)(16, jax.random.key(0))
    params, static = leqx.split(model)
    short, ref_losses = equinox_reference(batches)
    loss_fn = leqx.stateful_loss(static, net_loss)
    plain, _ = run(
        leanstep.make_train_step(loss_fn, has_state=True),
        leanstep.TrainState.create(params, TX, model_state=model_state),
        batches[:SHORT],
    )
    state = leanstep.TrainState.create(params, TX, model_state=model_state, loss_scale="dynamic")
    _, losses = run(leanstep.make_train_step(loss_fn, has_state=True, **EVERYTHING), state, batches)
    return {"static": static, "plain": plain, "short": short, "losses": losses, "ref_losses": ref_losses}


def test_equinox_float32_one_microbatch_equals_the_equinox_loop(equinox_runs):
    trained = leqx.combine(equinox_runs["plain"].params, equinox_runs["static"])
    short_params, short_state = equinox_runs["short"]
    assert_trees_close(eqx.filter(trained, eqx.is_inexact_array), short_params)
    assert_trees_close(equinox_runs["plain"].model_state, short_state, rtol=1e-6)
    assert trained.width == 16 and trained.activation is jax.nn.relu  # static fields survive


def test_equinox_with_every_technique_learns_like_the_loop(equinox_runs):
    falls_like(equinox_runs["losses"], equinox_runs["ref_losses"])


# --- the hazards, refused -------------------------------------------------------------------------


def test_a_framework_model_passed_as_params_is_refused_with_the_split_to_use():
    model = CNN(rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"params is an nnx.Module \(CNN\).*leanstep.frameworks.nnx.split\(model\)"):
        leanstep.TrainState.create(model, TX)
    with pytest.raises(TypeError, match=r"params\['bn'\]\['mean'\] is an nnx.BatchStat, not an nnx.Param.*nnx.split"):
        leanstep.TrainState.create(nnx.state(model), TX)
    variables = nn.BatchNorm(use_running_average=False).init(jax.random.key(0), jnp.ones((2, 3)))
    with pytest.raises(TypeError, match=r"Linen collections 'params' and \['batch_stats'\].*linen.split\(variables\)"):
        leanstep.TrainState.create(variables, TX)
    mlp = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))  # its activation is a field, not static
    with pytest.raises(
        TypeError,
        match=r"params\.activation is a .* in an Equinox module; train only its floating "
        r"arrays: params, static = leanstep.frameworks.equinox.split\(model\)",
    ):
        leanstep.TrainState.create(mlp, TX)


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        return nn.Dense(3)(jnp.tanh(nn.Dense(8)(x))) if train else x


def test_remat_of_modules_is_exact_and_saves_less():
    x = jnp.asarray(np.random.default_rng(3).normal(size=(5, 3)), jnp.float32)
    variables = Mlp().init(jax.random.key(0), x, True)

    def loss(block_cls):
        return lambda p, x: jnp.sum(block_cls().apply(p, x, True) ** 2)

    remat_block = leanstep.blocks.remat(Mlp, "full", static_argnums=(2,))  # train is static
    assert_trees_close(jax.grad(loss(remat_block))(variables, x), jax.grad(loss(Mlp))(variables, x), rtol=1e-5)
    full = leanstep.inspection.saved_residuals_report(loss(remat_block), variables, x)
    none = leanstep.inspection.saved_residuals_report(loss(Mlp), variables, x)
    assert full.activation_bytes < none.activation_bytes
    linear = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    checkpointed = leanstep.blocks.remat(linear, "full")
    np.testing.assert_allclose(checkpointed(jnp.ones(3)), linear(jnp.ones(3)))
    with pytest.raises(TypeError, match="static_argnums does not apply to an Equinox module"):
        leanstep.blocks.remat(linear, "full", static_argnums=1)


def test_plan_takes_a_framework_model_whose_remat_policy_is_its_own_parameter():
    """The CNN's remat policy is a constructor argument, so planning needs no patching."""

    def make_loss_fn(policy):
        graphdef, _, _ = lnnx.split(CNN(remat=policy, rngs=nnx.Rngs(0)))
        return lnnx.loss(graphdef, cnn_loss)

    _, params, model_state = lnnx.split(CNN(rngs=nnx.Rngs(0)))
    result = leanstep.planning.plan(
        make_loss_fn, params, image_batches(1)[0], TX, leanstep.StepSpec(loss=leanstep.LossContract(has_state=True)),
        budget_bytes="1GiB", model_state=model_state,
    )  # fmt: skip
    assert result.chosen.setting[:2] == (1, "none") and result.compiles == 1
    assert "1 compile" in str(result)


# --- per-layer remat of an NNX model whose layers take keyword arguments (flax's Gemma) ------------


class GemmaLikeLayer(nnx.Module):
    """A decoder layer called as flax's Gemma calls its layers: ``layer(x, positions, cache, mask, rngs=rngs)``."""

    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)
        self.dropout = nnx.Dropout(0.25)

    def __call__(self, x, positions, cache, mask, *, rngs=None):
        q, k, v = jnp.split(self.qkv(self.norm(x)), 3, axis=-1)
        angle = jnp.cos(positions[..., None] / 10.0)
        scores = jnp.einsum("btd,bsd->bts", q * angle, k * angle) / np.sqrt(x.shape[-1])
        attention = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
        x = x + self.out(jnp.einsum("bts,bsd->btd", attention, v))
        return cache, x + self.dropout(self.down(jnp.tanh(self.up(x))), rngs=rngs)


class GemmaLike(nnx.Module):
    def __init__(self, policy: str = "none", *, rngs: nnx.Rngs, vocab: int = 16, d: int = 8, layers: int = 2):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([leanstep.blocks.remat(GemmaLikeLayer(d, rngs=rngs), policy) for _ in range(layers)])

    def __call__(self, tokens, rngs=None):
        x, positions = self.embed(tokens), jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        mask = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))[None]
        for layer in self.layers:
            _, x = layer(x, positions, None, mask, rngs=rngs)
        return self.embed.attend(x)


def gemma_loss(model, batch, key):
    logits = model(batch["tokens"][:, :-1], rngs=nnx.Rngs(dropout=key))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


def test_per_layer_remat_of_a_model_calling_its_layers_with_keywords_trains_exactly_and_recomputes():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, size=(4, 7)), jnp.int32)
    batch = {"tokens": tokens}
    plain, remat = GemmaLike(rngs=nnx.Rngs(0)), GemmaLike("dots", rngs=nnx.Rngs(0))
    graphdef, params, model_state = lnnx.split(remat)
    assert len(jax.tree.leaves(params)) == len(jax.tree.leaves(nnx.state(plain, nnx.Param))) == 1 + 2 * 7
    state = leanstep.TrainState.create(params, optax.sgd(0.1), model_state=model_state, seed=5)
    # The reference: flax's own gradient of the model without remat, dropout drawn from the step's
    # key (step 0, microbatch 0).
    key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(state.rng), 0), 0)
    want = nnx.grad(lambda m: gemma_loss(m, batch, key))(plain)
    params = snapshot(params)  # the step donates its state
    step = leanstep.make_train_step(lnnx.loss(graphdef, gemma_loss), has_state=True, uses_rng=True)
    trained, metrics = step(state, batch)
    assert not bool(metrics.skipped)
    got = jax.tree.map(lambda new, old: (old - new) / 0.1, trained.params, params)
    assert_trees_close(got["embed"], want["embed"], rtol=1e-5, atol=1e-6)
    for i in range(2):
        assert_trees_close(got["layers"][i]["module"], want["layers"][i], rtol=1e-5, atol=1e-6)
    # Remat really recomputes: the backward pass saves less of each layer than without remat.
    saved = []
    for model in (remat, plain):
        graphdef, params, _ = lnnx.split(model)
        loss = lambda p, g=graphdef: lnnx.loss(g, gemma_loss)(p, model_state, batch, key)[0]
        saved.append(leanstep.inspection.saved_residuals_report(loss, params).activation_bytes)
    assert saved[0] < saved[1], saved


class Branching(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

    def __call__(self, x, train, *, scale=1.0):
        return scale * jnp.tanh(self.linear(x)) if train else x


def test_an_nnx_remat_binds_keywords_to_their_positions_and_static_argnums_counts_them():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3)), jnp.float32)
    plain = Branching()
    checkpointed = leanstep.blocks.remat(plain, "full", static_argnums=(1,))  # train: a Python bool
    for train in (True, False):
        got = checkpointed(x, train=train, scale=jnp.float32(2.0))
        np.testing.assert_array_equal(got, plain(x, train, scale=jnp.float32(2.0)))
    with pytest.raises(TypeError, match="unexpected keyword argument 'trian'"):
        checkpointed(x, True, trian=True)


# --- a stateless NNX model needs no has_state=True and no empty model state (issue 57, item 9) -------


class StatelessMlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden, self.out = nnx.Linear(3, 8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def mlp_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_a_stateless_nnx_model_trains_without_a_model_state_and_as_before_with_an_empty_one():
    rng = np.random.default_rng(4)
    batch = {"x": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32), "y": jnp.asarray(rng.normal(size=(8, 2)))}
    graphdef, params, model_state = lnnx.split(StatelessMlp(nnx.Rngs(0)))
    assert jax.tree.leaves(model_state) == []
    # The reference: flax's own gradient of the model.
    want = nnx.grad(mlp_loss)(StatelessMlp(nnx.Rngs(0)), batch)
    loss_fn = lnnx.loss(graphdef, mlp_loss)
    new = leanstep.make_train_step(loss_fn, num_microbatches=2)(
        leanstep.TrainState.create(snapshot(params), optax.sgd(0.1)), batch
    )[0]
    assert new.model_state is None
    assert_trees_close(jax.tree.map(lambda a, b: (a - b) / 0.1, params, new.params), want, rtol=1e-5, atol=1e-6)
    # The old spelling, has_state=True and the empty model state, trains to the same params.
    old = leanstep.make_train_step(loss_fn, has_state=True, num_microbatches=2)(
        leanstep.TrainState.create(snapshot(params), optax.sgd(0.1), model_state=model_state), batch
    )[0]
    assert jax.tree.leaves(old.model_state) == []
    assert_trees_close(old.params, new.params, rtol=0, atol=0)
    # A model with state (BatchNorm statistics, Dropout's RNG counts) still needs it, named when built.
    graphdef, _, _ = lnnx.split(CNN(rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"it takes a model state after params: pass has_state=True"):
        leanstep.make_train_step(lnnx.loss(graphdef, cnn_loss))
