"""MFU: a fraction of a peak that limits the row, never above 1; none, and why, where the row outruns it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leanstep.bench.utilization import describe_probe, model_flops_utilization

PROBE = describe_probe("torch_bfloat16", {"size": 512, "repeats": 5})


def test_below_the_peak_the_mfu_is_the_fraction():
    assert model_flops_utilization(46.0, 145.0, limit=PROBE) == (pytest.approx(46.0 / 145.0), None)
    assert model_flops_utilization(145.0, 145.0, limit=PROBE) == (1.0, None)
    assert model_flops_utilization(0.0, 145.0, limit=PROBE) == (0.0, None)


def test_above_the_peak_there_is_no_mfu_and_the_row_says_why():
    # The 0.1 run: a torch bf16 row at 4.55 GFLOP/s against a 1.35 GFLOP/s bf16 matmul probe read 337%.
    mfu, note = model_flops_utilization(4.55, 1.35, limit=PROBE)
    assert mfu is None
    assert note == (
        "peak meaningless: the row reaches 4.55 GFLOP/s, above the 1.35 GFLOP/s torch bf16 matmul "
        "probe (best of 5 at 512x512)"
    )


def test_no_peak_no_mfu_and_nothing_to_explain():
    assert model_flops_utilization(10.0, None, limit=PROBE) == (None, None)


@given(st.floats(0, 1e6), st.floats(1e-6, 1e6))
def test_never_above_one(achieved, peak):
    mfu, note = model_flops_utilization(achieved, peak, limit=PROBE)
    if achieved <= peak:
        assert note is None and 0 <= mfu <= 1 and mfu == achieved / peak
    else:
        assert mfu is None and note.startswith("peak meaningless")


@pytest.mark.parametrize("achieved, peak, message", [
    (-1.0, 10.0, "achieved_gflops must be a finite number >= 0, got -1.0"),
    (float("nan"), 10.0, "achieved_gflops must be a finite number >= 0, got nan"),
    (1.0, 0.0, "peak_gflops must be a number > 0 or None, got 0.0"),
])  # fmt: skip
def test_bad_numbers_are_named(achieved, peak, message):
    with pytest.raises(ValueError, match=message):
        model_flops_utilization(achieved, peak, limit=PROBE)
