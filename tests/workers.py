"""Run a test module's ``worker(out)`` in a fresh process (its own simulated devices) and read its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_worker(script: str, out: Path, result: str, timeout: float = 600) -> dict:
    """``python script worker OUT`` with the CPU platform and no inherited XLA flags; returns ``OUT/result``."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, script, "worker", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads((out / result).read_text())
