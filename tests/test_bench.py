"""leanstep bench: the hand-written baseline takes leanstep's step; a tiny run's output is complete."""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from leanstep.bench import chart, runner
from leanstep.bench.contenders import Contender, Spec
from leanstep.bench.handwritten import init_handwritten_state, make_handwritten_step
from leanstep.bench.runner import BenchConfig, run_benchmark
from leanstep.bench.torch_step import torch_available
from leanstep.blocks.loss_scale import DynamicLossScale
from leanstep.cli import bench as bench_cli
from leanstep.cli.jsontree import InputError
from leanstep.step.train_step import TrainState, make_train_step

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ROW_FIELDS = {
    "impl",
    "precision",
    "num_microbatches",
    "remat",
    "step_ms_median",
    "step_ms_min",
    "step_ms_max",
    "temp_bytes",
    "model_gflop_per_step",
    "achieved_gflops",
    "mfu",
    "mfu_against",
    "mfu_peak_gflops",
    "mfu_note",
    "cpu_peak_fraction",
    "cpu_peak_note",
}
RATIO_KEYS = {
    "leanstep_over_handwritten_time",
    "leanstep_over_handwritten_temp_bytes",
    "leanstep_over_torch_time_float32",
    "leanstep_over_torch_time_bfloat16",
}
PEAK_KEYS = {"xla_float32", "xla_bfloat16", "torch_float32", "torch_bfloat16"}

# Smaller than --quick: one layer, 8 positions, 2 steps timed, two microbatch counts, two policies.
TEST_CONFIG = dict(
    size="tiny", model_overrides=(("d_model", 8), ("n_layers", 1), ("n_heads", 2), ("d_ff", 16), ("seq_len", 8)),
    batch_size=4, num_microbatches=2, remat="dots", microbatch_sweep=(1, 2), remat_sweep=("dots", "full"),
    repeats=2, torch_repeats=1, matmul_size=128, matmul_repeats=1,
)  # fmt: skip


@pytest.fixture(scope="module")
def result():
    return run_benchmark(BenchConfig(**TEST_CONFIG).validate())  # torch=True: used if installed


# ---------------------------------------------------------------- the hand-written step


def _mlp_loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, :])
    return jnp.mean(jnp.square(hidden @ params["w2"] - batch["y"]))


def _mlp_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w1": jax.random.normal(k1, (3, 5)), "b1": jnp.zeros(5), "w2": jax.random.normal(k2, (5, 2))}


def _mlp_batch(seed, poison=False):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(8, 3)).astype(np.float32)
    if poison:
        x[5, 1] = np.inf
    return {"x": jnp.asarray(x), "y": jnp.asarray(rng.normal(size=(8, 2)).astype(np.float32))}


def _assert_trees_close(a, b, rtol=1e-6, atol=1e-7):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol)


def test_handwritten_takes_leanstep_steps_bf16_clip_skip_and_scale_growth():
    opt = optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.01)
    ours = make_train_step(
        _mlp_loss, precision="params=float32,compute=bfloat16,output=float32", num_microbatches=2, max_grad_norm=0.5
    )
    theirs = make_handwritten_step(_mlp_loss, opt, num_microbatches=2, max_grad_norm=0.5, growth_interval=2)
    ours_state = TrainState.create(_mlp_params(), opt, loss_scale=DynamicLossScale.create(2.0**10, growth_interval=2))
    theirs_state = init_handwritten_state(_mlp_params(), opt, loss_scale=2.0**10)
    # Steps 0, 1 finite (the scale grows after the second), step 2 has an inf input (skipped, halved).
    expected_scales = [1024.0, 2048.0, 1024.0, 1024.0]
    for i, poison in enumerate([False, False, True, False]):
        before = jax.tree.map(np.asarray, theirs_state.params)
        ours_state, metrics = ours(ours_state, _mlp_batch(i, poison))
        theirs_state, their_metrics = theirs(theirs_state, _mlp_batch(i, poison))
        assert bool(metrics.skipped) == poison
        if poison:
            _assert_trees_close(theirs_state.params, before, rtol=0, atol=0)
        else:
            assert bool(metrics.clipped)  # the clip is exercised, not bypassed
            np.testing.assert_allclose(float(their_metrics["loss"]), float(metrics.loss), rtol=1e-6)
            np.testing.assert_allclose(float(their_metrics["grad_norm"]), float(metrics.grad_norm), rtol=1e-6)
        _assert_trees_close(theirs_state.params, ours_state.params)
        _assert_trees_close(theirs_state.opt_state, ours_state.opt_state)
        assert float(theirs_state.loss_scale) == float(ours_state.loss_scale.loss_scale) == expected_scales[i]


