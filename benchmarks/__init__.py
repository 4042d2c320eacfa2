"""Research benchmarks of leanstep, outside the wheel: run each from the repository root.

.. code-block:: text

    python -m benchmarks.step_profile   where a train step's time goes: matmuls at their standalone speed, the rest
    python -m benchmarks.step_pace      leanstep's step and the PyTorch peer's, timed in turn (needs torch)
    python -m benchmarks.scaling        per-device memory and bytes of the sharded step, 8 simulated devices
    python -m benchmarks.cnn            what the microbatch loop costs a convolutional network (needs flax)

and, as functions, :func:`benchmarks.plan_check.validate_plan` and
:func:`benchmarks.plan_check.time_candidates` (is the plan right?), :mod:`benchmarks.hlo_matmuls`
(every matmul of a compiled program) and :mod:`benchmarks.step_trace` (each kernel's time inside
it). They use leanstep's public API and its sub-package modules only; ``leanstep bench`` needs none
of them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["ROOT", "child_env", "print_result"]

#: The folder that holds this package (the repository root): a child process imports ``benchmarks`` from it.
ROOT = Path(__file__).resolve().parent.parent


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with :data:`ROOT` first on ``PYTHONPATH``, for a child process that imports ``benchmarks``.

    Example:
      >>> child_env({"PYTHONPATH": "/elsewhere"})["PYTHONPATH"] == os.pathsep.join([str(ROOT), "/elsewhere"])
      True
    """
    paths = [str(ROOT), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def print_result(result: object, json_path: str | None, *, indent: int = 2) -> int:
    """Prints ``result`` as JSON and, given ``json_path`` (a benchmark's ``--json``), writes it there too; returns 0.

    Example:
      >>> print_result({"ratio": 1.0}, None)
      {
        "ratio": 1.0
      }
      0
    """
    text = json.dumps(result, indent=indent)
    if json_path:
        Path(json_path).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0
