"""leanstep bench on an accelerator (issue 40), run on a CPU with the platform's facts passed in.

The accelerator path differs from the CPU one in what it measures against, not in how it times:
the chip's peak from a table (never /proc/cpuinfo), no CPU-only figure, "n/a" where a figure is
not defined, and a model large enough that the chip sets the step time.
"""

from __future__ import annotations

import argparse
import io
import math

import jax
import pytest
from rich.console import Console

from leanstep.bench import CHIP_PEAKS, MATMUL_SIZES, BenchConfig, Platform, platform_for, run_benchmark, runner
from leanstep.bench.contenders import Contender, Spec
from leanstep.cli import bench as bench_cli
from leanstep.cli.bench_table import render_benchmark
from leanstep.models import build_model

TPU = platform_for("tpu", "TPU v5 lite")
CPU = platform_for("cpu", "cpu")
V5E_GFLOPS = 197e3  # Google Cloud's TPU v5e page: 197 TFLOP/s bf16 per chip

# tests/test_bench.py's tiny run (one layer, 8 positions, 2 steps timed), asked for torch rows.
TEST_CONFIG = dict(
    size="tiny", model_overrides=(("d_model", 8), ("n_layers", 1), ("n_heads", 2), ("d_ff", 16), ("seq_len", 8)),
    batch_size=4, num_microbatches=2, remat="dots", microbatch_sweep=(1, 2), remat_sweep=("dots", "full"),
    repeats=2, torch_repeats=1, matmul_size=128, matmul_repeats=1, torch=True,
)  # fmt: skip


def _text(result):
    console = Console(width=220, record=True, file=io.StringIO())
    console.print(render_benchmark(result))
    return console.export_text()


def _summary(text):
    """The summary table's ``what -> value`` cells (the rows table has more columns)."""
    cells = [line.split("│") for line in text.splitlines() if line.count("│") == 3]
    return {cell[1].strip(): cell[2].strip() for cell in cells}


# ---------------------------------------------------------------- the table of chips


@pytest.mark.parametrize("backend, kind, tflops", [
    ("tpu", "TPU v5 lite", 197), ("tpu", "TPU v5", 459), ("tpu", "TPU v4", 275), ("tpu", "TPU v6 lite", 918),
    ("gpu", "NVIDIA H100 80GB HBM3", 989), ("gpu", "NVIDIA H100 PCIe", 756), ("gpu", "NVIDIA A100-SXM4-40GB", 312),
])  # fmt: skip
def test_a_known_chip_states_its_vendor_peak(backend, kind, tflops):
    platform = platform_for(backend, kind, device_count=4)
    assert platform == Platform(backend, kind, tflops * 1e3, 4) and platform.accelerator


def test_an_unknown_kind_or_a_cpu_has_no_table_peak():
    assert platform_for("tpu", "TPU v4 lite").peak_gflops is None  # exact kinds: a v4i is no v4
    assert platform_for("gpu", "NVIDIA H100").peak_gflops is None
    cpu = platform_for("cpu", "cpu")
    assert cpu.peak_gflops is None and not cpu.accelerator
    kinds = [kind for kind, _ in CHIP_PEAKS]
    assert len(kinds) == len(set(kinds)) and all(peak >= 1e14 for _, peak in CHIP_PEAKS)
    with pytest.raises(ValueError, match="backend must be a non-empty string, got ''"):
        platform_for("", "TPU v5 lite")


def test_an_unknown_accelerator_is_measured_against_its_bf16_matmul():
    notes = []
    matmul = {"xla_bfloat16": {"gflops": 150e3, "size": 8192, "repeats": 5}, "xla_float32": None}
    limit = runner._chip_limit(platform_for("gpu", "NVIDIA Z1"), matmul, notes)
    assert limit == {"chip": (150e3, "xla bf16 matmul probe (best of 5 at 8192x8192)")}
    assert notes == [
        (
            "device kind 'NVIDIA Z1' is not in leanstep.bench.CHIP_PEAKS: "
            "MFU is against the measured xla bfloat16 matmul instead of the chip's peak"
        )
    ]
    assert runner._chip_limit(TPU, matmul, notes)["chip"][0] == V5E_GFLOPS and len(notes) == 1
    assert runner._chip_limit(CPU, matmul, notes) == {}


