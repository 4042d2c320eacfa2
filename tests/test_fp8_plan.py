"""``leanstep plan`` and ``leanstep audit`` of an FP8 run: the FP8 state sized, the FP8 operands
counted at one byte (against a count by hand), the matmuls listed with their formats and
scaling, and the cluster cost model pricing them at the accelerator's FP8 rate."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

import leanstep
from leanstep.cli.main import main
from leanstep.planning.cost_model import step_cost
from leanstep.planning.fp8_sizes import fp8_sizes
from leanstep.training import RunConfig, build_run

CONFIG = RunConfig(  # AdamW: every matmul of the step is then the model's (Muon's update adds float32 ones)
    optimizer="adamw",
    size="tiny",
    steps=2,
    batch_size=8,
    seq_len=16,
    microbatches=2,
    fp8="delayed,history=8",
    precision="compute=bfloat16",
)


@pytest.fixture(scope="module")
def traced():
    run = build_run(CONFIG)
    state = run.abstract_state()
    return run, state, run.make_step().trace(state, run.batch_spec()).jaxpr


def test_the_fp8_state_and_operands_equal_a_count_by_hand(traced):
    run, state, jaxpr = traced
    c = run.model.config
    sizes = fp8_sizes(state, jaxpr)
    # State: 4 matmuls x n_layers metas, each 3 scales (1) and 3 histories (8), float32.
    assert sizes.state_bytes == 4 * c.n_layers * (3 * 1 + 3 * 8) * 4
    # Operands: per layer and microbatch of R rows, each matmul (d_in -> d_out) reads x (R, d_in)
    # and w (d_in, d_out) forward; backward dx reads g (R, d_out) and w, dw reads g and x.
    rows = CONFIG.batch_size // CONFIG.microbatches * CONFIG.seq_len
    shapes = [(c.d_model, 3 * c.d_model), (c.d_model, c.d_model), (c.d_model, c.d_ff), (c.d_ff, c.d_model)]
    per_matmul = lambda i, o: (rows * i + i * o) + (rows * o + i * o) + (rows * o + rows * i)
    hand = CONFIG.microbatches * c.n_layers * sum(per_matmul(i, o) for i, o in shapes)
    assert sizes.operand_elements == hand
    assert sizes.matmuls == 3 * 4 and sizes.operand_width == 1  # forward and two transposes, of FP8 operands


def test_plan_notes_say_both_and_the_cli_prints_them(capsys):
    assert main(["plan", "--size", "tiny", "--fp8", "delayed,history=8", "--batch-size", "8", "--seq-len", "16",
                 "--precision", "compute=bfloat16", "--budget", "64MiB", "--remat-policies", "dots",
                 "--microbatch-counts", "2", "--no-compile-cache"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert re.search(r"note: FP8 state: [\d,]+ bytes", out)
    assert re.search(
        r"FP8 operands: \d+ FP8 matmuls a step move [\d,]+ operand elements,\s+[\d,]+\s+bytes at 1 byte", out
    )


def test_audit_lists_the_fp8_matmuls_with_their_formats_and_scaling(traced):
    run, state, _ = traced
    report = leanstep.inspection.audit(run.make_step(), state, run.batch_spec())
    fp8 = [m for m in report.matmuls if m.scale]
    assert len(fp8) == 12 and {m.scale for m in fp8} == {"delayed"}
    kinds = sorted({(m.lhs[1], m.rhs[1]) for m in fp8})
    assert kinds == [("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e4m3fn")]
    assert "(FP8, delayed scaling)" in str(report)
    plain = [m for m in report.matmuls if not m.scale]  # attention and the tied head stay bf16
    assert plain and {m.lhs[1] for m in plain} == {"bfloat16"}


def test_the_cost_model_prices_fp8_flops_at_the_fp8_rate():
    report = _no_collectives()
    h100, a100 = leanstep.planning.get_accelerator("h100"), leanstep.planning.get_accelerator("a100")
    flops = 1e15
    plain = step_cost(flops, report, {"data": 1}, h100, np.dtype("bfloat16"))
    half = step_cost(flops, report, {"data": 1}, h100, np.dtype("bfloat16"), fp8_fraction=0.5)
    assert half.compute_seconds == pytest.approx(plain.compute_seconds * (0.5 + 0.5 * 989 / 1979))
    # An accelerator without an FP8 rate (A100) runs them at its bf16 rate.
    a = step_cost(flops, report, {"data": 1}, a100, np.dtype("bfloat16"), fp8_fraction=0.5)
    assert a.compute_seconds == step_cost(flops, report, {"data": 1}, a100, np.dtype("bfloat16")).compute_seconds


def _no_collectives():
    class Empty:
        collectives = ()

    return Empty()


def test_without_fp8_the_plan_says_nothing_of_it():
    run = build_run(RunConfig(size="tiny", steps=2, batch_size=8, seq_len=16))
    state = run.abstract_state()
    assert fp8_sizes(state, run.make_step().trace(state, run.batch_spec()).jaxpr) is None
    assert not jax.tree.leaves(state.params["blocks"].get("fp8", {}))
