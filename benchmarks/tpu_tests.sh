#!/usr/bin/env bash
# The accelerator selection of the suite: the ten core files, in one process.
#
# On a TPU VM, after `pip install -e ".[test]"`:   bash benchmarks/tpu_tests.sh [more pytest arguments]
# One program at a time can hold a TPU chip, so the tests run in this one process (no xdist workers);
# the tests that compare with CPU rounding compare at the chip's precision or say why they skip there.
set -euo pipefail
cd "$(dirname "$0")/.."
files=(
  tests/test_step.py tests/test_loss_scale.py tests/test_accumulation.py tests/test_clipping.py
  tests/test_lean_state.py tests/test_rounding.py tests/test_update.py tests/test_precision.py
  tests/test_fp8_quantization.py tests/test_tasks.py
)
if python -c "import xdist" 2>/dev/null; then
  serial=(-n 0)
else  # pyproject's addopts ask xdist for workers; without it, the same options less those
  serial=(-p no:xdist -o "addopts=--doctest-modules -p no:cacheprovider")
fi
exec python -m pytest -q "${serial[@]}" -m "not slow" --durations=20 "${files[@]}" "$@"
