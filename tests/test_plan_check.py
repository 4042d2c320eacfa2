"""benchmarks.plan_check: the planned step run for real in a child process, its memory measured."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.plan_check import validate_plan
from leanstep.training import RunConfig


def test_validate_plan_runs_the_tiny_transformer_and_measures_its_peak():
    config = RunConfig(size="tiny", batch_size=8, seq_len=16)
    result = validate_plan(
        config,
        "64MiB",
        compiler_options={"xla_backend_optimization_level": 0},
        candidates=[(1, "none", config.precision)],
    )
    assert result["ran"] and np.isfinite(result["loss"])
    assert result["predicted_over_compiled"] == 1.0  # abstract planning == the run's own compile
    assert result["peak_reset"] and result["rss_rise_bytes"] > 0
    assert np.isfinite(result["predicted_over_measured"]) and 0.25 < result["predicted_over_measured"] < 4
    assert result["within_budget"]


@pytest.mark.slow  # 8 simulated devices
def test_a_planned_cluster_step_uses_the_predicted_memory_on_8_simulated_devices():
    """The chosen setting on 8 simulated devices, run for real: its peak RSS per device within 15%."""
    config = RunConfig(size="small", batch_size=16, seq_len=128)
    result = validate_plan(
        config, "256MiB", num_devices=8, meshes=[{"data": 8}], remat_policies=["none"], microbatches=[1]
    )
    assert result["ran"] and result["mesh"] == "data=8" and result["num_devices"] == 8
    assert result["predicted_over_compiled"] == 1.0  # the plan's memory is the run's own executable's
    assert 0.85 < result["predicted_over_measured"] < 1.15
