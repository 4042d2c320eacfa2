"""The program checks: the compute dtype reaches every matmul; the remat policy saves what it says.

Both read the traced step (:func:`leanstep.inspection.audit`; nothing runs):

.. code-block:: text

    compute_dtype   every dot_general and convolution takes operands of the compute dtype (FP8
                    matmuls their FP8 formats, int8 products int8): a float32 operand under a bfloat16 policy is a
                    framework layer built with dtype=float32, or a float32 input, undoing it
    remat           every remat region has the policy, and one microbatch's loss saves fewer
                    residual bytes under it than without remat (with "save:NAMES": only those names)
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from leanstep.inspection.auditing import audit
from leanstep.inspection.residuals import saved_residuals_report
from leanstep.planning.plan_inputs import structure_error
from leanstep.verification.report import CheckResult
from leanstep.verification.runs import Runs
from leanstep.verification.trees import on_arrays

__all__ = ["check_compute_dtype", "check_remat"]


def _dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def _int8(matmul: Any) -> bool:
    """An int8 x int8 product (:func:`leanstep.blocks.int8.int8_matmul`): quantized on purpose, as FP8's are."""
    return matmul.lhs[1] == matmul.rhs[1] == "int8"


def _audit_step(runs: Runs, num_microbatches: int) -> Any:
    """The audit of one step from the settled state (its array leaves traced, the rest closed over)."""

    def arrays_after(state: Any, batch: Any) -> list[Any]:
        after = runs.setup.step(state, batch, num_microbatches)[0]
        return [leaf for leaf in jax.tree.leaves(after) if isinstance(leaf, jax.Array)]

    step, arrays = on_arrays(arrays_after, runs.state())
    return audit(step, arrays, runs.batches["batch"])


def check_compute_dtype(runs: Runs, num_microbatches: int) -> CheckResult:
    """Every matmul of the traced step runs in the setup's compute dtype (FP8 matmuls in FP8)."""
    started = time.perf_counter()
    setup = runs.setup
    compared = "every matmul's operand dtypes vs the compute dtype"
    if getattr(setup, "compute_dtype", None) is None:
        return CheckResult("compute_dtype", "n/a", compared, 0.0, 0.0, "-", detail="the setup names no compute dtype")
    want = _dtype_name(setup.compute_dtype)
    report = _audit_step(runs, num_microbatches)
    elapsed = time.perf_counter() - started
    matmuls = report.matmuls
    wrong = [m for m in matmuls if not m.scale and not _int8(m) and (m.lhs[1] != want or m.rhs[1] != want)]
    int8 = sum(map(_int8, matmuls))
    tolerance = f"all {len(matmuls)} matmuls in {want}" + (f" ({int8} int8 products in int8)" if int8 else "")
    if not matmuls:
        return CheckResult("compute_dtype", "n/a", compared, 0.0, 0.0, "-", detail="the traced step has no matmul")
    if not wrong:
        return CheckResult("compute_dtype", "pass", compared, 0.0, 0.0, tolerance, seconds=elapsed)
    first = wrong[0]
    flops = sum(m.flops for m in wrong) / max(sum(m.flops for m in matmuls), 1.0)
    where = (
        f"{first.kind} {first.lhs[1]}{list(first.lhs[0])} x {first.rhs[1]}{list(first.rhs[0])} at {first.path}; "
        f"{len(wrong)} of {len(matmuls)} matmuls, {100 * flops:.0f}% of the FLOPs"
    )
    diagnosis = (
        f"matmuls run in {first.lhs[1] if first.lhs[1] != want else first.rhs[1]}, not the compute dtype {want}: a "
        "framework layer built with dtype=float32 (or param_dtype promoting), or a float32 input or constant, "
        "undoes the policy"
    )
    return CheckResult(
        "compute_dtype", "fail", compared, float(len(wrong)), 0.0, tolerance, where, diagnosis, seconds=elapsed
    )


def check_remat(runs: Runs, num_microbatches: int) -> CheckResult:
    """The remat regions carry the setup's policy, and it saves less than no remat."""
    started = time.perf_counter()
    setup = runs.setup
    policy = getattr(setup, "remat", None)
    compared = "remat regions' policy; saved residual bytes vs no remat"
    if policy is None or policy == "none" or not hasattr(setup, "microbatch_loss"):
        return CheckResult("remat", "n/a", compared, 0.0, 0.0, "-", detail=f"remat policy {policy!r}")
    report = _audit_step(runs, num_microbatches)
    problems = report.remat_violations(policy)
    fn, args = setup.microbatch_loss(policy)
    saved = saved_residuals_report(fn, *args)
    plain_fn, plain_args = setup.microbatch_loss("none")
    try:
        plain = saved_residuals_report(plain_fn, *plain_args)
    except (TypeError, ValueError, KeyError) as error:
        refused = structure_error(error, "none", getattr(setup, "given", None))
        if refused is None:
            raise
        # The trees given are the remat'd model's: every other check runs; this one says what plan would.
        return CheckResult(
            "remat", "n/a", compared, 0.0, 0.0, "-", seconds=time.perf_counter() - started, detail=str(refused)
        )
    if policy.startswith("save:"):
        wanted = set(policy[len("save:") :].split(","))
        extra = sorted({e.name for e in saved.entries if e.kind == "named" and e.name is not None} - wanted)
        if extra:
            problems.append(f"saves values named {extra}, not among {sorted(wanted)}")
    if not saved.total_bytes < plain.total_bytes:
        problems.append(f"saves {saved.total_bytes:,} bytes, no fewer than without remat ({plain.total_bytes:,})")
    elapsed = time.perf_counter() - started
    tolerance = f"saved bytes under {policy!r} < without remat"
    largest, bound = float(saved.total_bytes), float(plain.total_bytes)
    if not problems:
        detail = f"{saved.total_bytes:,} residual bytes a microbatch, against {plain.total_bytes:,} without remat"
        return CheckResult("remat", "pass", compared, largest, bound, tolerance, detail=detail, seconds=elapsed)
    diagnosis = "the remat policy does not save what it says: " + "; ".join(problems)
    return CheckResult("remat", "fail", compared, largest, bound, tolerance, problems[0], diagnosis, seconds=elapsed)
