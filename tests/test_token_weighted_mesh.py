"""A token-weighted loss on a mesh is the one-device loss for every distribution of the tokens
(issue 27, item 12): over devices whose rows hold none, over microbatches that hold none, over
every reduction and layout. Before 0.8 a device without tokens divided 0 by 0, and under
``reduce="auto"`` or ``"step"`` every such step was NaN and skipped.

The reference is the one-device step (itself checked against full-batch gradients in
tests/test_step.py); the mesh runs in a subprocess with 8 simulated devices.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers.workers import run_worker

ROWS, D_IN = 16, 3
#: name -> which rows hold tokens (8 devices x 2 rows each; microbatch j of a device takes its row j).
MASKS = {
    "first_3_rows": np.arange(ROWS) < 3,
    "one_device": (np.arange(ROWS) // 2) == 5,
    "one_row": np.arange(ROWS) == 11,
    "every_other_device": ((np.arange(ROWS) // 2) % 2) == 0,
    "even_rows_only": (np.arange(ROWS) % 2) == 0,  # with 2 microbatches: the second holds none anywhere
    "all": np.ones(ROWS, bool),
    "random_a": np.random.default_rng(1).random(ROWS) < 0.3,
    "random_b": np.random.default_rng(2).random(ROWS) < 0.15,
    "none": np.zeros(ROWS, bool),  # a total of 0: NaN and skipped, on one device and on the mesh alike
}
LAYOUTS = {"data8": {"data": 8}, "hybrid": {"data": 2, "fsdp": 4}}
REDUCTIONS = ("auto", "step", "microbatch")


def _loss(params, batch):
    import jax.numpy as jnp

    err = jnp.sum((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2, axis=-1)
    return jnp.sum(err * batch["m"]), jnp.sum(batch["m"])


def _batch(mask: np.ndarray) -> dict:
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(ROWS, D_IN)).astype(np.float32),
        "y": rng.normal(size=(ROWS, 4)).astype(np.float32),
        "m": mask.astype(np.float32),
    }


def worker(out: Path) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import optax

    import leanstep
    from leanstep.sharding.distributed import device_mesh

    params = {"w": np.linspace(-1, 1, D_IN * 4, dtype=np.float32).reshape(D_IN, 4), "b": np.zeros(4, np.float32)}
    tx = optax.adam(0.1)  # one optimizer: a new one is a new state structure, and a new compile
    new_state = lambda: leanstep.TrainState.create(params, tx, loss_scale="dynamic")
    results: dict = {}
    for num_mb in (1, 2):
        reference = leanstep.make_train_step(_loss, token_weighted=True, num_microbatches=num_mb, max_grad_norm=1.0)
        for name, mask in MASKS.items():
            state, metrics = reference(new_state(), _batch(mask))
            results[f"one/{num_mb}/{name}"] = _row(state, metrics)
        for layout, shape in LAYOUTS.items():
            mesh = device_mesh(shape=shape)
            for reduce in REDUCTIONS:
                layer = leanstep.step.ShardingLayer(mesh, reduce=reduce)
                step = leanstep.make_train_step(
                    _loss, token_weighted=True, num_microbatches=num_mb, max_grad_norm=1.0, mesh=layer
                )
                for name, mask in MASKS.items():
                    state = leanstep.step.shard_train_state(new_state(), mesh)
                    state, metrics = step(state, leanstep.sharding.shard_batch(_batch(mask), mesh))
                    results[f"{layout}-{reduce}/{num_mb}/{name}"] = _row(state, metrics)
    (out / "token_weighted.json").write_text(json.dumps(results))


def _row(state, metrics) -> dict:
    return {
        "loss": float(metrics.loss),
        "skipped": bool(metrics.skipped),
        "params": {k: np.asarray(v).tolist() for k, v in state.params.items()},
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_worker(__file__, tmp_path_factory.mktemp("token_weighted"), "token_weighted.json")


@pytest.mark.parametrize("num_mb", [1, 2])
@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("where", [f"{layout}-{reduce}" for layout in LAYOUTS for reduce in REDUCTIONS])
def test_every_token_distribution_gives_the_one_device_step(results, where, name, num_mb):
    one, mesh = results[f"one/{num_mb}/{name}"], results[f"{where}/{num_mb}/{name}"]
    assert mesh["skipped"] == one["skipped"] == (name == "none")
    if name == "none":
        assert np.isnan(one["loss"]) and np.isnan(mesh["loss"])
        return
    np.testing.assert_allclose(mesh["loss"], one["loss"], rtol=2e-6)
    for key in one["params"]:
        np.testing.assert_allclose(mesh["params"][key], one["params"][key], rtol=2e-6, atol=1e-7)


def test_the_reference_moved_and_the_distributions_differ(results):
    losses = {name: results[f"one/1/{name}"]["loss"] for name in MASKS if name != "none"}
    assert len({round(v, 6) for v in losses.values()}) == len(losses)  # a test of 8 different batches


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(Path(sys.argv[2]))