@pytest.mark.parametrize("accelerator, sizes, probe", [(True, (4096, 8192, 16384), 4096), (False, MATMUL_SIZES, 256)])
def test_an_accelerator_measures_its_matmuls_at_sizes_that_fill_the_chip(monkeypatch, accelerator, sizes, probe):
    seen = []

    def record(make, dtype, **settings):
        seen.append((make, dtype, settings))
        return {"gflops": 1.0}

    monkeypatch.setattr(runner, "measure_matmul_gflops", record)
    config = BenchConfig.for_platform(TPU if accelerator else CPU, quick=True)
    matmul = runner._measure_matmuls(config, False, lambda line: None, accelerator)
    assert matmul == {"xla_float32": {"gflops": 1.0}, "xla_bfloat16": {"gflops": 1.0}, "torch_float32": None,
                      "torch_bfloat16": None}  # fmt: skip
    assert [dtype for _, dtype, _ in seen] == ["float32", "bfloat16"]
    for make, _, settings in seen:
        assert make is runner.xla_matmul and settings["sizes"] == sizes and settings["probe_size"] == probe
        assert settings["max_size"] == (8192 if accelerator else 2048)


# ---------------------------------------------------------------- the model chosen


def test_the_cpu_presets_are_unchanged():
    assert BenchConfig.for_platform(CPU, quick=True) == BenchConfig.quick()
    assert BenchConfig.for_platform(CPU, quick=False, torch_compile=True) == BenchConfig.full(torch_compile=True)
    args = argparse.ArgumentParser(prog="leanstep")
    bench_cli.add_parser(args.add_subparsers(dest="command"))
    assert bench_cli._config(args.parse_args(["bench", "--quick"]), CPU) == BenchConfig.quick(torch=True)
    assert bench_cli._config(args.parse_args(["bench"]), CPU) == BenchConfig.full(torch=True, torch_compile=True)
    on_tpu = bench_cli._config(args.parse_args(["bench", "--quick", "--repeats", "3"]), TPU)
    assert on_tpu == BenchConfig.for_platform(TPU, quick=True, repeats=3) and not on_tpu.torch


@pytest.mark.parametrize("quick, layers, batch", [(True, 4, 8), (False, 8, 16)])
def test_an_accelerator_times_a_model_the_chip_sets_the_time_of(quick, layers, batch):
    config = BenchConfig.for_platform(TPU, quick=quick)
    model = build_model("transformer", config.size, **dict(config.model_overrides))
    assert (model.config.d_model, model.config.n_layers, model.seq_len, config.batch_size) == (
        1024,
        layers,
        1024,
        batch,
    )
    assert model.config.d_model // model.config.n_heads == 128  # a TPU's matrix units are 128 wide
    params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0))))
    step_gflop = model.flops_per_token * config.batch_size * model.seq_len / 1e9
    # At the whole v5e peak a step takes over 10 ms: the chip, not a ~0.1 ms dispatch, sets its time.
    assert step_gflop / V5E_GFLOPS > 0.010 and params > layers * 12e6
    # Every contender keeps its float32 params and AdamW moments on the chip at once: within half of 16 GiB.
    contenders = len(config.specs(with_torch=False))
    assert contenders * params * 12 < 8 * 2**30
    assert not config.torch and config.matmul_size >= 8192
    assert BenchConfig.for_platform(TPU, quick=quick, size="tiny").model_overrides == ()  # --size: its preset


# ---------------------------------------------------------------- a whole (tiny) run on an injected TPU


@pytest.fixture(scope="module")
def tpu_result():
    return run_benchmark(BenchConfig(**TEST_CONFIG).validate(), platform=TPU)


