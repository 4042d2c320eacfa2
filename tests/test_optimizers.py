"""``--optimizer``: AdamW as leanstep runs have always had it, and Muon for the layers' matrices
composed through leanstep's step (accumulation, the dynamic loss scale, clipping, the skip).

The references are written without leanstep's step: optax's Muon on each layer's 2-D matrix on
its own, and a hand-written step (full-batch gradient, clip by hand, the optimizer's update)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers, scale_by_muon

import leanstep
from helpers.workers import run_worker
from leanstep.blocks.fp8_state import split_fp8
from leanstep.models import build_model
from leanstep.training import RunConfig
from leanstep.training.build import build_optimizer
from leanstep.training.optimizers import MUON_LEARNING_RATE, muon_dimension_numbers, muon_labels, run_optimizer
from leanstep.training.run_identity import config_hash
from leanstep.training.schedule import make_schedule, scale_by_run_schedule

CONSTANT = make_schedule("constant", 3e-3, 0)


def _is_dims(node):
    return isinstance(node, MuonDimensionNumbers)


def _tiny_transformer():
    model = build_model("transformer", "tiny")
    params = model.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, 256, jnp.int32)
    return model, params, {"tokens": tokens}


def test_muon_takes_the_stacked_layer_matrices_and_adamw_the_rest():
    """The built-in models' labels are those 0.12 gave them (a 3-D leaf, each under ``blocks``),
    at every size, with FP8 state too (the optimizer sees the trainable part)."""
    fp8 = {"fp8": leanstep.Fp8Recipe(history=4)}
    for name, size, overrides in [(n, s, {}) for n in ("transformer", "mlp") for s in ("tiny", "mini", "small")] + [
        ("transformer", "tiny", fp8)
    ]:
        params = jax.eval_shape(build_model(name, size, **overrides).init, jax.random.key(0))
        params = split_fp8(params)[0]
        labels = muon_labels(params)
        old = jax.tree.map(lambda leaf: "muon" if leaf.ndim == 3 else "adamw", params)  # 0.12's rule
        assert labels == old, (name, size)
        assert jax.tree.leaves(muon_dimension_numbers(params), is_leaf=_is_dims) == [
            MuonDimensionNumbers(1, 2) for label in jax.tree.leaves(old) if label == "muon"
        ]
    labels = muon_labels(jax.eval_shape(build_model("transformer", "mini").init, jax.random.key(0)))
    assert {k for k, v in labels["blocks"].items() if v == "muon"} == {"qkv_w", "proj_w", "fc_w", "out_w"}
    assert labels["embed"] == labels["pos"] == "adamw"


def test_the_default_runs_muon_is_0_12s_bit_for_bit():
    """`leanstep train`'s Muon on the built-in transformer: the state and updates of 0.12's
    optimizer (its labels and its one (layers, in, out) reading of every Muon leaf), bit for bit."""
    _, params, _ = _tiny_transformer()
    labels = lambda p: jax.tree.map(lambda leaf: "muon" if leaf.ndim == 3 else "adamw", p)
    stacks = lambda p: jax.tree.map(lambda _: MuonDimensionNumbers(reduction_axis=1, output_axis=2), p)
    old_muon = optax.chain(scale_by_muon(beta=0.95, weight_dimension_numbers=stacks), optax.add_decayed_weights(0.1))
    old_adamw = optax.chain(optax.scale_by_adam(b1=0.9, b2=0.95), optax.add_decayed_weights(0.1))
    old = optax.chain(
        optax.partition(
            {"muon": optax.chain(old_muon, optax.scale(MUON_LEARNING_RATE / 3e-3)), "adamw": old_adamw}, labels
        ),
        scale_by_run_schedule(CONSTANT, 10),
    )
    mine = run_optimizer("muon", CONSTANT, lr=3e-3, weight_decay=0.1, total=10)
    state, reference = mine.init(params), old.init(params)
    for key in jax.random.split(jax.random.key(0), 2):
        grads = jax.tree.map(lambda p, key=key: jax.random.normal(key, p.shape), params)
        (got, state), (want, reference) = mine.update(grads, state, params), old.update(grads, reference, params)
        for a, b in zip(jax.tree.leaves((got, state)), jax.tree.leaves((want, reference)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class _UserLM(nn.Module):
    """A model of the user's own, written as Flax's lm1b writes one: an embedding, attention with
    ``(embed, heads, head_dim)`` kernels (DenseGeneral), a LayerNorm, an MLP, an untied head."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(256, 32)(tokens)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4)(nn.LayerNorm()(x))
        x = x + nn.Dense(32)(nn.gelu(nn.Dense(64)(x)))
        return nn.Dense(256, name="head")(x)


