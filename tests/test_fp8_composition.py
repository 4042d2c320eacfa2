"""FP8 composed correctly (issue 28): the FP8 state after a step is the one-microbatch,
one-device step's, bit for bit, and takes no part in unscaling, the norm, clipping, the
optimizer or a skipped step.

Two models: a plain-JAX MLP with leanstep's ``Fp8Meta`` and a Flax Linen MLP written with
Flax's own ``fp8_ops`` (through ``leanstep.frameworks.linen``, unchanged). The meshes run in a
subprocess with 8 simulated devices. The controls at the end train the same Flax model the
way peers do (``optax.MultiSteps`` over microbatches, ``optax.clip_by_global_norm`` over every
gradient) and show the error that makes, beside leanstep's state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from helpers.fp8_models import RECIPE, FlaxNet, batch, flax_loss, flax_variables, fp8_of, jax_loss, jax_params
from helpers.workers import run_worker
from leanstep.blocks.fp8_state import fp8_leaves
from leanstep.frameworks import linen as llinen

TX = optax.adamw(1e-2)
PRECISION = "params=float32,compute=bfloat16,output=float32"
STEPS = 2  # the second step quantizes with scales from the first one's amaxes


#: model -> layout -> (reduce, microbatches) run on it: every reduction for the plain-JAX model
#: ("step" is "auto" without an fsdp axis), the pmax paths for Flax's own fp8_ops model.
MESH_CASES = {
    "jax": {
        "data8": [(r, m) for r in ("auto", "microbatch") for m in (1, 2)],
        "fsdp8": [(r, m) for r in ("auto", "step", "microbatch") for m in (1, 2)],
    },
    "flax": {"data8": [("auto", 2)], "fsdp8": [("auto", 2), ("step", 2)]},
}
CASES = [
    (model, layout, r, m) for model, layouts in MESH_CASES.items() for layout, rows in layouts.items() for r, m in rows
]


def _models() -> dict:
    return {"jax": (jax_loss, jax_params()), "flax": (flax_loss, llinen.split(flax_variables())[0])}


def _steps(step, state, batches):
    for b in batches:
        state, metrics = step(state, b)
    return state, metrics


def worker(out: Path) -> None:
    jax.config.update("jax_num_cpu_devices", 8)
    from leanstep.sharding.distributed import device_mesh

    batches = [batch(seed) for seed in range(STEPS)]
    results: dict = {}
    for name, (loss, params) in _models().items():
        new_state = lambda: leanstep.TrainState.create(params, TX, loss_scale="dynamic")  # noqa: B023
        for num_mb in (1, 2, 4, 8):
            step = leanstep.make_train_step(loss, precision=PRECISION, num_microbatches=num_mb, max_grad_norm=1.0)
            state, _ = _steps(step, new_state(), batches)
            results[f"{name}/one/{num_mb}"] = [x.tolist() for x in fp8_of(state.params)]
        for layout, shape in {"data8": {"data": 8}, "fsdp8": {"fsdp": 8}}.items():
            mesh = device_mesh(shape=shape)
            for reduce, num_mb in MESH_CASES[name][layout]:
                step = leanstep.make_train_step(
                    loss,
                    precision=PRECISION,
                    num_microbatches=num_mb,
                    max_grad_norm=1.0,
                    mesh=leanstep.step.ShardingLayer(mesh, reduce=reduce),
                )
                sharded = [leanstep.sharding.shard_batch(b, mesh) for b in batches]
                state, _ = _steps(step, leanstep.step.shard_train_state(new_state(), mesh), sharded)
                replicated = all(x.sharding.is_fully_replicated for x in fp8_leaves(state.params))
                results[f"{name}/{layout}-{reduce}/{num_mb}"] = {
                    "fp8": [x.tolist() for x in fp8_of(state.params)],
                    "replicated": replicated,
                }
        # A one-device checkpoint restored onto the fsdp=8 layout: FP8 state replicated, bit for bit.
        one = leanstep.make_train_step(loss, precision=PRECISION, num_microbatches=2)
        state, _ = _steps(one, new_state(), batches)
        with leanstep.checkpoints.Checkpointer(out / f"ckpt-{name}") as checkpointer:
            checkpointer.save(STEPS, state)
            mesh = device_mesh(shape={"fsdp": 8})
            restored = checkpointer.restore(leanstep.step.shard_train_state(new_state(), mesh)).state
        results[f"{name}/restored-fsdp8"] = {
            "same": all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True)
            ),
            "replicated": all(x.sharding.is_fully_replicated for x in fp8_leaves(restored.params)),
            "split": any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(restored.params)),
        }
    (out / "fp8_mesh.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_worker(__file__, tmp_path_factory.mktemp("fp8_mesh"), "fp8_mesh.json")


def _equal(got: list, want: list) -> None:
    assert len(got) == len(want) == 12
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.slow  # 8 simulated devices in a child process: two models on data=8 and fsdp=8 meshes
@pytest.mark.parametrize("model", ["jax", "flax"])
@pytest.mark.parametrize("num_mb", [2, 4, 8])
def test_microbatches_give_the_one_microbatch_fp8_state_bit_for_bit(results, model, num_mb):
    _equal(results[f"{model}/one/{num_mb}"], results[f"{model}/one/1"])


@pytest.mark.slow  # 8 simulated devices in a child process: two models on data=8 and fsdp=8 meshes
@pytest.mark.parametrize(("model", "layout", "reduce", "num_mb"), CASES)
def test_meshes_give_the_one_device_fp8_state_bit_for_bit_and_replicate_it(results, model, layout, reduce, num_mb):
    row = results[f"{model}/{layout}-{reduce}/{num_mb}"]
    _equal(row["fp8"], results[f"{model}/one/1"])
    assert row["replicated"]


@pytest.mark.slow  # 8 simulated devices in a child process: two models on data=8 and fsdp=8 meshes
@pytest.mark.parametrize("model", ["jax", "flax"])
def test_a_checkpoint_restores_onto_another_layout_with_the_fp8_state_replicated(results, model):
    row = results[f"{model}/restored-fsdp8"]
    assert row == {"same": True, "replicated": True, "split": True}


@pytest.mark.slow  # 8 simulated devices in a child process: two models on data=8 and fsdp=8 meshes
def test_the_fp8_state_moved_and_saw_every_row(results):
    """Not a test that passes because nothing moved: the histories hold amaxes, the scales left
    1 at the second step, and the input amax is the batch's largest |x| (its last row's)."""
    for model in ("jax", "flax"):
        leaves = [np.asarray(x) for x in results[f"{model}/one/1"]]
        assert all(np.any(x != 0) for x in leaves)
        assert any(x.shape == (1,) and x[0] != 1.0 for x in leaves)
    x_amax = float(np.max(np.abs(np.asarray(jnp.asarray(batch(1)["x"], jnp.bfloat16), np.float32))))
    histories = [np.asarray(x) for x in results["jax/one/1"] if np.shape(x) == (RECIPE.history,)]
    assert histories[0][0] == x_amax  # l1's input history, newest entry: step 2's max |x|


# --- out of the guarded update ----------------------------------------------------------------------


def _state(params, **kwargs):
    return leanstep.TrainState.create(params, TX, loss_scale="dynamic", **kwargs)


@pytest.mark.parametrize("model", ["jax", "flax"])
def test_a_non_finite_step_leaves_the_fp8_state_bit_identical(model):
    loss, params = _models()[model]
    step = leanstep.make_train_step(loss, precision=PRECISION, num_microbatches=2, max_grad_norm=1.0)
    state, _ = step(_state(params), batch(0))  # a state whose FP8 state has moved
    before = fp8_of(state.params)
    bad = batch(1)
    bad["x"][5, 3] = np.nan
    state, metrics = step(state, bad)
    assert bool(metrics.skipped)
    for a, b in zip(fp8_of(state.params), before, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("num_mb", [1, 4])
def test_with_clipping_the_norm_and_update_are_those_of_the_step_without_fp8_state(num_mb):
    """The same step with the FP8 state taken out of the tree (the metas closed over as constants,
    so the loss computes the same): the same global norm and the same clipped update, bit for bit."""
    params = jax_params()
    metas = params.pop("fp8")
    with_fp8 = leanstep.make_train_step(jax_loss, precision=PRECISION, num_microbatches=num_mb, max_grad_norm=1e-3)
    without = leanstep.make_train_step(
        lambda p, b: jax_loss({**p, "fp8": metas}, b), precision=PRECISION, num_microbatches=num_mb, max_grad_norm=1e-3
    )
    a, metrics_a = with_fp8(_state({**params, "fp8": metas}), batch(0))
    b, metrics_b = without(_state(params), batch(0))
    assert bool(metrics_a.clipped) and float(metrics_a.grad_norm) > 1.0  # clipping active, by a factor > 1000
    assert float(metrics_a.grad_norm) == float(metrics_b.grad_norm)
    for key in ("w1", "w2"):
        np.testing.assert_array_equal(a.params[key], b.params[key])
    # The FP8 state moved, unclipped: its newest input amax is the batch's, not 1e-3 / norm of it.
    assert float(a.params["fp8"]["l1"].input_history[0]) > 1.0


@pytest.mark.parametrize("model", ["jax", "flax"])
def test_the_fp8_state_is_checkpointed_and_restored_bit_for_bit(tmp_path, model):
    loss, params = _models()[model]
    step = leanstep.make_train_step(loss, precision=PRECISION, num_microbatches=2)
    state, _ = step(_state(params), batch(0))
    with leanstep.checkpoints.Checkpointer(tmp_path / "ckpt") as checkpointer:
        checkpointer.save(1, state)
        restored = checkpointer.restore(_state(params)).state
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert fp8_leaves(restored.params) and type(restored.params) is type(state.params)


def test_an_fp8_meta_used_by_two_matmuls_is_refused():
    def loss(params, batch):
        h = leanstep.blocks.fp8_matmul(batch["x"], params["w1"], params["fp8"]["l1"], RECIPE)
        return jnp.mean(leanstep.blocks.fp8_matmul(h, params["w2"], params["fp8"]["l1"], RECIPE) ** 2)  # l1 again

    with pytest.raises(ValueError, match="used by a second matmul"):
        leanstep.make_train_step(loss)(_state(jax_params()), batch(0))


def test_metas_of_another_history_than_the_recipes_are_refused_naming_both():
    """History-16 metas under a history-4 recipe: refused when traced, not trained with 16 entries."""
    params = jax_params(leanstep.Fp8Recipe(history=16))
    loss = lambda p, b: jax_loss(p, b, leanstep.Fp8Recipe(history=4))
    message = (
        r"^meta: an Fp8Meta whose amax histories hold 16 entries, under recipe='delayed,history=4,amax=max,margin=0,"
        r"forward=e4m3,backward=e5m2' \(history=4\): make the meta with Fp8Meta.create\(recipe\), or pass the "
        r"recipe it was made with"
    )
    with pytest.raises(ValueError, match=message):
        leanstep.make_train_step(loss, precision=PRECISION)(_state(params), batch(0))
    with pytest.raises(ValueError, match=message):  # outside a step too: the matmul itself refuses it
        jax.grad(lambda p: loss(p, batch(0)))(jax.tree.map(jnp.asarray, params))


def _vmapped_loss(params, batch):
    """The matmuls of :func:`jax_loss` on one example at a time, the metas closed over."""
    one = lambda x: jax_loss(params, {"x": x[None], "y": jnp.zeros((1, 4), jnp.float32)})
    return jnp.mean(jax.vmap(one)(batch["x"]))


def test_a_delayed_fp8_matmul_vmapped_over_the_examples_is_refused():
    with pytest.raises(ValueError, match=r"^an FP8 matmul with delayed scaling \(its Fp8Meta\) runs under a jax.vmap"):
        leanstep.make_train_step(_vmapped_loss, precision=PRECISION)(_state(jax_params()), batch(0))


def test_a_vmap_that_batches_the_metas_with_the_operands_is_an_ensemble_and_runs():
    """Two members, each its own weights and metas: each member's new state is its own matmuls'
    (the reference: each member's gradient taken alone)."""
    members = [jax_params(), jax.tree.map(lambda a: a * 2, jax_params())]
    stacked = jax.tree.map(lambda *a: jnp.stack([jnp.asarray(x) for x in a]), *members)
    data = batch(0)
    grads = jax.grad(lambda p: jnp.sum(jax.vmap(lambda q: jax_loss(q, data))(p)))(stacked)
    for i, member in enumerate(members):
        alone = jax.grad(lambda p: jax_loss(p, data))(jax.tree.map(jnp.asarray, member))
        for a, b in zip(jax.tree.leaves(alone["fp8"]), jax.tree.leaves(grads["fp8"]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b[i]))


# --- the controls: the same Flax model, composed as peers compose it ----------------------------------


def _overwrite() -> optax.GradientTransformation:
    """The update that makes the parameter its gradient (how a user applies Flax's OWG collection)."""
    return optax.GradientTransformation(
        lambda p: optax.EmptyState(), lambda g, s, p: (jax.tree.map(jnp.subtract, g, p), s)
    )


def _peer_tx(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    def labels(variables):
        return {
            name: jax.tree.map(lambda _, name=name: "train" if name == "params" else "owg", tree)
            for name, tree in variables.items()
        }

    return optax.multi_transform({"train": inner, "owg": _overwrite()}, labels)


def _flax_grads(variables, b):
    """Flax's own way: ``jax.grad`` over all the variables, OWG collection included."""

    def loss(v):
        y = FlaxNet().apply(v, jnp.asarray(b["x"], jnp.bfloat16))
        return jnp.mean((y.astype(jnp.float32) - b["y"]) ** 2)

    return jax.grad(loss)(variables)


def _input_amax(variables) -> float:
    return float(variables["_overwrite_with_gradient"]["Dense_0"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"][0])


def _leanstep_flax(num_mb: int, max_grad_norm: float | None = None):
    loss, params = _models()["flax"]
    step = leanstep.make_train_step(loss, precision=PRECISION, num_microbatches=num_mb, max_grad_norm=max_grad_norm)
    state, _ = step(_state(params), batch(0))
    return llinen.merge(state.params, {})


def test_control_multisteps_averages_the_amax_leanstep_takes_the_max(capsys):
    """optax.MultiSteps over 4 microbatches hands the optimizer the mean of the OWG "gradients":
    the recorded input amax is the mean of the microbatches' amaxes, not the batch's."""
    num_mb, full = 4, batch(0)
    peer = optax.MultiSteps(_peer_tx(optax.adamw(1e-2)), every_k_schedule=num_mb)
    variables = flax_variables()
    opt_state = peer.init(variables)
    rows = len(full["x"]) // num_mb
    for j in range(num_mb):
        micro = {k: v[j * rows : (j + 1) * rows] for k, v in full.items()}
        updates, opt_state = peer.update(_flax_grads(variables, micro), opt_state, variables)
        variables = optax.apply_updates(variables, updates)
    truth = float(np.max(np.abs(np.asarray(jnp.asarray(full["x"], jnp.bfloat16), np.float32))))
    ours = _input_amax(_leanstep_flax(num_mb))
    error = abs(_input_amax(variables) - truth) / truth
    with capsys.disabled():
        print(
            f"\n  MultiSteps(4): recorded input amax {_input_amax(variables):.4f}, the batch's {truth:.4f} "
            f"(error {100 * error:.1f}%); leanstep: {ours:.4f}"
        )
    assert ours == truth and error > 0.2


def test_control_a_scan_carry_keeps_the_last_microbatchs_amax():
    """A scan over microbatches whose carry is the OWG collection (marin#7659's shape of bug):
    the last microbatch's amax survives."""
    num_mb, full = 4, batch(0)
    variables = flax_variables()
    rows = len(full["x"]) // num_mb
    owg = variables["_overwrite_with_gradient"]
    for j in range(num_mb):
        micro = {k: v[j * rows : (j + 1) * rows] for k, v in full.items()}
        owg = _flax_grads(variables, micro)["_overwrite_with_gradient"]  # the carry: each overwrites it
    last = float(np.max(np.abs(np.asarray(jnp.asarray(full["x"][-rows:], jnp.bfloat16), np.float32))))
    first = float(np.max(np.abs(np.asarray(jnp.asarray(full["x"][:rows], jnp.bfloat16), np.float32))))
    assert _input_amax({"_overwrite_with_gradient": owg}) == last != first
    assert _input_amax(_leanstep_flax(num_mb)) == max(last, first)


def test_control_clip_by_global_norm_clips_the_scales_leanstep_does_not(capsys):
    """optax.clip_by_global_norm over every gradient scales the OWG new values by the clip factor
    (maxtext#672): the history records clip * amax, and the next scale follows it."""
    peer = optax.chain(optax.clip_by_global_norm(1.0), _peer_tx(optax.adamw(1e-2)))
    variables = flax_variables()
    grads = _flax_grads(variables, batch(0))
    norm = float(optax.tree.norm(grads))
    updates, _ = peer.update(grads, peer.init(variables), variables)
    clipped = optax.apply_updates(variables, updates)
    ours = _leanstep_flax(1, max_grad_norm=1.0)
    unclipped = _input_amax({"_overwrite_with_gradient": grads["_overwrite_with_gradient"]})
    error = abs(_input_amax(clipped) - unclipped) / unclipped
    with capsys.disabled():
        print(
            f"\n  clip_by_global_norm(1.0) over a gradient of norm {norm:.1f}: recorded input amax "
            f"{_input_amax(clipped):.5f}, unclipped {unclipped:.4f} (error {100 * error:.1f}%); leanstep: "
            f"{_input_amax(ours):.4f}"
        )
    assert _input_amax(ours) == unclipped and error > 0.5


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(Path(sys.argv[2]))
