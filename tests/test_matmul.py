"""The matmul peak: best of N (the fastest call) at the best size, on a scripted clock (no real timing)."""

from __future__ import annotations

import pytest

from leanstep.bench.matmul import measure_matmul_gflops


class ScriptedMatmul:
    """A fake ``make`` and its clock: each call of an ``n x n`` "matmul" advances the clock.

    ``times[n]`` scripts the calls at size ``n`` (the first is the untimed warm-up); a size
    without a script takes ``2 n^3 / rate`` seconds.
    """

    def __init__(self, times=None, rate_gflops=100.0):
        self.now, self.rate = 0.0, rate_gflops
        self.times = {size: list(script) for size, script in (times or {}).items()}
        self.made = []

    def clock(self):
        return self.now

    def make(self, size, dtype):
        self.made.append(size)

        def run():
            script = self.times.get(size)
            self.now += script.pop(0) if script else 2.0 * size**3 / (self.rate * 1e9)

        return run


def test_the_fastest_call_at_the_best_size_is_the_peak():
    # The warm-up call (1 s) and then 3 timed calls at each size: 1024's fastest, 0.01 s (214.7 GFLOP/s), beats
    # 2048's fastest, 0.1 s (171.8); neither the first timed call nor the median (0.02 s) is what counts.
    fake = ScriptedMatmul({1024: [1.0, 0.03, 0.01, 0.02], 2048: [1.0, 0.2, 0.1, 0.3]})
    result = measure_matmul_gflops(fake.make, "float32", max_size=2048, repeats=3, clock=fake.clock)
    assert result["size"] == 1024 and result["repeats"] == 3
    assert result["seconds_best"] == pytest.approx(0.01) and result["seconds_median"] == pytest.approx(0.02)
    assert result["gflops"] == pytest.approx(2 * 1024**3 / 0.01 / 1e9)  # 214.748...
    assert result["gflops_median"] == pytest.approx(2 * 1024**3 / 0.02 / 1e9)
    by_size = {entry["size"]: entry for entry in result["by_size"]}
    assert set(by_size) == {1024, 2048} and result["skipped_sizes"] == []
    assert by_size[2048]["gflops"] == pytest.approx(2 * 2048**3 / 0.1 / 1e9)  # 171.798...
    assert fake.made == [256, 512, 1024, 2048]  # the probe doubles up to below the first large size


def test_every_large_size_up_to_max_size_is_tried():
    fake = ScriptedMatmul(rate_gflops=100.0)
    result = measure_matmul_gflops(fake.make, "float32", repeats=2, clock=fake.clock, max_call_s=10.0)
    assert [entry["size"] for entry in result["by_size"]] == [1024, 2048, 3072, 4096]
    assert result["gflops"] == pytest.approx(100.0)


def test_a_slow_dtype_is_measured_at_the_largest_probe_size_that_fits_the_call_cap():
    # 1 GFLOP/s: 256 takes 0.034 s, 512 0.27 s, 1024 would take 2.1 s > max_call_s.
    fake = ScriptedMatmul(rate_gflops=1.0)
    result = measure_matmul_gflops(fake.make, "bfloat16", repeats=2, max_call_s=1.0, clock=fake.clock)
    assert result["size"] == 512 and result["gflops"] == pytest.approx(1.0)
    assert result["skipped_sizes"] == [1024, 2048, 3072, 4096]
    assert max(fake.made) == 512


def test_max_seconds_leaves_out_the_sizes_that_would_not_fit_but_measures_one():
    # 100 GFLOP/s: about 0.78 s spent by the end of 2048; 4096 would take 4 calls x 1.37 s.
    fake = ScriptedMatmul(rate_gflops=100.0)
    result = measure_matmul_gflops(
        fake.make, "float32", sizes=(1024, 2048, 4096), repeats=3, max_call_s=10.0, max_seconds=2.0, clock=fake.clock
    )
    assert [entry["size"] for entry in result["by_size"]] == [1024, 2048] and result["skipped_sizes"] == [4096]
    tiny = measure_matmul_gflops(fake.make, "float32", repeats=3, max_seconds=1e-9, clock=fake.clock)
    assert [entry["size"] for entry in tiny["by_size"]] == [1024]


def test_max_size_below_every_large_size_is_measured_itself():
    fake = ScriptedMatmul(rate_gflops=50.0)
    result = measure_matmul_gflops(fake.make, "float32", max_size=128, repeats=2, clock=fake.clock)
    assert result["size"] == 128 and fake.made == [128]  # the probe is the size: made once
    assert result["gflops"] == pytest.approx(50.0)


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "float16"}, "dtype must be 'float32' or 'bfloat16', got 'float16'"),
    ({"repeats": 0}, "repeats must be an integer >= 1, got 0"),
    ({"max_size": 1.5}, "max_size must be an integer >= 1, got 1.5"),
    ({"sizes": ()}, "sizes must be integers >= 1, got ()"),
    ({"max_seconds": 0}, "max_seconds must be a number > 0, got 0"),
    ({"max_call_s": -1.0}, "max_call_s must be a number > 0, got -1.0"),
])  # fmt: skip
def test_bad_arguments_are_named(kwargs, message):
    fake = ScriptedMatmul()
    arguments = {"dtype": "float32", **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        measure_matmul_gflops(fake.make, arguments.pop("dtype"), clock=fake.clock, **arguments)
