#!/usr/bin/env bash
# leanstep on one accelerator chip, in one command (9 min 17 s on a TPU v5e, 2026-12-06):
#   pip install -e . && bash benchmarks/tpu_check.sh --out check
# the fit ladder per state format, the step's pace and MFU beside a hand-written step, the planner's
# predicted peak against the chip's, host offload; results in <out>/check.json (benchmarks/tpu_check.py).
# PYTHON names the interpreter (default: python on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m benchmarks.tpu_check "$@"
