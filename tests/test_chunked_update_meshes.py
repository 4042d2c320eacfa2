"""The chunk-bounded update on four simulated devices (data=4, fsdp=4): bit for bit the whole-tree
update over 20 steps, for every optimizer and state format of tests/test_chunked_update.py.

A file of its own so that pytest-xdist runs this child process beside that file's tests. Under
XLA's default flags 8 of the 16 cases differ by at most 2e-5 relative (data: adamw float32 and
int8, sgd_momentum float32, chain float32 and int8; fsdp: adamw, sgd_momentum and chain int8):
XLA:CPU fuses the two programs' same HLO into different kernels and LLVM contracts products and
sums into fused multiply-adds per kernel. Reproduce with
``python tests/test_chunked_update.py OUT worker`` (``OUT/worker.json``, True where identical)."""

from __future__ import annotations

import os

import pytest

from tests.test_chunked_update import FORMS, LAYOUTS, NO_FMA, _child, _optimizers


@pytest.mark.slow  # 4 simulated devices in a child process, 34 runs of 20 steps
@pytest.mark.timeout(2400)
def test_chunked_steps_are_bit_identical_on_four_devices_without_fused_multiply_adds(tmp_path):
    # Every mesh case, and the chain on one device: the chunked update computes each entry with
    # the whole tree's IEEE operations. Without FMA instructions (NO_FMA) no case differs; what
    # differs under XLA's defaults is where LLVM contracts a multiply and an add (module doc), which
    # the update's HLO cannot pin: XLA:CPU expands optimization barriers before fusion. The child
    # compiles with the suite's flags (LLVM's optimizations off) as well: every case is identical
    # there too, and it costs less (2-core EPYC, idle: 109 s and 149 CPU-s, against 139 s and 214 CPU-s at XLA's defaults).
    flags = f"{NO_FMA} {os.environ.get('XLA_FLAGS', '')}".strip()
    results = _child(tmp_path, "no_fma", timeout=2300, xla_flags=flags)
    assert len(results) == 2 + len(LAYOUTS) * len(_optimizers()) * len(FORMS), results
    assert all(value is True for value in results.values()), results
