"""Tests for leanstep.sharding.meshes and the sharded path of make_train_step.

The device count is fixed when JAX starts its backend, so the multi-device checks run in
subprocesses with simulated CPU devices: this file is also their worker script
(``python tests/test_sharding.py worker8 DIR`` / ``worker4 DIR``), each doing several checks
and writing raw results (JSON + NumPy arrays) for the test to judge. References: the
single-device step (``mesh=None``), NumPy indexing for the strided split, a brute-force search
for the FSDP dimension, and, for the HLO check, the naive contiguous split (which must be
caught moving rows, or the check proves nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec

from helpers.workers import child_env
from leanstep.sharding.meshes import (
    batch_sharding,
    data_mesh,
    fsdp_partition_spec,
    shard_batch,
)
from leanstep.step.sharding_layer import ShardingLayer
from leanstep.step.state import TrainState
from leanstep.step.state_sharding import shard_train_state, state_shardings
from leanstep.step.train_step import make_train_step

SIZES = (3, 24, 5)  # d_in, hidden, d_out: no parameter shape (or shard of one) looks like a batch slice
BATCH = 64  # 8 devices x 4 microbatches x 2 rows
STEP_KW = dict(precision="float32", max_grad_norm=0.5)


def mlp_loss(params: dict, batch: dict) -> jax.Array:
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, :])
    return jnp.mean((hidden @ params["w2"] + params["b2"][None, :] - batch["y"]) ** 2)


def init_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    d_in, hidden, d_out = SIZES
    return {
        "w1": rng.normal(size=(d_in, hidden)).astype(np.float32) / np.sqrt(d_in),
        "b1": rng.normal(size=(hidden,)).astype(np.float32) * 0.1,
        "w2": rng.normal(size=(hidden, d_out)).astype(np.float32) / np.sqrt(hidden),
        "b2": np.zeros((d_out,), np.float32),
    }


def batch_at(step: int, nan_row: int | None = None) -> dict:
    rng = np.random.default_rng(1000 + step)
    x = rng.normal(size=(BATCH, SIZES[0])).astype(np.float32)
    y = np.sin(x @ rng.normal(size=(SIZES[0], SIZES[2]))).astype(np.float32)
    if nan_row is not None:
        x[nan_row, 1] = np.nan
    return {"x": x, "y": y}


TX = optax.adam(1e-2)  # one optimizer: a new one is a new state structure, and a new compile


def new_state() -> TrainState:
    return TrainState.create(init_params(), TX, loss_scale="dynamic")


def flat(tree) -> dict[str, np.ndarray]:
    """Host copies keyed by path (fully replicated or fully addressable arrays only)."""
    return {jax.tree_util.keystr(p): np.array(v, copy=True) for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def report_rows(compiled, mesh, params) -> list[dict]:
    """The collectives report as plain rows (JSON for the judging process)."""
    from leanstep.inspection.collectives import collectives_report

    return [
        {
            "kind": c.kind,
            "name": c.name,
            "bytes": c.bytes,
            "trips": c.trips,
            "moves_batch": c.moves_batch,
            "scalar": all(not dims for _, dims in c.shapes),
            "axes": list(c.axes),
        }
        for c in collectives_report(compiled, mesh, params=params).collectives
    ]


#: name -> (mesh shape, ShardingLayer options); every layout the sharding layer has.
LAYOUTS = {
    "dp": ({"data": 8}, {}),
    "fsdp": ({"data": 8}, {"fsdp": True}),
    "hybrid": ({"data": 2, "fsdp": 4}, {}),
    "tensor": (
        {"data": 2, "fsdp": 2, "tensor": 2},
        {"rules": (("w1", (None, "tensor")), ("b1", ("tensor",)), ("w2", ("tensor", None)))},
    ),
    "fsdpstep": ({"fsdp": 8}, {"reduce": "step"}),
}


def layout_mesh(shape: dict):
    from leanstep.sharding.distributed import device_mesh

    return device_mesh(shape=shape)


# --- subprocess workers ------------------------------------------------------------------------


def _start(num_devices: int) -> None:
    import warnings

    warnings.simplefilter("error")  # e.g. "donated buffers were not usable"
    jax.config.update("jax_num_cpu_devices", num_devices)
    jax.config.update("jax_numpy_rank_promotion", "raise")


def worker8(out: Path) -> None:
    _start(8)
    from jax.sharding import NamedSharding

    from leanstep.blocks.accumulation import microbatched_value_and_grad
    from leanstep.checkpoints.checkpointer import Checkpointer

    results: dict = {"devices": jax.device_count()}
    arrays: dict[str, np.ndarray] = {}
    # NaN in row 21: the third of eight row blocks (8 rows each); strided microbatch 21 % 4 = 1.
    data = [batch_at(0), batch_at(1, nan_row=21), batch_at(2)]
    for num_mb in (1, 4):
        reference = make_train_step(mlp_loss, num_microbatches=num_mb, **STEP_KW)
        state = new_state()
        for t, batch in enumerate(data):
            state, metrics = reference(state, batch)
            arrays.update({f"ref{num_mb}/{t}{k}": v for k, v in flat((state, metrics._replace(aux=None))).items()})
        for layout, (shape, options) in LAYOUTS.items():
            mesh, tag = layout_mesh(shape), f"{layout}{num_mb}"
            place = {k: v for k, v in options.items() if k in ("fsdp", "rules")}
            step = make_train_step(mlp_loss, num_microbatches=num_mb, mesh=ShardingLayer(mesh, **options), **STEP_KW)
            state = shard_train_state(new_state(), mesh, **place)
            results[f"{tag}/specs"] = {k: str(s.spec) for k, s in flat_shardings(state).items()}
            run = step
            if num_mb == 4:
                # Run the very executable whose HLO is checked; a Compiled object also refuses
                # (rather than recompiles for) inputs laid out unlike its first ones.
                run = step.lower(state, shard_batch(data[0], mesh)).compile()
                results[f"{tag}/collectives"] = report_rows(run, mesh, init_params())
            for t, batch in enumerate(data):
                before = state.params
                if t == 1:  # the NaN step: every device's shard of params must be unchanged
                    before_shards = [
                        [np.array(s.data) for s in leaf.addressable_shards] for leaf in jax.tree.leaves(before)
                    ]
                state, metrics = run(state, shard_batch(batch, mesh))
                if t == 1:
                    after_shards = [
                        [np.array(s.data) for s in leaf.addressable_shards] for leaf in jax.tree.leaves(state.params)
                    ]
                    results[f"{tag}/nan_shards_unchanged"] = [
                        [a.tobytes() == b.tobytes() for a, b in zip(old, new)]
                        for old, new in zip(before_shards, after_shards)
                    ]
                    results[f"{tag}/nan_scale_per_device"] = [
                        float(s.data) for s in state.loss_scale.loss_scale.addressable_shards
                    ]
                    results[f"{tag}/nan_skips_per_device"] = [
                        int(s.data) for s in state.consecutive_skips.addressable_shards
                    ]
                arrays.update({f"{tag}/{t}{k}": v for k, v in flat((state, metrics._replace(aux=None))).items()})
            results[f"{tag}/out_specs"] = {k: str(s.spec) for k, s in flat_shardings(state).items()}
            if run is step:
                results[f"{tag}/compiles"] = step._cache_size()
            if tag == "fsdp4":  # checkpoint it, then run two more steps for the restores to match
                with Checkpointer(out / "ckpt") as checkpointer:
                    checkpointer.save(3, state, extra={})
                arrays.update({f"saved{k}": v for k, v in flat(state).items()})
                for t in (3, 4):
                    state, _ = run(state, shard_batch(batch_at(t), mesh))
                arrays.update({f"continued{k}": v for k, v in flat(state).items()})
    # The FSDP checkpoint restores onto every other 8-device layout and continues there.
    with Checkpointer(out / "ckpt") as checkpointer:
        for layout in ("dp", "hybrid", "tensor"):
            shape, options = LAYOUTS[layout]
            mesh = layout_mesh(shape)
            place = {k: v for k, v in options.items() if k in ("fsdp", "rules")}
            state = checkpointer.restore(shard_train_state(new_state(), mesh, **place)).state
            arrays.update({f"{layout}/restored{k}": v for k, v in flat(state).items()})
            step = make_train_step(mlp_loss, num_microbatches=4, mesh=ShardingLayer(mesh, **options), **STEP_KW)
            for t in (3, 4):
                state, _ = step(state, shard_batch(batch_at(t), mesh))
            arrays.update({f"{layout}/continued{k}": v for k, v in flat(state).items()})
    # Data parallel: one gradient reduction per step whatever the number of microbatches.
    mesh = layout_mesh(LAYOUTS["dp"][0])
    for num_mb in (1, 2, 8):
        step = make_train_step(mlp_loss, num_microbatches=num_mb, mesh=mesh, **STEP_KW)
        compiled = step.lower(shard_train_state(new_state(), mesh), shard_batch(data[0], mesh)).compile()
        results[f"dp{num_mb}/collectives"] = report_rows(compiled, mesh, init_params())
    # The control: the naive contiguous split of a row-sharded batch. It must move rows.
    naive = jax.jit(
        microbatched_value_and_grad(mlp_loss, 4),
        in_shardings=(NamedSharding(mesh, PartitionSpec()), batch_sharding(mesh)),
    )
    results["naive/collectives"] = report_rows(naive.lower(init_params(), data[0]).compile(), mesh, init_params())
    try:
        make_train_step(mlp_loss, num_microbatches=4, mesh=mesh)(
            new_state(), jax.tree.map(lambda v: v[:16], batch_at(0))
        )
        results["indivisible_error"] = None
    except ValueError as error:
        results["indivisible_error"] = str(error)
    np.savez(out / "worker8.npz", **arrays)
    (out / "worker8.json").write_text(json.dumps(results))


def flat_shardings(state) -> dict:
    return {jax.tree_util.keystr(p): v.sharding for p, v in jax.tree_util.tree_leaves_with_path(state)}


def worker4(out: Path) -> None:
    """Restores the 8-device FSDP checkpoint on 4 devices, on a 1-device mesh and with no mesh."""
    _start(4)
    from leanstep.checkpoints.checkpointer import Checkpointer

    arrays: dict[str, np.ndarray] = {}
    layouts = {"mesh4": (data_mesh(), True), "mesh1": (data_mesh(jax.devices()[:1]), False), "plain": (None, False)}
    results: dict = {"devices": jax.device_count()}
    with Checkpointer(out / "ckpt") as checkpointer:
        for name, (mesh, fsdp) in layouts.items():
            template = new_state() if mesh is None else shard_train_state(new_state(), mesh, fsdp=fsdp)
            restored = checkpointer.restore(template)
            state = restored.state
            results[f"{name}/step"] = restored.step
            results[f"{name}/specs"] = {
                k: str(s.spec) if mesh is not None else None for k, s in flat_shardings(state).items()
            }
            results[f"{name}/num_devices"] = len(state.params["w1"].sharding.device_set)
            arrays.update({f"{name}/restored{k}": v for k, v in flat(state).items()})
            layer = None if mesh is None else ShardingLayer(mesh, fsdp=fsdp)
            step = make_train_step(mlp_loss, num_microbatches=4, mesh=layer, **STEP_KW)
            for t in (3, 4):
                batch = batch_at(t) if mesh is None else shard_batch(batch_at(t), mesh)
                state, _ = step(state, batch)
            arrays.update({f"{name}/continued{k}": v for k, v in flat(state).items()})
    np.savez(out / "worker4.npz", **arrays)
    (out / "worker4.json").write_text(json.dumps(results))


def _run_worker(name: str, out: Path, timeout: float = 240) -> tuple[dict, dict]:
    env = child_env()
    proc = subprocess.run(
        [sys.executable, __file__, name, str(out)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    with np.load(out / f"{name}.npz") as npz:
        arrays = dict(npz)
    return json.loads((out / f"{name}.json").read_text()), arrays


@pytest.fixture(scope="module")
def multi_device(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sharded")
    results8, arrays8 = _run_worker("worker8", out)
    results4, arrays4 = _run_worker("worker4", out)
    return {"r8": results8, "a8": arrays8, "r4": results4, "a4": arrays4}


def _prefixed(arrays: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}


def assert_close(actual: dict, expected: dict, rtol: float = 2e-5, atol: float = 2e-6) -> None:
    assert actual.keys() == expected.keys() and actual
    for key, value in expected.items():
        np.testing.assert_allclose(actual[key], value, rtol=rtol, atol=atol, err_msg=key)


# --- multi-device tests (judging the workers' output) -------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("num_mb", [1, 4])
@pytest.mark.slow  # 8 and 4 simulated devices in child processes
def test_sharded_steps_equal_single_device_steps(multi_device, layout, num_mb):
    assert multi_device["r8"]["devices"] == 8
    tag = f"{layout}{num_mb}"
    a8 = multi_device["a8"]
    for t in range(3):  # step 1 holds the NaN row: both skip, so states still agree
        assert_close(_prefixed(a8, f"{tag}/{t}"), _prefixed(a8, f"ref{num_mb}/{t}"))
    assert bool(a8[f"{tag}/1[1].skipped"]) and bool(a8[f"ref{num_mb}/1[1].skipped"])
    assert not bool(a8[f"{tag}/2[1].skipped"])


@pytest.mark.parametrize("tag", [f"{layout}{m}" for layout in LAYOUTS for m in (1, 4)])
@pytest.mark.slow  # 8 and 4 simulated devices in child processes
def test_nan_on_one_device_skips_on_every_device(multi_device, tag):
    results = multi_device["r8"]
    shards_unchanged = results[f"{tag}/nan_shards_unchanged"]
    assert len(shards_unchanged) == 4 and all(len(leaf) == 8 and all(leaf) for leaf in shards_unchanged)
    assert results[f"{tag}/nan_scale_per_device"] == [2.0**14] * 8  # 2**15 halved, everywhere
    assert results[f"{tag}/nan_skips_per_device"] == [1] * 8


@pytest.mark.slow  # 8 and 4 simulated devices in child processes
def test_state_layouts(multi_device):
    results = multi_device["r8"]
    for tag in ("dp1", "dp4"):
        assert set(results[f"{tag}/out_specs"].values()) == {"P()"}
    for layout in LAYOUTS:  # the step keeps the layout it was given (so it compiles once)...
        assert results[f"{layout}4/out_specs"] == results[f"{layout}4/specs"], layout
    # ...and M=1 steps ran as jitted functions: one compile each.
    assert all(results[f"{layout}1/compiles"] == 1 for layout in LAYOUTS)
    specs = results["fsdp4/out_specs"]
    for key in (".params['w1']", ".opt_state[0].mu['w1']", ".opt_state[0].nu['w1']"):
        assert specs[key] == "P(None, 'data')", key
    assert specs[".params['w2']"] == "P('data',)" and specs[".params['b1']"] == "P('data',)"
    assert specs[".params['b2']"] == "P()" and specs[".step"] == "P()" and specs[".rng"] == "P()"
    hybrid, tensor = results["hybrid4/specs"], results["tensor4/specs"]
    assert hybrid[".params['w1']"] == hybrid[".opt_state[0].mu['w1']"] == "P(None, 'fsdp')"
    assert tensor[".params['w1']"] == tensor[".opt_state[0].nu['w1']"] == "P(None, 'tensor')"
    assert tensor[".params['w2']"] == "P('tensor',)" and tensor[".params['b2']"] == "P()"


def _reductions(rows: list[dict]) -> dict[str, list[dict]]:
    """Non-scalar all-reduces and reduce-scatters, grouped by HLO instruction."""
    found: dict[str, list[dict]] = {}
    for row in rows:
        if row["kind"] in ("all-reduce", "reduce-scatter") and not row["scalar"]:
            found.setdefault(row["name"].split("#")[0], []).append(row)
    return found


@pytest.mark.parametrize("num_mb", [1, 2, 4, 8])
@pytest.mark.slow  # 8 and 4 simulated devices in child processes
def test_data_parallel_reduces_the_gradient_once_per_step(multi_device, num_mb):
    rows = multi_device["r8"][f"dp{num_mb}/collectives"]
    parts = [p for parts in _reductions(rows).values() for p in parts]
    assert {p["trips"] for p in parts} == {1}  # after the microbatch scan, once per step...
    grad_bytes = 4 * sum(v.size for v in init_params().values())
    assert sum(p["bytes"] for p in parts) == grad_bytes  # ...every byte of the gradient once
    assert all(r["kind"] == "all-reduce" for r in rows)  # nothing else but scalars


@pytest.mark.slow  # 8 and 4 simulated devices in child processes
def test_fsdp_reduce_scatters_and_never_all_reduces_the_gradient(multi_device):
    rows = multi_device["r8"]["fsdp4/collectives"]
    big = [r for r in rows if not r["scalar"]]
    assert {r["kind"] for r in big} == {"all-gather", "reduce-scatter", "all-reduce"}
    # The only non-scalar all-reduce is of b2 (5 floats), which 8 devices cannot split.
    assert all(r["bytes"] == 20 for r in big if r["kind"] == "all-reduce")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.slow  # 8 and 4 simulated devices in child processes
def test_microbatched_sharded_step_moves_no_batch_rows(multi_device, layout):
    rows = multi_device["r8"][f"{layout}4/collectives"]
    assert rows and [r for r in rows if r["moves_batch"]] == []
    # The detector is not vacuous: the naive contiguous split is caught gathering rows.
    assert [r for r in multi_device["r8"]["naive/collectives"] if r["moves_batch"]]


@pytest.mark.parametrize("layout", ["dp", "hybrid", "tensor"])
@pytest.mark.slow  # 8 and 4 simulated devices in child processes
def test_fsdp_checkpoint_restores_onto_other_layouts(multi_device, layout):
    a8 = multi_device["a8"]
    restored, saved = _prefixed(a8, f"{layout}/restored"), _prefixed(a8, "saved")
    assert restored.keys() == saved.keys()
    assert all(restored[k].tobytes() == saved[k].tobytes() for k in saved)
    assert_close(_prefixed(a8, f"{layout}/continued"), _prefixed(a8, "continued"))


@pytest.mark.slow  # 8 and 4 simulated devices in child processes
def test_batch_indivisible_by_devices_times_microbatches(multi_device):
    assert multi_device["r8"]["indivisible_error"] == (
        "batch size 16 is not divisible by num_microbatches=4 times the 8 devices of mesh axis 'data'"
    )


@pytest.mark.parametrize("layout", ["mesh4", "mesh1", "plain"])
@pytest.mark.slow  # 8 and 4 simulated devices in child processes
def test_checkpoint_from_8_devices_restores_and_continues(multi_device, layout):
    r4, a4, a8 = multi_device["r4"], multi_device["a4"], multi_device["a8"]
    assert r4["devices"] == 4 and r4[f"{layout}/step"] == 3
    assert r4[f"{layout}/num_devices"] == {"mesh4": 4, "mesh1": 1, "plain": 1}[layout]
    if layout == "mesh4":
        assert r4["mesh4/specs"][".params['w1']"] == "P(None, 'data')"
    restored, saved = _prefixed(a4, f"{layout}/restored"), _prefixed(a8, "saved")
    assert restored.keys() == saved.keys()
    for key in saved:
        assert restored[key].tobytes() == saved[key].tobytes(), key
    assert_close(_prefixed(a4, f"{layout}/continued"), _prefixed(a8, "continued"))


# --- single-process tests ------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(shape=st.lists(st.integers(1, 40), max_size=4), num_shards=st.integers(1, 9))
def test_fsdp_partition_spec_picks_largest_divisible_dimension(shape, num_shards):
    spec = tuple(fsdp_partition_spec(shape, num_shards))
    divisible = [a for a, s in enumerate(shape) if s % num_shards == 0]
    if num_shards == 1 or not divisible:
        assert spec == ()
        return
    best = max(divisible, key=lambda a: (shape[a], -a))
    assert len(spec) == best + 1 and spec[best] == "data"  # no trailing Nones
    assert all(name is None for name in spec[:best])


def test_state_shardings_tree_and_abstract_state():
    mesh = data_mesh(jax.devices()[:1])
    state = new_state()
    abstract = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), state)
    for tree in (state, abstract):
        shardings = state_shardings(tree, mesh, fsdp=True)
        assert jax.tree.structure(shardings) == jax.tree.structure(state)
        assert all(s.mesh == mesh for s in jax.tree.leaves(shardings))
    plain = state_shardings({"a": np.zeros((4, 2))}, mesh)
    assert plain["a"].spec == PartitionSpec()


def test_bad_mesh_and_axis():
    mesh = data_mesh(jax.devices()[:1])
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh, got list"):
        batch_sharding([mesh])
    with pytest.raises(ValueError, match=r"data_axis='batch' is not an axis of the mesh; its axes are \('data',\)"):
        state_shardings(new_state(), mesh, data_axis="batch")
    with pytest.raises(ValueError, match="data_axis='batch'"):
        make_train_step(mlp_loss, mesh=ShardingLayer(mesh, "batch"))
    with pytest.raises(ValueError, match="reduce must be one of"):
        make_train_step(mlp_loss, mesh=ShardingLayer(mesh, reduce="sometimes"))
    with pytest.raises(ValueError, match="has_state=True with reduce='step'"):
        make_train_step(mlp_loss, mesh=ShardingLayer(mesh, reduce="step"), has_state=True)
    with pytest.raises(ValueError, match="partition rule 'w1' names 3 dimensions"):
        state_shardings(new_state(), mesh, rules=(("w1", ("fsdp", None, None)),))
    with pytest.raises(TypeError, match="fsdp must be a bool, got str 'yes'"):
        make_train_step(mlp_loss, mesh=ShardingLayer(mesh, fsdp="yes"))
    with pytest.raises(ValueError, match=r"batch\['s'\] has shape \(\); its leading"):
        shard_batch({"s": np.float32(1.0)}, mesh)
    with pytest.raises(ValueError, match="at least one device"):
        data_mesh([])


def test_one_device_mesh_step_matches_plain_step_and_keeps_rng_per_microbatch():
    """Strided microbatches on a mesh, contiguous without: same loss and update (a mean loss);
    per-microbatch aux follows each split's rows."""
    mesh = data_mesh(jax.devices()[:1])

    def loss_fn(params, batch, rng):
        noise = jax.random.uniform(rng, ())
        return mlp_loss(params, batch), (batch["x"][:, 0], noise)

    kw = dict(num_microbatches=4, has_aux=True, uses_rng=True, **STEP_KW)
    batch = batch_at(0)
    plain_state, plain = make_train_step(loss_fn, **kw)(new_state(), batch)
    state = shard_train_state(new_state(), mesh)
    mesh_state, sharded = make_train_step(loss_fn, mesh=mesh, **kw)(state, shard_batch(batch, mesh))
    assert_close(flat(mesh_state), flat(plain_state))
    np.testing.assert_allclose(sharded.loss, plain.loss, rtol=1e-6)
    x0 = batch["x"][:, 0]
    np.testing.assert_array_equal(plain.aux[0], x0.reshape(4, 16))
    np.testing.assert_array_equal(sharded.aux[0], x0.reshape(16, 4).T)
    # Microbatch j gets fold_in(step key, j) on both paths.
    np.testing.assert_array_equal(sharded.aux[1], plain.aux[1])