@pytest.mark.slow  # a whole benchmark run, every contender and sweep: the run is the point
def test_an_accelerator_run_is_measured_against_the_chip_and_no_cpu_figure(tpu_result):
    assert tpu_result["cpu_peak"] is None  # /proc/cpuinfo is not read for a chip
    assert tpu_result["rows"] and all(row["impl"] != "torch" for row in tpu_result["rows"])
    assert "torch rows skipped on an accelerator" in " ".join(tpu_result["notes"])
    for row in tpu_result["rows"]:
        assert row["mfu_against"] == "chip" and row["mfu_peak_gflops"] == V5E_GFLOPS
        assert row["mfu"] == pytest.approx(row["achieved_gflops"] / V5E_GFLOPS, rel=1e-12)
        assert row["cpu_peak_fraction"] is None and row["cpu_peak_note"] is None
    platform = tpu_result["platform"]
    assert platform["accelerator"] and platform["device_kind"] == "TPU v5 lite"
    fraction = tpu_result["peak_gflops"]["xla_bfloat16"] / V5E_GFLOPS
    assert platform["xla_bfloat16_matmul_fraction_of_peak"] == pytest.approx(fraction, rel=1e-12)
    assert tpu_result["mfu"]["leanstep_mfu_against"] == "chip"


@pytest.mark.slow  # a whole benchmark run, every contender and sweep: the run is the point
def test_the_accelerator_table_prints_no_cpu_row_and_n_a_for_undefined_figures(tpu_result):
    text = _text(tpu_result)
    assert "TPU v5 lite (tpu; 1 device(s), the step runs on one)" in text
    assert "chip peak GFLOP/s (TPU v5 lite, dense bf16, vendor figure)" in text and "197000" in text
    for cpu_only in ("of CPU peak", "CPU peak GFLOP/s", "fraction of the CPU's float32 peak"):
        assert cpu_only not in text
    summary = _summary(text)
    assert summary["leanstep_over_torch_time_float32"] == "n/a" and summary["peak GFLOP/s torch_bfloat16"] == "n/a"
    assert summary["MFU leanstep bf16 step (against the chip's peak)"].endswith("%")


# ---------------------------------------------------------------- temp bytes a TPU does not report


def _contender(impl, temp_bytes):
    spec = Spec(impl, "bfloat16", 2, "dots")
    stats = {"temp_bytes": temp_bytes, "argument_bytes": 8, "output_bytes": 8, "alias_bytes": 8, "xla_gflop": None}
    return Contender(spec, run=lambda: None, stats=stats, first_loss=5.0)


@pytest.mark.parametrize("ours_temps, theirs_temps, expected", [(0, 0, None), (0, 4096, None), (2048, 4096, 0.5)])
def test_a_temp_ratio_with_no_temps_is_n_a(ours_temps, theirs_temps, expected):
    ours, theirs = _contender("leanstep", ours_temps), _contender("handwritten_jax", theirs_temps)
    config = BenchConfig(**TEST_CONFIG)
    rows = [runner._row(c, [0.01], 1.0, {}, (None, "cpu"), 32) for c in (ours, theirs)]
    notes = []
    ratios = runner._ratios(config, rows, [1.0], ours, theirs, notes)
    assert ratios["leanstep_over_handwritten_temp_bytes"] == expected
    assert ratios["leanstep_over_handwritten_time"] == 1.0
    if expected is None:
        what = f"XLA reports {ours_temps} temp bytes for leanstep's step and {theirs_temps} for the hand-written one"
        assert notes == [f"{what}: no ratio"]
        result = {
            "rows": rows, "ratios": ratios, "peak_gflops": {}, "matmul": {}, "mfu": {}, "checks": {}, "notes": notes,
            "machine": {"cpu_model": "host", "cores_available": 2},
            "platform": {**vars(TPU), "accelerator": True, "xla_bfloat16_matmul_fraction_of_peak": None},
        }  # fmt: skip
        text = _text(result)
        assert _summary(text)["leanstep_over_handwritten_temp_bytes"] == "n/a" and "0.000" not in text
    else:
        assert notes == []
