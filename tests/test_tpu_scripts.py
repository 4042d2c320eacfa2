"""The accelerator scripts' CPU dry runs (benchmarks/tpu_step.py, benchmarks/tpu_check.sh), so CI guards
what only a TPU measures."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from leanstep.blocks.int8 import Int8Recipe
from leanstep.models.transformer import TransformerConfig, transformer_flops_per_token


@pytest.mark.slow  # a whole benchmark script's dry run: the run is the point
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
    trace = result["trace"]  # the profile of leanstep's step (--trace): its kernels add up inside the step
    assert trace["kernels"] > 0 and 0 < trace["busy_s"] <= trace["wall_s"] * 1.01
    assert trace["matmul_kernels"] > 0 and {g["phase"] for g in trace["groups"]} >= {"forward", "backward"}
    int8 = report["results"]["tiny+int8"]  # the same step with int8 block matmuls, beside the bf16 one
    assert int8["int8"] == "on" and "handwritten" not in int8 and math.isfinite(int8["leanstep"]["loss"])
    assert abs(int8["leanstep"]["loss"] - result["leanstep"]["loss"]) < 0.05 * result["leanstep"]["loss"]


def test_tpu_step_names_its_int8_configurations_and_refuses_others():
    from benchmarks.tpu_step import CONFIGS, configuration

    assert configuration("splash+int8all") == (CONFIGS["splash"], Int8Recipe("int8"))
    assert configuration("splash") == (CONFIGS["splash"], None)
    for bad in ("splash+fp8", "nope+int8", "nope"):
        with pytest.raises(ValueError, match="--configs: unknown"):
            configuration(bad)


@pytest.mark.slow  # a ladder of depths compiled per format: the search is the point
def test_tpu_check_dry_run_fits_a_ladder_per_format_and_compares_the_planner_with_the_compiled_peak(tmp_path):
    from benchmarks.tpu_check import LADDER, TRAINED, main

    report = main(["--tiny", "--parts", "fit,plan", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "check.json").read_text())["parts"].keys() == {"fit", "plan"}
    fit, limit = report["parts"]["fit"], report["limit_bytes"]
    assert fit["formats"].keys() == LADDER.keys()
    for name, result in fit["formats"].items():
        # The deepest model that compiles under the limit: one layer more, compiled, does not.
        assert result["fits"] and result["peak_bytes"] <= 0.97 * limit < result["next_layer_peak_bytes"], name
        if name in TRAINED:
            train = result["train"]
            assert len(train["losses"]) == 2 and all(math.isfinite(x) for x in train["losses"]), name
    # the update inside the backward pass fits at least the chunked format's depth, and trains there too
    inside = fit["formats"]["bf16-sr + int8 (update in backward)"]
    assert inside["layers"] >= fit["formats"]["bf16-sr + int8 (chunked)"]["layers"]
    at_depth = fit["in_backward_at_int8_depth"]
    assert at_depth["layers"] == fit["formats"]["bf16-sr + int8 (chunked)"]["layers"]
    assert len(at_depth["train"]["losses"]) == 5 and not any(at_depth["train"]["skipped"])
    plan = report["parts"]["plan"]
    assert plan["predicted_peak_bytes"] <= 0.97 * limit and math.isfinite(plan["loss"])
    assert plan["measured_peak_bytes"] is None and plan["allocator_peak_before_steps"] is None  # a CPU keeps none
    assert "xla_peak_bytes" in plan


@pytest.mark.slow  # the benchmark's plan part in a fresh Python: the script is the point
def test_tpu_check_sh_runs_the_module(tmp_path):
    script = Path(__file__).parents[1] / "benchmarks" / "tpu_check.sh"
    done = subprocess.run(
        ["bash", str(script), "--tiny", "--parts", "plan", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "predicted_peak_bytes" in json.loads((tmp_path / "check.json").read_text())["parts"]["plan"]


def test_moment_codes_dry_run_times_every_search_and_decode_and_finds_the_same_codes():
    from benchmarks.moment_codes import DECODES, SEARCHES, main

    report = main(["--entries", "4096", "--repeats", "1"])
    assert report["search"].keys() == set(SEARCHES) and report["decode"].keys() == set(DECODES)
    assert report["decode_every_code_exact"] is True
    for result in [*report["search"].values(), *report["decode"].values()]:
        assert result["ns_an_entry"] > 0 and result["same"] is True


@pytest.mark.slow  # a whole benchmark script's dry run: the run is the point
def test_codec_tracing_dry_run_lowers_both_codecs_to_the_same_temporaries(tmp_path):
    from benchmarks.codec_tracing import main
    from leanstep.blocks import moments

    report = main(["--tiny", "--out", str(tmp_path / "trace.json")])
    assert json.loads((tmp_path / "trace.json").read_text()) == json.loads(json.dumps(report))
    jitted, unjitted = report["jitted"], report["unjitted"]
    assert jitted["temp_bytes"] == unjitted["temp_bytes"] > 0  # the same program's memory either way
    assert all(arm[key] > 0 for arm in (jitted, unjitted) for key in ("lower_s", "trace_s", "compile_s"))
    assert all(hasattr(getattr(moments, name), "__wrapped__") for name in ("quantize", "decode", "dequantize"))


def test_int8_forms_dry_run_times_each_form_and_checks_the_f32_sum_against_the_int32_one(tmp_path):
    from benchmarks.int8_forms import main

    report = main(["--tiny", "--calls", "2", "--out", str(tmp_path / "forms.json")])
    (row,) = report["shapes"].values()
    assert row["f32_sum_equals_int32_sum"] is True
    assert all(row[f"{form}_ms"] > 0 for form in ("bf16", "int32_sum", "f32_sum", "int8_only"))


def test_update_skip_dry_run_the_conditional_keeps_the_bits_and_fewer_temporaries(tmp_path):
    from benchmarks.update_skip import main

    report = main(["--tiny", "--calls", "1", "--out", str(tmp_path / "skip.json")])
    forms = report["forms"]
    assert report["same_bits"] is True
    assert forms["leanstep"]["temp_bytes"] == forms["cond"]["temp_bytes"] < forms["select"]["temp_bytes"]
