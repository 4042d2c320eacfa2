r"""The clip check: clipping at half the float64 full-batch norm acts on the unscaled, accumulated gradient."""

from __future__ import annotations

import math
import time

import numpy as np

from leanstep.verification.bounds import TINY, norm_bound, unit_roundoff
from leanstep.verification.gradient_checks import full_batch_reference, precision_of, skipped_finite_batch
from leanstep.verification.report import CheckResult
from leanstep.verification.runs import Runs
from leanstep.verification.trees import worst_excess

__all__ = ["check_clip"]

#: A norm summed in a 16-bit format errs by a few of its unit roundoffs, at most about
#: sqrt(n) 2^-8 for n values that do not cancel; a norm off by more than 2^-4 is another norm.
LOW_PRECISION_NORM = 2.0**-4


def check_clip(runs: Runs, num_microbatches: int) -> CheckResult:
    r"""Clipping at half the full batch's float64 norm acts on the unscaled, accumulated gradient.

    With :math:`G` the step's own unclipped gradient and :math:`c = \|G^\star\|/2`, the clipped
    step's gradient must be :math:`G\,c/\|G\|` within the float32 norm's relative error
    (:func:`~leanstep.verification.bounds.norm_bound`) and two roundings; the reported
    ``grad_norm`` must be :math:`\|G^\star\|` within that error plus the accumulation's.
    """
    started = time.perf_counter()
    _refs, want, _magnitude, norm = full_batch_reference(runs, num_microbatches)
    count = sum(v.size for v in want.values())
    compared = "clipped at c = |G*|/2 vs G c/|G|; grad_norm vs |G| (float64)"
    if not norm > 0 or not math.isfinite(norm):
        return CheckResult("clip", "n/a", compared, 0.0, 0.0, "-", detail=f"the full-batch gradient's norm is {norm}")
    threshold = norm / 2
    unclipped = runs.step("batch", num_microbatches)
    skipped = skipped_finite_batch(
        "clip", runs, "batch", unclipped, runs.weights("batch", num_microbatches), compared, started
    )
    if skipped is not None:
        return skipped
    clipped = runs.step("batch", num_microbatches, max_grad_norm=threshold)
    own = unclipped.gradient
    own_norm = math.sqrt(math.fsum(float(np.sum(v * v)) for v in own.values()))
    factor = threshold / own_norm
    relative = norm_bound(count) + 2 * unit_roundoff("float32")
    bound = {leaf: factor * abs(v) * relative + TINY for leaf, v in own.items()}
    worst = worst_excess(clipped.gradient, {leaf: factor * v for leaf, v in own.items()}, bound)
    tolerance = f"the float32 norm's relative error over {count:,} values and two roundings ({relative:.2g})"
    elapsed = time.perf_counter() - started
    problems = []
    reported = unclipped.metrics.get("grad_norm")
    if reported is not None:
        value = float(np.asarray(reported))
        error = abs(value - own_norm) / own_norm
        if not error <= relative:
            problems.append(
                f"the reported grad_norm {value:.7g} is {error:.2g} relative off the float64 norm {own_norm:.7g} of the "
                f"gradient the step applied (allowed {relative:.2g}; the full batch's is {norm:.7g})"
            )
    if worst.ratio <= 1 and not problems:
        return CheckResult("clip", "pass", compared, worst.difference, worst.bound, tolerance, seconds=elapsed)
    diagnosis, detail = _clip_diagnosis(clipped.gradient, own, factor, relative, runs)
    where = f"{worst.leaf}[{worst.position}]" if worst.ratio > 1 else "metrics/grad_norm"
    if problems:
        detail = "; ".join([*problems, detail])
    return CheckResult(
        "clip", "fail", compared, worst.difference, worst.bound, tolerance, where, diagnosis, detail, elapsed
    )


def _clip_diagnosis(
    got: dict[str, np.ndarray], want: dict[str, np.ndarray], factor: float, relative: float, runs: Runs
) -> tuple[str, str]:
    """Names what the clip did wrong, from the factor it applied and the direction it kept."""
    names = sorted(want)
    g = np.concatenate([got[n].reshape(-1) for n in names])
    w = np.concatenate([want[n].reshape(-1) for n in names])
    applied = float(np.dot(g, w) / np.dot(w, w))
    residual = float(np.linalg.norm(g - applied * w) / max(np.linalg.norm(applied * w), 1e-300))
    detail = f"applied factor {applied:.7g}, expected {factor:.7g}; off the full-batch direction by {residual:.2g}"
    if residual > 1e-3:
        return (
            (
                "clipped before accumulation: each microbatch's gradient clipped to its own norm, so the step's "
                "gradient is not the clipped full-batch gradient"
            ),
            detail,
        )
    used = factor / applied if applied else math.inf  # the norm the clip divided by, over the gradient's
    scale = runs.metric("loss_scale")
    if scale and scale != 1 and abs(used / scale - 1) < 1e-2:
        return "clipped the scaled gradient: the norm included the loss scale (clip before unscaling)", detail
    if abs(used - 1) > LOW_PRECISION_NORM:
        return (
            (
                f"the clip divided by {used:.4g} times the gradient's norm: its norm covers other values than the "
                "gradient (as AI-Hypercomputer/maxtext#672: FP8 scales in the tree that is clipped) or leaves some out"
            ),
            detail,
        )
    if abs(used - 1) > relative:
        return (
            f"the clip used a norm {used - 1:+.2g} relative off the float32 norm of the gradient: the norm was "
            "summed in low precision (as AI-Hypercomputer/maxtext#5143: the clip's norm summed in bf16 while a "
            "float32 norm was reported)" + precision_of(abs(used - 1)),
            detail,
        )
    return "the reported gradient norm is not the norm of the gradient the step applied", detail