def test_handwritten_float32_sgd_step_matches_float64_numpy():
    params = _mlp_params(1)
    batch = _mlp_batch(7)
    step = make_handwritten_step(
        _mlp_loss,
        optax.sgd(0.1),
        compute_dtype=jnp.float32,
        num_microbatches=4,
        max_grad_norm=1e9,
        dynamic_loss_scale=False,
    )
    state, metrics = step(init_handwritten_state(params, optax.sgd(0.1), loss_scale=1.0), batch)

    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x, y = np.asarray(batch["x"], np.float64), np.asarray(batch["y"], np.float64)
    hidden = np.tanh(x @ p["w1"] + p["b1"])
    residual = hidden @ p["w2"] - y
    d_out = 2 * residual / residual.size
    d_pre = (d_out @ p["w2"].T) * (1 - hidden**2)
    grads = {"w1": x.T @ d_pre, "b1": d_pre.sum(0), "w2": hidden.T @ d_out}
    np.testing.assert_allclose(float(metrics["loss"]), np.mean(residual**2), rtol=1e-5)
    norm = math.sqrt(sum(float(np.sum(g**2)) for g in grads.values()))
    np.testing.assert_allclose(float(metrics["grad_norm"]), norm, rtol=1e-5)
    for name, initial in p.items():
        np.testing.assert_allclose(np.asarray(state.params[name]), initial - 0.1 * grads[name], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- a whole (tiny) run


@pytest.mark.slow  # a whole benchmark run, every contender and sweep: the run is the point
def test_leanstep_and_handwritten_take_the_same_first_transformer_step(result):
    checks = result["checks"]
    assert checks["first_step_loss_leanstep"] == pytest.approx(checks["first_step_loss_handwritten"], rel=1e-6)
    assert 0 <= checks["first_step_max_abs_param_diff"] <= 1e-6


@pytest.mark.slow  # a whole benchmark run, every contender and sweep: the run is the point
def test_result_has_every_key_with_sane_types(result):
    assert PEAK_KEYS <= set(result["peak_gflops"])
    assert RATIO_KEYS <= set(result["ratios"])
    for key in ("xla_float32", "xla_bfloat16"):
        assert result["peak_gflops"][key] == result["matmul"][key]["gflops"] > 0
        assert result["matmul"][key]["gflops"] >= result["matmul"][key]["gflops_median"] > 0  # best of N
    assert result["cpu_peak"]["gflops"] is None or result["cpu_peak"]["gflops"] > 0
    machine = result["machine"]
    assert machine["cpu_model"] and machine["cores_available"] >= 1 and machine["jax"] == jax.__version__
    assert result["ratios"]["leanstep_over_handwritten_time"] > 0
    assert result["ratios"]["leanstep_over_handwritten_temp_bytes"] > 0
    assert "analytic" in result["mfu"]["flops_source"]
    json.dumps(result)  # JSON-ready as returned

    for row in result["rows"]:
        assert ROW_FIELDS <= set(row)
        assert row["impl"] in {"leanstep", "handwritten_jax", "torch"}
        assert row["precision"] in {"float32", "bfloat16"}
        assert isinstance(row["num_microbatches"], int) and isinstance(row["remat"], str)
        assert 0 < row["step_ms_min"] <= row["step_ms_median"] <= row["step_ms_max"]
        assert row["model_gflop_per_step"] > 0
        if row["impl"] == "torch":
            assert row["temp_bytes"] is None
        else:
            assert isinstance(row["temp_bytes"], int) and row["temp_bytes"] > 0
            assert row["argument_bytes"] > 0


@pytest.mark.slow  # a whole benchmark run, every contender and sweep: the run is the point
def test_no_row_is_above_its_peak(result):
    for row in result["rows"]:
        backend = "torch" if row["impl"] == "torch" else "xla"
        assert row["mfu_against"] == f"{backend}_{row['precision']}"
        assert row["mfu_peak_gflops"] == result["peak_gflops"][row["mfu_against"]]
        if row["achieved_gflops"] <= row["mfu_peak_gflops"]:
            assert 0 < row["mfu"] <= 1 and row["mfu_note"] is None
            assert row["mfu"] == pytest.approx(row["achieved_gflops"] / row["mfu_peak_gflops"])
        else:
            assert row["mfu"] is None and row["mfu_note"].startswith("peak meaningless")
        fraction = row["cpu_peak_fraction"]
        assert fraction is None or 0 < fraction <= 1
    limit = result["mfu"]["cpu_float32_peak_gflops"]
    assert limit is None or all(limit >= v for k, v in result["peak_gflops"].items() if v and k.endswith("float32"))


@pytest.mark.slow  # a whole benchmark run, every contender and sweep: the run is the point
def test_rows_cover_the_sweeps_and_comparisons(result):
    def keys(**match):
        return {(r["num_microbatches"], r["remat"]) for r in result["rows"] if all(r[k] == v for k, v in match.items())}

    assert keys(impl="leanstep", precision="bfloat16") >= {(1, "dots"), (2, "dots"), (2, "full")}
    assert keys(impl="handwritten_jax") == {(2, "dots")}
    assert keys(impl="leanstep", precision="float32") == {(2, "full")}
    # One analytic FLOP count for every row: same model, same batch.
    assert len({r["model_gflop_per_step"] for r in result["rows"]}) == 1


@pytest.mark.slow  # a whole benchmark run, every contender and sweep: the run is the point
def test_torch_rows_and_ratios_follow_torch_availability(result):
    torch_rows = [r for r in result["rows"] if r["impl"] == "torch"]
    ratios, peaks = result["ratios"], result["peak_gflops"]
    if torch_available():
        assert {r["precision"] for r in torch_rows} == {"float32", "bfloat16"}
        assert all(r["remat"] == "full" for r in torch_rows)
        assert ratios["leanstep_over_torch_time_float32"] > 0 and peaks["torch_bfloat16"] > 0
    else:
        assert torch_rows == []
        assert ratios["leanstep_over_torch_time_float32"] is None and peaks["torch_float32"] is None
        assert any("torch is not installed" in note for note in result["notes"])


def _contender(impl, precision):
    spec = Spec(impl, precision, 2, "full", "eager" if impl == "torch" else None)
    stats = dict.fromkeys(("temp_bytes", "argument_bytes", "output_bytes", "alias_bytes", "xla_gflop"))
    return Contender(spec, run=lambda: None, stats=stats, first_loss=5.0)


def test_a_row_faster_than_its_probe_has_no_mfu_and_says_why():
    # The 0.1 run's case: a torch bf16 step (autocast leaves much of it in float32) at 4.5 GFLOP/s against a
    # 1.35 GFLOP/s bf16 matmul probe, and the CPU's float32 peak of 156.8.
    probes = {"torch_bfloat16": (1.35, "torch bf16 matmul probe"), "xla_float32": (151.0, "xla float32 probe")}
    cpu = (156.8, "theoretical float32 CPU peak")
    row = runner._row(_contender("torch", "bfloat16"), [0.1, 0.1, 0.1], 0.45, probes, cpu, 2048)
    assert row["achieved_gflops"] == pytest.approx(4.5) and row["mfu"] is None
    assert row["mfu_note"] == (
        "peak meaningless: the row reaches 4.5 GFLOP/s, above the 1.35 GFLOP/s torch bf16 matmul probe"
    )
    assert row["cpu_peak_fraction"] == pytest.approx(4.5 / 156.8) and row["cpu_peak_note"] is None
    fine = runner._row(_contender("leanstep", "float32"), [0.01], 0.755, probes, cpu, 2048)  # 75.5 GFLOP/s
    assert fine["mfu"] == pytest.approx(0.5) and fine["mfu_note"] is None and fine["mfu_against"] == "xla_float32"
    unmeasured = runner._row(_contender("torch", "float32"), [0.01], 0.755, probes, (None, "cpu"), 2048)
    assert unmeasured["mfu"] is unmeasured["mfu_note"] is unmeasured["cpu_peak_fraction"] is None


def test_a_theoretical_peak_below_a_measured_matmul_is_no_limit():
    notes = []
    below = runner.CpuPeak(150.0, ghz=2.45, clock_source="/proc/cpuinfo cpu MHz")
    assert runner._cpu_limit(below, {"xla_float32": 151.0, "torch_float32": 179.0, "xla_bfloat16": 200.0}, notes) == (
        None,
        "theoretical float32 CPU peak",
    )
    assert "below the measured torch_float32 matmul (179 GFLOP/s)" in notes[0]
    above = runner.CpuPeak(224.0, ghz=3.5, clock_source="cpufreq cpuinfo_max_freq")
    assert runner._cpu_limit(above, {"xla_float32": 151.0, "torch_float32": None}, notes)[0] == 224.0
    assert runner._cpu_limit(runner.CpuPeak(None, "not x86 (aarch64)"), {}, notes)[0] is None
    assert notes[-1] == "no theoretical CPU peak: not x86 (aarch64)"


@pytest.mark.slow  # a whole benchmark run, every contender and sweep: the run is the point
def test_chart_is_a_png(result, tmp_path):
    path = chart.plot_benchmark(result, tmp_path / "bench.png")
    with open(path, "rb") as png:
        assert png.read(8) == PNG_SIGNATURE


# ---------------------------------------------------------------- CLI


def _parse(argv):
    parser = argparse.ArgumentParser(prog="leanstep")
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats must be an integer >= 1, got 0"),
    (["--torch-threads", "0"], "--torch-threads must be an integer >= 1, got 0"),
    (["--microbatches", "3"], "--batch-size 16 is not divisible by --microbatches [3]"),
    (["--remat-sweep", "dots;sometimes"], "unknown policy='sometimes'"),
    (["--quick", "--size", "large"], None),
])  # fmt: skip
def test_cli_rejects_bad_flags(argv, message, capsys):
    if message is None:
        with pytest.raises(SystemExit):
            _parse(["bench", *argv])
        return
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        bench_cli.run_bench(_parse(["bench", *argv]))


