"""The step profile (benchmarks.step_profile) and the HLO matmul list it reads (hlo_matmuls).

The dot list of a compiled tiny-transformer step is checked against a count made by hand from
the model's shapes; timing is never asserted.
"""

import math

import jax
import jax.numpy as jnp
import pytest

from benchmarks.hlo_matmuls import list_loops, list_matmuls, standalone_matmul
from benchmarks.step_profile import config_from_args, format_profile, profile_step
from leanstep.training.config import RunConfig

FLOAT32 = "params=float32,compute=float32,output=float32"
# Three layers and two microbatches, so the layer loops and the microbatch loop differ in trip count.
# AdamW: the count by hand is the model's matmuls (Muon's update adds its Newton-Schulz products).
CONFIG = RunConfig(
    size="tiny", batch_size=4, seq_len=16, microbatches=2, steps=10, n_layers=3, precision=FLOAT32, optimizer="adamw"
)
D, LAYERS, HEADS, D_FF, VOCAB = 16, 3, 2, 32, 256  # the tiny preset, with n_layers=3


@pytest.fixture(scope="module")
def profile():
    return profile_step(CONFIG, repeats=1, peak_size=256, min_call_s=0.005)


def hand_counted_flops_and_dots():
    """FLOPs and dot executions of one step, from the shapes: no remat recomputation under "dots"."""
    rows = CONFIG.batch_size // CONFIG.microbatches
    tokens, time, head_dim = rows * CONFIG.seq_len, CONFIG.seq_len, D // HEADS
    block = (
        2 * tokens * D * 3 * D  # QKV
        + 2 * tokens * D * D  # output projection
        + 2 * tokens * D * D_FF
        + 2 * tokens * D_FF * D  # the MLP's two matmuls
        + 2 * (2 * rows * HEADS * time * time * head_dim)
    )  # Q K^T and P V
    head = 2 * tokens * D * VOCAB  # logits = h @ embed.T
    # Backward: each forward matmul has two (the gradients of both operands), each as big.
    flops = CONFIG.microbatches * 3 * (LAYERS * block + head)
    dots = CONFIG.microbatches * 3 * (LAYERS * 6 + 1)
    return flops, dots


def test_dot_flops_match_a_count_by_hand(profile):
    flops, dots = hand_counted_flops_and_dots()
    assert profile["hlo_matmul_flops"] == flops
    assert sum(row["count"] for row in profile["matmuls"]) == dots
    assert sum(row["flops_total"] for row in profile["matmuls"]) == flops
    # Measured: the profiler saw each of them run, once per execution, inside the step.
    assert profile["trace"]["matmul_kernels"] == dots
    # With nothing recomputed, the HLO's matmuls are what the analytic count says (6N + 12LTd).
    assert profile["model_flops"] == flops


def test_every_dot_has_its_shapes_and_fusion(profile):
    for row in profile["matmuls"]:
        contracting, lhs_dims = row["dimension_numbers"][0], row["lhs"][1]
        assert row["flops_each"] == 2 * math.prod(row["result"][1]) * math.prod(lhs_dims[d] for d in contracting)
        assert row["fusion_kinds"] and row["standalone_kinds"]
    tokens = CONFIG.batch_size // CONFIG.microbatches * CONFIG.seq_len
    assert {row["lhs"][1] for row in profile["matmuls"]} >= {(tokens, D), (tokens, VOCAB)}


def test_trip_counts_of_the_layer_and_microbatch_loops_are_found(profile):
    loops = profile["loops"]
    assert sorted(loop["trip_count"] for loop in loops) == [CONFIG.microbatches, LAYERS, LAYERS]
    # The two layer scans (forward, backward) run once per microbatch.
    assert sorted(loop["runs"] for loop in loops if loop["trip_count"] == LAYERS) == [CONFIG.microbatches] * 2
    assert profile["executed_ops"] >= sum(row["count"] for row in profile["matmuls"])


