"""Planning a cluster: mesh, microbatches, remat and reduction, on 8 simulated devices, compile-only.

References: hand counts of the MLP stack's FLOPs and bytes (and the cost model's formula applied
to them by hand); an exhaustive plan of the same grid (every candidate compiled) for the pruned
search's choice and its bounds; the executable ``leanstep train --mesh`` compiles, for memory.
This file is also the worker (``python tests/test_cluster_planning.py worker OUT``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from helpers.workers import run_worker
from leanstep.planning.cost_model import ACCELERATORS, collective_seconds, get_accelerator
from leanstep.planning.records import Plan

TINY = {
    "model": "transformer",
    "size": "tiny",
    "batch_size": 16,
    "seq_len": 16,
    "precision": "float32",
    "loss_scale": "none",
}
GRID = {
    "meshes": [{"data": 8}, {"data": 2, "fsdp": 2, "tensor": 2}],
    "remat_policies": ["none", "full"],
    "reductions": ["auto"],
    "microbatches": [1, 2],
}
LAYERS, WIDTH, ROWS = 4, 256, 64


def worker(out: Path) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import optax

    from benchmarks import scaling
    from leanstep.planning.cluster import plan_cluster
    from leanstep.planning.one_device import BudgetError
    from leanstep.planning.search_options import SearchOptions, SearchSpace
    from leanstep.sharding.distributed import device_mesh, parse_mesh
    from leanstep.training import RunConfig
    from leanstep.training.analysis import plan_run
    from leanstep.training.build import build_run

    results = {}
    # 1. The MLP stack's FLOPs and bytes on three layouts, 4-device nodes (data=2 crosses them).
    work = scaling.mlp_stack(layers=LAYERS, width=WIDTH, batch=ROWS)
    stack = plan_cluster(
        lambda _: work.loss,
        work.params,
        work.batch,
        optax.adam(1e-3),
        num_devices=8,
        budget_bytes="1GiB",
        accelerator=get_accelerator("h100", node_size=4),
        rules=work.rules,
        space=SearchSpace(
            meshes=[{"data": 8}, {"fsdp": 8}, {"data": 2, "fsdp": 4}],
            remat_policies=["full"],
            reductions=["auto"],
            microbatches=[1],
        ),
        search=SearchOptions(exhaustive=True),
    )
    results["stack"] = stack.to_json()

    # 2. The tiny transformer: the pruned search against every candidate compiled.
    config = RunConfig(**TINY)
    results["pruned"] = plan_run(config, "24MiB", num_devices=8, **GRID).to_json()
    exhaustive = plan_run(config, "24MiB", num_devices=8, exhaustive=True, **GRID)
    results["exhaustive"] = exhaustive.to_json()

    # 3. The executable a run compiles (XLA's default options, real arrays' shardings) for the choice.
    s = exhaustive.chosen.setting
    run_config = dataclasses.replace(
        config, mesh=s.mesh, reduce=s.reduce, microbatches=s.num_microbatches, remat=s.remat
    )
    run = build_run(run_config)
    mesh = device_mesh(shape=parse_mesh(s.mesh))
    from leanstep.sharding.meshes import batch_sharding
    from leanstep.step.state_sharding import state_shardings

    state = run.abstract_state()
    shardings = state_shardings(state, mesh, rules=run.model.rules)
    state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), state, shardings)
    batch = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=batch_sharding(mesh)), run.batch_spec()
    )
    memory = run.make_step(mesh=mesh).lower(state, batch).compile().memory_analysis()
    results["run_peak_bytes"] = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )

    # 4. A budget nothing fits.
    try:
        plan_run(config, "16KiB", num_devices=8, **GRID)
    except BudgetError as error:
        results["budget_error"] = str(error)
    (out / "plans.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict:
    return run_worker(__file__, tmp_path_factory.mktemp("plans"), "plans.json")


def _by_mesh(plan: dict) -> dict:
    return {c["mesh"]: c for c in plan["candidates"] if c["peak_bytes"] is not None}


@pytest.mark.slow  # 8-device plans compiled exhaustively: the search is the point
def test_flops_and_bytes_equal_hand_counts_for_the_mlp_stack(plans):
    rows = ROWS // 8  # each device's rows, on every layout
    layer = WIDTH * WIDTH * 4  # one float32 weight matrix
    found = _by_mesh(plans["stack"])
    for mesh in ("data=8", "fsdp=8", "data=2,fsdp=4"):
        # Full remat: forward, recomputed forward, two backward matmuls: 4 x 2 * rows * width^2 a layer.
        assert found[mesh]["flops"] == 8 * LAYERS * WIDTH**2 * rows
    # Data parallel: one all-reduce of the gradient; FSDP: gathers (forward, recompute) and a
    # reduce-scatter per layer; hybrid: those over fsdp=4 and the fsdp shard all-reduced over data=2.
    scalars = 1024  # the loss, the gradient norm, the finiteness flag
    hand = {
        "data=8": LAYERS * layer,
        "fsdp=8": 3 * LAYERS * layer,
        "data=2,fsdp=4": 3 * LAYERS * layer + LAYERS * layer // 4,
    }
    for mesh, expected in hand.items():
        assert 0 <= found[mesh]["bytes_per_step"] - expected < scalars


@pytest.mark.slow  # 8-device plans compiled exhaustively: the search is the point
def test_the_cost_model_prices_the_mlp_stack_as_computed_by_hand(plans):
    accelerator = get_accelerator("h100", node_size=4)
    found = _by_mesh(plans["stack"])
    total = LAYERS * WIDTH * WIDTH * 4
    bandwidth = {"in": accelerator.bandwidth * 0.8, "across": accelerator.inter_bandwidth * 0.8}
    # Every group of data=8 and fsdp=8 spans both 4-device nodes; data=2 (stride 4) too; fsdp=4 does not.
    hand = {
        "data=8": 2 * 7 / 8 * total / bandwidth["across"],
        "fsdp=8": 3 * 7 / 8 * total / bandwidth["across"],
        "data=2,fsdp=4": 3 * 3 / 4 * total / bandwidth["in"] + 2 * 1 / 2 * (total / 4) / bandwidth["across"],
    }
    for mesh, seconds in hand.items():
        c = found[mesh]
        assert c["communication_seconds"] - c["collectives"] * accelerator.latency == pytest.approx(seconds, rel=1e-3)
        assert c["compute_seconds"] == pytest.approx(c["flops"] / (accelerator.flops["float32"] * 0.5), rel=1e-12)
        assert c["predicted_seconds"] == pytest.approx(c["compute_seconds"] + c["communication_seconds"], rel=1e-12)


@pytest.mark.slow  # 8-device plans compiled exhaustively: the search is the point
def test_pruned_search_chooses_within_rtol_of_every_candidate_compiled(plans):
    pruned, exhaustive = Plan.from_json(plans["pruned"]), Plan.from_json(plans["exhaustive"])
    assert exhaustive.compiles == len([c for c in exhaustive.candidates if c.peak_bytes is not None])
    fitting = [c for c in exhaustive.candidates if c.fits]
    best = min(c.predicted_seconds for c in fitting)
    assert pruned.chosen.fits and pruned.chosen.predicted_seconds <= 1.02 * best
    assert pruned.compiles < exhaustive.compiles
    same = {c.setting: c for c in exhaustive.candidates}
    for c in pruned.candidates:
        other = same[c.setting]
        # The bound known before compiling is below what compiling found, for every candidate.
        assert other.predicted_seconds is None or c.bound_seconds <= other.predicted_seconds * (1 + 1e-9)
        # Arguments known before compiling are the compiled ones; a compile gives the same numbers twice.
        if other.compiled:
            assert c.argument_bytes == other.argument_bytes
        if c.compiled:
            assert (c.peak_bytes, c.flops, c.bytes_per_step) == (other.peak_bytes, other.flops, other.bytes_per_step)
        elif c.note.startswith("does not fit") or "take" in c.note:
            assert not other.fits


@pytest.mark.slow  # 8-device plans compiled exhaustively: the search is the point
def test_the_plans_memory_is_the_memory_of_the_executable_a_run_compiles(plans):
    assert Plan.from_json(plans["exhaustive"]).chosen.peak_bytes == plans["run_peak_bytes"]


@pytest.mark.slow  # 8-device plans compiled exhaustively: the search is the point
def test_a_budget_nothing_fits_names_the_smallest_peak_and_its_setting(plans):
    message = plans["budget_error"]
    assert message.startswith("no setting fits the budget of 16.0 KiB (16,384 bytes) per device: the smallest peak")
    assert "mesh=" in message and "reduce=" in message and "remat=" in message


def test_presets_price_collectives_by_where_their_group_lies():
    h100 = get_accelerator("h100", latency=0.0, link_efficiency=1.0)
    shape = {"data": 8, "fsdp": 8}  # fsdp fastest: each fsdp group is one node, each data group spans 8
    assert collective_seconds("all-gather", 8e9, 8, ("fsdp",), shape, h100) == pytest.approx(7 / 8 * 8e9 / 450e9)
    assert collective_seconds("all-gather", 8e9, 8, ("data",), shape, h100) == pytest.approx(7 / 8 * 8e9 / 50e9)
    with pytest.raises(ValueError, match="spans more than one tpu-v4 node"):
        collective_seconds("all-reduce", 1.0, 2, ("data",), {"data": 2, "fsdp": 4096}, ACCELERATORS["tpu-v4"])
    with pytest.raises(ValueError, match="accelerator must be one of h100"):
        get_accelerator("h800")
    with pytest.raises(ValueError, match="Accelerator.efficiency must be a positive finite number"):
        get_accelerator("a100", efficiency=-1.0)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks/
    worker(Path(sys.argv[2]))