def _user_params():
    return jax.eval_shape(_UserLM().init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]


def test_a_model_of_ones_own_trains_muon_on_its_2d_matrices_as_optax_labels_them():
    params = _user_params()
    labels, dims = muon_labels(params), muon_dimension_numbers(params)
    flat = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    got = {jax.tree_util.keystr(path): label for path, label in jax.tree_util.tree_leaves_with_path(labels)}
    # by hand: the embedding table and the Dense kernels are 2-D; the attention's kernels are
    # (embed, heads, head_dim) and (heads, head_dim, embed), which are not stacks of layers
    muon = {"['Embed_0']['embedding']", "['Dense_0']['kernel']", "['Dense_1']['kernel']", "['head']['kernel']"}
    assert {k for k, v in got.items() if v == "muon"} == muon
    assert {flat[k].shape for k in flat if "MultiHeadDotProductAttention" in k and k.endswith("['kernel']")} == {
        (32, 4, 8),
        (4, 8, 32),
    }
    assert all(got[k] == "adamw" for k in flat if k not in muon)  # the attention, biases, the norm
    assert [d for d in jax.tree.leaves(dims, is_leaf=_is_dims) if d is not None] == [MuonDimensionNumbers(0, 1)] * 4
    # optax.contrib.muon's own labels (every 2-D leaf) on the same tree: its Muon state holds these
    # leaves and the attention's (heads, head_dim) biases, which leanstep leaves to AdamW
    state = optax.contrib.muon(1e-3).init(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params))
    held = {
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_leaves_with_path(state.inner_states["muon"].inner_state[0].mu)
    }
    biases = {f"['MultiHeadDotProductAttention_0']['{name}']['bias']" for name in ("query", "key", "value")}
    assert held == muon | biases and all(flat[k].shape == (4, 8) for k in biases)
    # an Equinox model: its Linear weights (out, in) are matrices, its biases are not
    mlp, _ = eqx.partition(eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0)), eqx.is_inexact_array)
    assert [label for layer in muon_labels(mlp).layers for label in (layer.weight, layer.bias)] == ["muon", "adamw"] * 3


