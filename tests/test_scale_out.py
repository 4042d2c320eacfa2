"""Memory and communication of the sharded step at scale, compile-only, on 8 simulated devices.

The models are the issue's: an 8-layer stack of 1024x1024 layers and the built-in transformer at
d_model 1024 (101M parameters). References: a hand-written FSDP step with per-layer gathers
(:func:`benchmarks.scaling.reference_fsdp_step`: jit, scan, value_and_grad, optax, no leanstep
stage) for memory; the data-parallel step's arguments for the 1/8 bound; the gradient's size for
bytes. This file is also the worker (``python tests/test_scale_out.py worker OUT``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers.workers import run_worker

pytestmark = pytest.mark.slow  # 8 simulated devices compiling a 101M-parameter model: the size is the point


def worker(out: Path) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from benchmarks import scaling
    from leanstep.sharding.distributed import device_mesh

    results = {}
    for work in (scaling.mlp_stack(), scaling.transformer()):
        reference = scaling.reference_fsdp_step(work, device_mesh(shape=scaling.LAYOUTS["fsdp"]), 4)
        results[f"{work.name}/reference"] = int(reference.memory_analysis().temp_size_in_bytes)
        for layout in ("dp", "fsdp"):
            results[f"{work.name}/{layout}"] = scaling.measure(work, layout, 4)
    # Both models again, small, in bfloat16 on every layout: no collective may move batch rows.
    small = (
        scaling.mlp_stack(layers=4, width=256),
        scaling.transformer(d_model=64, layers=2, d_ff=128, heads=4, seq_len=16, batch=32),
    )
    for work in small:
        for layout in scaling.LAYOUTS:
            results[f"{work.name}/{layout}/bf16"] = scaling.measure(work, layout, 4, "compute=bfloat16")
    (out / "scale.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def scale(tmp_path_factory) -> dict:
    return run_worker(__file__, tmp_path_factory.mktemp("scale"), "scale.json")


MODELS = ["mlp-stack", "transformer-d1024"]


@pytest.mark.parametrize("model", MODELS)
def test_fsdp_memory_is_within_15_percent_of_a_hand_written_per_layer_gather_step(scale, model):
    fsdp, dp = scale[f"{model}/fsdp"], scale[f"{model}/dp"]
    assert fsdp["temp_bytes"] <= 1.15 * scale[f"{model}/reference"]
    assert fsdp["argument_bytes"] <= dp["argument_bytes"] / 8 * 1.01
    assert fsdp["temp_bytes"] < dp["temp_bytes"] / 3  # ZeRO-3, not a replicated compute copy


@pytest.mark.parametrize("model", MODELS)
def test_communication_per_step_is_the_minimum(scale, model):
    dp, fsdp = scale[f"{model}/dp"], scale[f"{model}/fsdp"]
    # Data parallel: the gradient is reduced once per step (after the scan), every byte of it once.
    assert dp["reduction_trips"] == 1 and dp["executions"]["all-gather"] == 0
    assert 0 <= dp["bytes_per_step"] - dp["minimum_bytes"] < 1024  # the gradient, plus scalars
    # FSDP: per-layer gathers (forward and rematerialized backward) and reduce-scatters only.
    assert fsdp["executions"]["reduce-scatter"] > 0 and fsdp["executions"]["all-gather"] > 0
    assert fsdp["all_reduce_bytes"] < 1024  # scalars only (the loss, the norm, finiteness)
    assert abs(fsdp["bytes_per_step"] - fsdp["minimum_bytes"]) < 0.01 * fsdp["minimum_bytes"]
    assert fsdp["moves_batch"] == dp["moves_batch"] == 0


@pytest.mark.parametrize("model", ["mlp-stack", "transformer-d64"])
@pytest.mark.parametrize("layout", ["dp", "fsdp", "hybrid"])
def test_no_batch_rows_move_in_bfloat16(scale, model, layout):
    row = scale[f"{model}/{layout}/bf16"]
    assert row["moves_batch"] == 0
    if layout == "dp":
        assert row["reduction_trips"] == 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks/
    worker(Path(sys.argv[2]))