@pytest.mark.slow  # a whole benchmark run, every contender and sweep: the run is the point
def test_cli_writes_table_json_and_chart(result, tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_run(config, log):
        seen["config"] = config
        return json.loads(json.dumps(result))

    monkeypatch.setattr(runner, "run_benchmark", fake_run)
    json_path, chart_path = tmp_path / "out" / "bench.json", tmp_path / "bench.png"
    args = _parse(
        [
            "bench",
            "--quick",
            "--quiet",
            "--json",
            str(json_path),
            "--chart",
            str(chart_path),
            "--remat-sweep",
            "none;save:attn_out,mlp_hidden",
            "--microbatch-sweep",
            "1,4",
        ]
    )
    assert bench_cli.run_bench(args) == 0
    config = seen["config"]
    assert (config.size, config.remat_sweep, config.microbatch_sweep) == (
        "tiny",
        ("none", "save:attn_out,mlp_hidden"),
        (1, 4),
    )
    assert not config.torch_compile  # --quick leaves torch.compile off
    written = json.loads(json_path.read_text())
    assert PEAK_KEYS <= set(written["peak_gflops"]) and written["rows"] == result["rows"]
    assert chart_path.read_bytes()[:8] == PNG_SIGNATURE
    assert "leanstep_over_handwritten_time" in capsys.readouterr().out


# ---------------------------------------------------------------- PyTorch (only where installed)


def test_torch_transformer_matches_leanstep_loss_and_gradients():
    torch = pytest.importorskip("torch")
    from leanstep.bench.torch_step import (
        build_torch_model,
        load_jax_params,
        make_torch_step,
    )
    from leanstep.models import build_model

    model = build_model("transformer", "tiny", d_model=8, n_layers=2, n_heads=2, d_ff=16, seq_len=6)
    params = model.init(jax.random.key(3))
    tokens = np.random.default_rng(3).integers(0, 256, (3, 7)).astype(np.int32)
    loss, grads = jax.value_and_grad(model.loss)(params, {"tokens": jnp.asarray(tokens)})

    module = build_torch_model(model.config, remat=True)
    load_jax_params(module, params)
    torch_loss = module(torch.from_numpy(tokens.astype(np.int64)))
    torch_loss.backward()
    np.testing.assert_allclose(torch_loss.item(), float(loss), rtol=1e-5)
    np.testing.assert_allclose(
        module.blocks[1].fc.weight.grad.numpy().T, grads["blocks"]["fc_w"][1], rtol=1e-4, atol=1e-6
    )
    np.testing.assert_allclose(module.embed.weight.grad.numpy(), grads["embed"], rtol=1e-4, atol=1e-6)

    step, info = make_torch_step(module, bfloat16=True, num_microbatches=3)
    before = module.blocks[0].qkv.weight.detach().clone()
    assert math.isfinite(step(torch.from_numpy(tokens.astype(np.int64))))
    assert info["grad_scaler"] and not torch.equal(before, module.blocks[0].qkv.weight)