def test_simulated_devices_run_on_the_cpu_platform_whatever_the_parent_names(monkeypatch):
    # `leanstep plan --devices N` and `leanstep verify` make N simulated devices in a child: on a GPU
    # machine the child must not start the GPU backend (one device, where N were asked for).
    from leanstep.sharding.distributed import run_on_simulated_cpus

    monkeypatch.setenv("JAX_PLATFORMS", "cuda")  # as on an accelerator machine; this one has no GPU
    child = run_on_simulated_cpus(
        "from leanstep.sharding.distributed import configure_devices; configure_devices(4); "
        "import jax; print(jax.default_backend(), jax.device_count())"
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["cpu", "4"]


_POOL_THREADS = (
    "from leanstep.sharding.distributed import configure_devices; configure_devices(4); "
    "import os, jax, jax.numpy as jnp; jax.jit(lambda a: a + 1)(jnp.ones(4)).block_until_ready(); "
    "print(os.environ['PJRT_NPROC'], "
    "sum(open(f'/proc/self/task/{t}/comm').read().strip() == 'tf_XLAEigen' for t in os.listdir('/proc/self/task')))"
)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in Linux's /proc")
@pytest.mark.parametrize(("preset", "threads"), [(None, 16), ("6", 6)])
def test_simulated_devices_get_four_pool_threads_each_unless_pjrt_nproc_is_set(monkeypatch, preset, threads):
    # XLA:CPU's pool defaults to max(cores, devices) threads; devices blocked in collectives
    # then starved a 4-device run on 2 cores (XLA aborted: "only 3 of them arrived on time").
    from leanstep.sharding.distributed import run_on_simulated_cpus

    monkeypatch.delenv("PJRT_NPROC", raising=False)
    if preset is not None:
        monkeypatch.setenv("PJRT_NPROC", preset)
    child = run_on_simulated_cpus(_POOL_THREADS)
    assert child.returncode == 0, child.stderr
    nproc, pool = child.stdout.split()[-2:]
    assert nproc == (preset or str(max(16, os.cpu_count() or 1)))  # the setting, whatever the cores
    assert int(pool) == max(threads, os.cpu_count() if preset is None else 0)  # and the pool XLA made


def test_a_state_off_the_mesh_is_placed_as_the_step_leaves_it_and_the_step_compiles_once():
    # TrainState.create's state lies on the default device; a mesh step gave back its state laid
    # out on the mesh, so the second call, a new input type, compiled the step a second time.
    from jax.sharding import AxisType

    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,))
    layer = ShardingLayer(mesh)
    runs = {}
    for placed in (False, True):
        step = make_train_step(mlp_loss, num_microbatches=2, mesh=layer, **STEP_KW)
        state = shard_train_state(new_state(), mesh) if placed else new_state()
        for i in range(3):
            state, _ = step(state, batch_at(i))
        assert state.params["w1"].sharding == layer.state_shardings(state).params["w1"]
        runs[placed] = (flat(state), step._cache_size())  # the jitted step's programs (jax.jit's own count)
    assert runs[False][1] == runs[True][1] == 1
    np.testing.assert_equal(runs[False][0], runs[True][0])  # the values of a state placed by hand


if __name__ == "__main__":
    {"worker8": worker8, "worker4": worker4}[sys.argv[1]](Path(sys.argv[2]))
