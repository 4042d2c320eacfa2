"""Run a test module's ``worker(out)`` in a fresh process (its own simulated devices) and read its JSON."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path


def child_env() -> dict[str, str]:
    """The environment of a child process the suite starts: the CPU platform, the suite's XLA flags
    (its fast compiles, conftest.py) but no simulated device count a parent's XLA_FLAGS may name
    (the child makes its own devices), and the suite's compilation cache."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def run_worker(script: str, out: Path, result: str, timeout: float = 600) -> dict:
    """``python script worker OUT`` in :func:`child_env`; returns ``OUT/result``."""
    env = child_env()
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