def test_muon_updates_a_users_matrices_as_optax_and_its_other_leaves_as_adamw():
    params = jax.tree.map(lambda s: jnp.full(s.shape, 0.1, s.dtype), _user_params())
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    mine = run_optimizer("muon", CONSTANT, lr=3e-3, weight_decay=0.0, total=10)
    updates, _ = mine.update(grads, mine.init(params), params)
    for path, update in jax.tree_util.tree_leaves_with_path(updates):
        grad = grads
        for key in path:
            grad = grad[key.key]
        if grad.ndim == 2 and path[-1].key != "bias":  # optax's Muon on this matrix alone, at Muon's rate
            ref = optax.chain(scale_by_muon(beta=0.95), optax.scale(-MUON_LEARNING_RATE))
        else:  # AdamW's first step: the gradient's sign, at the schedule's rate
            ref = optax.chain(optax.scale_by_adam(b1=0.9, b2=0.95), optax.scale(-3e-3))
        want, _ = ref.update(grad, ref.init(grad))
        np.testing.assert_allclose(np.asarray(update), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_adamw_is_the_chain_runs_have_always_saved_bit_for_bit():
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.ones(4)}
    grads = jax.tree.map(lambda p: jnp.sin(3.0 * p) + 0.1, params)
    mine = run_optimizer("adamw", CONSTANT, lr=3e-3, weight_decay=0.01, total=10)
    saved = optax.chain(
        optax.scale_by_adam(b1=0.9, b2=0.95), optax.add_decayed_weights(0.01), scale_by_run_schedule(CONSTANT, 10)
    )
    state, reference = mine.init(params), saved.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(reference)  # a saved checkpoint restores into it
    for _ in range(3):
        (got, state), (want, reference) = mine.update(grads, state, params), saved.update(grads, reference, params)
        for a, b in zip(jax.tree.leaves((got, state)), jax.tree.leaves((want, reference)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_muon_orthogonalizes_each_layer_of_a_stack_as_its_own_matrix():
    rng = np.random.default_rng(0)
    weights = jnp.asarray(rng.normal(size=(3, 8, 16)), jnp.float32)
    grads = [jnp.asarray(rng.normal(size=(3, 8, 16)), jnp.float32) for _ in range(2)]
    # the built-in mlp's top-level names: leanstep's stacked layout, whose 3-D leaves are layer stacks
    params = {"blocks": {"w": weights, "b": jnp.zeros((3, 16))}, "embed": jnp.zeros((5, 8))}
    params |= {"head_w": jnp.zeros((8, 5)), "head_b": jnp.zeros(5)}
    mine = run_optimizer("muon", CONSTANT, lr=3e-3, weight_decay=0.0, total=10)
    # The reference: optax's Muon on each layer's 2-D matrix, separately, at Muon's rate.
    layers = {f"l{i}": weights[i] for i in range(3)}
    plain = optax.chain(
        scale_by_muon(beta=0.95, weight_dimension_numbers=lambda p: jax.tree.map(lambda _: MuonDimensionNumbers(), p)),
        optax.scale(-MUON_LEARNING_RATE),
    )
    state, reference = mine.init(params), plain.init(layers)
    for g in grads:
        updates, state = mine.update({**params, "blocks": {"w": g, "b": jnp.zeros((3, 16))}}, state, params)
        want, reference = plain.update({f"l{i}": g[i] for i in range(3)}, reference, layers)
        for i in range(3):  # vmapped over layers against one at a time: float32 rounding apart
            np.testing.assert_allclose(updates["blocks"]["w"][i], want[f"l{i}"], rtol=0, atol=1e-7)
    singular = np.linalg.svd(np.asarray(updates["blocks"]["w"][0], np.float64) / -MUON_LEARNING_RATE, compute_uv=False)
    assert 0.5 < singular.min() and singular.max() < 1.3  # Newton-Schulz's near-orthogonal update


def _loss(model):
    def loss(params, batch):
        return model.loss(params, {"tokens": batch["tokens"]}) * batch["poison"][0]

    return loss


def test_muon_through_the_step_equals_a_hand_written_step():
    model, params, batch = _tiny_transformer()
    batch = {**batch, "poison": jnp.ones((8,), jnp.float32)}
    optimizer, _ = build_optimizer(RunConfig(size="tiny", optimizer="muon", steps=10, warmup_steps=2))
    step = leanstep.make_train_step(_loss(model), num_microbatches=2, max_grad_norm=0.5, precision="float32")
    state = leanstep.TrainState.create(params, optimizer, loss_scale="dynamic")

    @jax.jit
    def by_hand(p, opt_state):
        grads = jax.grad(lambda q: _loss(model)(q, batch))(p)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, 0.5 / norm), grads)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    p, opt_state = params, optimizer.init(params)
    with jax.default_matmul_precision("highest"):
        for _ in range(3):
            state, metrics = step(state, batch)
            p, opt_state = by_hand(p, opt_state)
            assert not bool(metrics.skipped) and bool(metrics.clipped)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(p), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params)))
    assert moved > 100 * 1e-5  # the comparison sees the updates, not only the starting point