def test_the_report_adds_up(profile):
    p = profile
    assert p["matmul_s"] == pytest.approx(sum(row["seconds_total"] for row in p["matmuls"]))
    assert p["matmul_s"] + p["rest_s"] == pytest.approx(p["step_s"])
    assert p["step_s"] <= p["step_s_median"]
    tokens = CONFIG.batch_size * CONFIG.seq_len
    assert p["model_gflops"] == pytest.approx(p["model_flops"] / p["step_s"] / 1e9)
    assert p["mfu"] == pytest.approx(p["model_gflops"] / p["peak_gflops"])
    assert p["mfu_ceiling"] == pytest.approx(p["model_flops"] / p["matmul_s"] / 1e9 / p["peak_gflops"])
    assert p["matmul_gflops"] == pytest.approx(p["hlo_matmul_flops"] / p["matmul_s"] / 1e9)
    assert p["backward_s"] == pytest.approx(p["gradients_s"] - p["forward_s"])
    assert p["unaccounted_s"] == pytest.approx(p["step_s"] - p["gradients_s"] - p["update_s"])
    assert p["config"]["n_layers"] == LAYERS and p["config"]["precision"] == FLOAT32
    assert p["model_flops"] / tokens == 6 * (LAYERS * (4 * D * D + 2 * D * D_FF) + VOCAB * D) + 12 * LAYERS * 16 * D
    trace = p["trace"]
    assert trace["kernel_s"] == pytest.approx(trace["matmul_s"] + trace["other_s"])
    assert trace["kernel_s"] == pytest.approx(sum(group["seconds"] for group in trace["groups"]))
    assert trace["kernels"] == pytest.approx(sum(group["kernels"] for group in trace["groups"]))
    assert {group["phase"] for group in trace["groups"]} >= {"forward", "backward", "update"}
    table = format_profile(p).splitlines()
    assert table[2 + len(p["matmuls"])] == "" and table[2 + len(p["matmuls"]) + 10].startswith("ceiling")
    assert table[-len(trace["groups"][:12]) - 6] == "" and "XLA:CPU profiler" in table[-len(trace["groups"][:12]) - 5]


def test_a_convolution_is_listed_and_rebuilt_standalone():
    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x, w, (2, 2), ((1, 1), (0, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2
        )

    x, w = jnp.ones((2, 9, 8, 4)), jnp.ones((3, 3, 2, 6))
    (op,) = list_matmuls(jax.jit(conv).lower(x, w).compile().as_text())
    out = jax.eval_shape(conv, x, w).shape  # (2, 5, 4, 6)
    assert op.op == "convolution" and op.trips == 1
    assert op.flops == 2 * math.prod(out) * 3 * 3 * (4 // 2)
    fn, args = standalone_matmul(op)
    assert fn(*args, 2).shape == op.result[1]


def test_a_dot_rebuilt_standalone_computes_the_same_product():
    def f(a, b):
        return jnp.einsum("bij,bkj->bik", a, b)

    a, b = jnp.ones((3, 4, 5)), jnp.ones((3, 2, 5))
    (op,) = list_matmuls(jax.jit(f).lower(a, b).compile().as_text())
    fn, (lhs, rhs) = standalone_matmul(op)
    assert op.lhs[1] == lhs.shape and op.rhs[1] == rhs.shape
    expected = jax.lax.dot_general(lhs, rhs, ((op.dimension_numbers[:2]), op.dimension_numbers[2:]))
    assert jnp.allclose(fn(lhs, rhs, 3), expected)


def test_a_scan_of_unknown_length_has_no_trip_count():
    def f(x, n):
        return jax.lax.fori_loop(0, n, lambda i, c: jnp.sin(c), x)

    (loop,) = list_loops(jax.jit(f).lower(jnp.ones(3), 4).compile().as_text())
    assert loop.trip_count is None and loop.runs == 1 and loop.source == "while"


def test_the_command_line_builds_a_float32_config():
    config, args = config_from_args(["--d-model", "256", "--d-ff", "1024", "--repeats", "3"])
    assert (config.d_model, config.d_ff, config.precision, args.repeats) == (256, 1024, FLOAT32, 3)
    assert config.batch_size == RunConfig().batch_size and config.validate() is config
