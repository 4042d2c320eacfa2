"""``--optimizer``: AdamW as leanstep runs have always had it, and Muon for the layers' matrices
composed through leanstep's step (accumulation, the dynamic loss scale, clipping, the skip).

The references are written without leanstep's step: optax's Muon on each layer's 2-D matrix on
its own, and a hand-written step (full-batch gradient, clip by hand, the optimizer's update)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers, scale_by_muon

import leanstep
from leanstep.models import build_model
from leanstep.training import RunConfig
from leanstep.training.build import build_optimizer
from leanstep.training.optimizers import MUON_LEARNING_RATE, muon_labels, run_optimizer
from leanstep.training.run_identity import config_hash
from leanstep.training.schedule import make_schedule, scale_by_run_schedule
from workers import run_worker

CONSTANT = make_schedule("constant", 3e-3, 0)


def _tiny_transformer():
    model = build_model("transformer", "tiny")
    params = model.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, 256, jnp.int32)
    return model, params, {"tokens": tokens}


def test_muon_takes_the_stacked_layer_matrices_and_adamw_the_rest():
    for name in ("transformer", "mlp"):
        params = jax.eval_shape(build_model(name, "mini").init, jax.random.key(0))
        labels = muon_labels(params)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):
            label = labels
            for key in path:
                label = label[key.key]
            assert label == ("muon" if leaf.ndim == 3 else "adamw"), (name, jax.tree_util.keystr(path))
    labels = muon_labels(jax.eval_shape(build_model("transformer", "mini").init, jax.random.key(0)))
    assert {k for k, v in labels["blocks"].items() if v == "muon"} == {"qkv_w", "proj_w", "fc_w", "out_w"}
    assert labels["embed"] == labels["pos"] == "adamw"


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
    params = {"blocks": {"w": weights, "b": jnp.zeros((3, 16))}}
    mine = run_optimizer("muon", CONSTANT, lr=3e-3, weight_decay=0.0, total=10)
    # The reference: optax's Muon on each layer's 2-D matrix, separately, at Muon's rate.
    layers = {f"l{i}": weights[i] for i in range(3)}
    plain = optax.chain(
        scale_by_muon(beta=0.95, weight_dimension_numbers=lambda p: jax.tree.map(lambda _: MuonDimensionNumbers(), p)),
        optax.scale(-MUON_LEARNING_RATE),
    )
    state, reference = mine.init(params), plain.init(layers)
    for g in grads:
        updates, state = mine.update({"blocks": {"w": g, "b": jnp.zeros((3, 16))}}, state, params)
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