@pytest.mark.parametrize("moments", ["float32", "int8"])
def test_a_skipped_step_leaves_muons_state_bit_identical(moments):
    model, params, batch = _tiny_transformer()
    optimizer, _ = build_optimizer(RunConfig(size="tiny", optimizer="muon", steps=10, warmup_steps=2))
    state = leanstep.TrainState.create(params, optimizer, loss_scale="dynamic", moments=moments)
    step = leanstep.make_train_step(_loss(model), num_microbatches=2, max_grad_norm=1.0, precision="float32")
    state, metrics = step(state, {**batch, "poison": jnp.ones((8,), jnp.float32)})  # momentum no longer zero
    assert not bool(metrics.skipped)
    before = jax.device_get(state)
    after, metrics = step(state, {**batch, "poison": jnp.full((8,), jnp.nan, jnp.float32)})
    assert bool(metrics.skipped)
    for part in ("params", "opt_state"):
        leaves = jax.tree.leaves(getattr(before, part)), jax.tree.leaves(jax.device_get(getattr(after, part)))
        assert len(leaves[0]) == len(leaves[1]) > 0
        for a, b in zip(*leaves, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_optimizer_is_part_of_a_runs_identity_and_a_wrong_one_is_one_line(cli, tmp_path):
    adamw = RunConfig(optimizer="adamw")
    assert RunConfig().optimizer == "muon" and config_hash(adamw) != config_hash(RunConfig())

    class Saved:  # a run saved before the field: its config.json has no "optimizer", and it was AdamW
        def to_json(self):
            return {k: v for k, v in adamw.to_json().items() if k != "optimizer"}

    assert config_hash(Saved()) == config_hash(adamw) != config_hash(RunConfig())
    assert RunConfig().mismatches(Saved().to_json()) == ["optimizer"]  # resumed without the flag: refused
    with pytest.raises(ValueError, match=r"^--optimizer must be one of adamw, muon, got 'sgd'$"):
        RunConfig(optimizer="sgd").validate()
    result = cli("train", "--optimizer", "sgd", "--out", tmp_path / "run")
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert result.code == 2 and len(lines) == 1 and "--optimizer" in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_muon_on_an_optax_without_it_is_one_line_naming_the_flag(monkeypatch):
    monkeypatch.delattr(optax.contrib, "MuonDimensionNumbers")
    with pytest.raises(ValueError, match=r"^--optimizer muon needs optax\.contrib\.MuonDimensionNumbers, which optax "):
        RunConfig(optimizer="muon").validate()
    RunConfig(optimizer="adamw").validate()  # AdamW needs none of it


_MUON_RUN = ["train", "--size", "tiny", "--batch-size", "16", "--seq-len", "16", "--microbatches", "2", "--steps", "4"]
_MUON_RUN += ["--warmup-steps", "1", "--precision", "float32", "--max-grad-norm", "0.5", "--eval-every", "100"]
_MUON_RUN += ["--checkpoint-every", "100", "--no-progress", "--no-chart", "--optimizer", "muon"]


def worker(out: Path) -> None:
    """The child of :func:`test_muon_over_fsdp_8_takes_the_one_device_steps`: 8 simulated devices."""
    jax.config.update("jax_num_cpu_devices", 8)
    from leanstep.cli.main import main

    for name, layout in (("one", []), ("fsdp8", ["--devices", "8", "--fsdp"])):
        assert main([*_MUON_RUN, *layout, "--out", str(out / name)]) == 0, name
    records = {
        name: [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("one", "fsdp8")
    }
    (out / "records.json").write_text(json.dumps(records))


@pytest.mark.slow  # one child process with 8 simulated devices, two tiny runs
def test_muon_over_fsdp_8_takes_the_one_device_steps(tmp_path):
    """Muon's Newton-Schulz on matrices sharded over 8 devices (GSPMD gathers what it needs) gives
    the one-device run's losses and gradient norms, step for step: each is a function of the
    parameters after the updates before it."""
    records = run_worker(__file__, tmp_path, "records.json", timeout=300)
    one, fsdp = ([r for r in records[name] if r["kind"] == "train"] for name in ("one", "fsdp8"))
    assert [r["step"] for r in one] == [r["step"] for r in fsdp] == [1, 2, 3, 4]
    for a, b in zip(one, fsdp):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-5) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], rel=2e-4
        )
    assert one[-1]["loss"] < one[0]["loss"] - 1e-3  # the updates moved the model: not a comparison of no-ops


if __name__ == "__main__":
    worker(Path(sys.argv[2]))
