"""The accelerator scripts' CPU dry runs (benchmarks/tpu_step.py, benchmarks/tpu_check.sh), so CI guards
what only a TPU measures."""

from __future__ import annotations

import json
import math

from leanstep.models.transformer import TransformerConfig, transformer_flops_per_token


def test_tpu_step_dry_run_times_both_steps_and_counts_the_models_flops(tmp_path):
    from benchmarks.tpu_step import main

    report = main(["--tiny", "--out", str(tmp_path / "step.json")])
    assert json.loads((tmp_path / "step.json").read_text()) == json.loads(json.dumps(report))
    result = report["results"]["tiny"]
    config = TransformerConfig(d_model=64, n_layers=2, n_heads=2, d_ff=256, seq_len=32, attention="xla")
    assert result["model_flops"] == transformer_flops_per_token(config) * 4 * 32
    assert result["leanstep"]["step_s"] > 0 and result["handwritten"]["step_s"] > 0
    assert result["leanstep"]["peak_bytes"] > 0 and math.isfinite(result["leanstep"]["loss"])
    assert math.isnan(result["mfu"])  # no chip, no peak: not a number rather than a made-up one
