"""Meshes as users build them (issue 27, items 7, 8 and 19): data axes of any name, Explicit
axes, and a model's own ``with_sharding_constraint``.

* The README says every axis but ``fsdp`` and ``tensor`` is a data axis, whatever its name:
  ``("batch",)``, ``("dp1", "dp2")``, ``("replica", "fsdp")`` train as the one-device step
  does, under every reduction, without ``data_axis=``. Before 0.8.1 each was refused unless
  ``data_axis=`` named an axis.
* ``jax.make_mesh``'s default Explicit axes are refused by leanstep, naming ``axis_types``
  (before: JAX's "can only refer to Auto axes" from inside the step).
* A loss that calls ``jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data")))``
  is refused, naming both fixes, where the step reduces once per step (a manual ``shard_map``
  axis); it trains under ``reduce="microbatch"``, as the one-device step does, with the
  same all-reduce bytes as a loss without the constraint under ``reduce="auto"``.

The reference is the one-device step; the meshes run in a subprocess with 8 simulated devices.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import leanstep
from helpers.workers import run_worker

ROWS = 16
#: name -> (axis names, mesh shape).
MESHES = {
    "batch": (("batch",), (8,)),
    "dp1_dp2": (("dp1", "dp2"), (2, 4)),
    "replica_fsdp": (("replica", "fsdp"), (2, 4)),
    "rows_tensor": (("rows", "tensor"), (4, 2)),
    "a_b_c": (("a", "b", "c"), (2, 2, 2)),
}
REDUCTIONS = ("auto", "step", "microbatch")


def _params() -> dict:
    return {"w": np.linspace(-1, 1, 3 * 4, dtype=np.float32).reshape(3, 4), "b": np.zeros(4, np.float32)}


def _batch() -> dict:
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(ROWS, 3)).astype(np.float32), "y": rng.normal(size=(ROWS, 4)).astype(np.float32)}


def _loss(params, batch):
    import jax.numpy as jnp

    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def _constrained_loss(mesh, axes):
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    def loss(params, batch):
        h = jax.lax.with_sharding_constraint(batch["x"] @ params["w"], NamedSharding(mesh, PartitionSpec(axes)))
        return jnp.mean((h + params["b"] - batch["y"]) ** 2)

    return loss


def _row(state, metrics) -> dict:
    return {"loss": float(metrics.loss), "params": {k: np.asarray(v).tolist() for k, v in state.params.items()}}


def _all_reduce_bytes(step, state, batch, mesh) -> int:
    compiled = step.lower(state, batch).compile()
    return leanstep.inspection.collectives_report(compiled, mesh, params=state.params).bytes_per_step("all-reduce")


def worker(out: Path) -> None:
    jax.config.update("jax_num_cpu_devices", 8)
    from jax.sharding import Mesh

    tx = optax.adam(0.1)  # one optimizer: a new one is a new state structure, and a new compile
    new_state = lambda: leanstep.TrainState.create(_params(), tx)
    results: dict = {}
    for num_mb in (1, 2):
        kw = dict(num_microbatches=num_mb, max_grad_norm=1.0)
        results[f"one/{num_mb}"] = _row(*leanstep.make_train_step(_loss, **kw)(new_state(), _batch()))
        for name, (names, shape) in MESHES.items():
            mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
            batch_axes = tuple(a for a in names if a != "tensor")
            for reduce in REDUCTIONS:
                step = leanstep.make_train_step(_loss, mesh=leanstep.step.ShardingLayer(mesh, reduce=reduce), **kw)
                state = lambda: leanstep.step.shard_train_state(new_state(), mesh)  # noqa: B023  # each step donates it
                batch = leanstep.sharding.shard_batch(_batch(), mesh)
                results[f"{name}-{reduce}/{num_mb}"] = _row(*step(state(), batch))
                constrained = leanstep.make_train_step(
                    _constrained_loss(mesh, batch_axes), mesh=leanstep.step.ShardingLayer(mesh, reduce=reduce), **kw
                )
                try:
                    results[f"{name}-{reduce}/{num_mb}/constrained"] = _row(*constrained(state(), batch))
                    if num_mb == 1 and reduce == "microbatch":
                        results[f"{name}/bytes"] = {
                            "constrained": _all_reduce_bytes(constrained, state(), batch, mesh),
                            "auto": _all_reduce_bytes(
                                leanstep.make_train_step(_loss, mesh=mesh, **kw), state(), batch, mesh
                            ),
                        }
                except ValueError as error:
                    results[f"{name}-{reduce}/{num_mb}/constrained"] = {"error": str(error)}
    (out / "mesh_axes.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_worker(__file__, tmp_path_factory.mktemp("mesh_axes"), "mesh_axes.json")


def _assert_same(got: dict, want: dict) -> None:
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=2e-6)
    for key in want["params"]:
        np.testing.assert_allclose(got["params"][key], want["params"][key], rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("num_mb", [1, 2])
@pytest.mark.parametrize("reduce", REDUCTIONS)
@pytest.mark.parametrize("name", sorted(MESHES))
@pytest.mark.slow  # 8 simulated devices in a child process: the meshes are the point
def test_a_data_axis_of_any_name_trains_as_one_device(results, name, reduce, num_mb):
    _assert_same(results[f"{name}-{reduce}/{num_mb}"], results[f"one/{num_mb}"])


@pytest.mark.parametrize("num_mb", [1, 2])
@pytest.mark.parametrize("reduce", REDUCTIONS)
@pytest.mark.parametrize("name", sorted(MESHES))
@pytest.mark.slow  # 8 simulated devices in a child process: the meshes are the point
def test_a_model_s_own_sharding_constraint_trains_or_is_refused_naming_both_fixes(results, name, reduce, num_mb):
    got = results[f"{name}-{reduce}/{num_mb}/constrained"]
    if reduce == "microbatch":  # no manual axis: XLA's partitioner takes the user's constraint
        _assert_same(got, results[f"one/{num_mb}"])
        return
    assert "error" in got, got
    assert "leanstep.sharding.constrain" in got["error"] and "reduce='microbatch'" in got["error"]


# Pure data-parallel meshes: over an fsdp axis XLA reduces tiny gradients by all-reduce where
# the once-per-step layer scatters them, so all-reduce bytes are not comparable there.
@pytest.mark.parametrize("name", sorted(n for n, (names, _) in MESHES.items() if "fsdp" not in names))
@pytest.mark.slow  # 8 simulated devices in a child process: the meshes are the point
def test_the_constrained_loss_moves_no_more_gradient_bytes_than_the_once_per_step_reduction(results, name):
    nbytes = results[f"{name}/bytes"]
    assert nbytes["auto"] > 0
    assert nbytes["constrained"] <= nbytes["auto"]


@pytest.mark.slow  # 8 simulated devices in a child process: the meshes are the point
def test_the_reference_moved(results):
    assert results["one/1"]["params"]["b"] != _params()["b"].tolist()


def _explicit_mesh():
    return jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.mark.parametrize(
    "call",
    [
        lambda mesh: leanstep.make_train_step(_loss, mesh=mesh),
        lambda mesh: leanstep.step.ShardingLayer(mesh),
        lambda mesh: leanstep.sharding.shard_batch(_batch(), mesh),
        lambda mesh: leanstep.step.shard_train_state(leanstep.TrainState.create(_params(), optax.sgd(0.1)), mesh),
        lambda mesh: leanstep.sharding.batch_sharding(mesh),
        lambda mesh: leanstep.sharding.mesh_axes(mesh),
    ],
    ids=["make_train_step", "ShardingLayer", "shard_batch", "shard_train_state", "batch_sharding", "mesh_axes"],
)
def test_explicit_axes_are_refused_naming_axis_types(call):
    with pytest.raises(ValueError, match=r"axis_types=\(jax.sharding.AxisType.Auto,\) \* 1"):
        call(_explicit_mesh())


def test_an_auto_mesh_from_make_mesh_is_taken():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    assert leanstep.step.ShardingLayer(mesh).num_shards == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"data_axis": "rows"}, "data_axis='rows' is not an axis"),  # a name the caller chose must exist
        ({"fsdp": True}, "data_axis='data' is not an axis"),  # the axis the state would be split over
    ],
)
def test_a_data_axis_the_caller_needs_must_be_an_axis(kwargs, match):
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    with pytest.raises(ValueError, match=match):
        leanstep.step.ShardingLayer(mesh, **kwargs)


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(Path(sys.argv[2]))
