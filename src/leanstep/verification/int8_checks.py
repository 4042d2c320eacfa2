r"""The int8 checks: a step whose model has int8 matmuls (:mod:`leanstep.blocks.int8`) against its variants.

.. code-block:: text

    int8_agreement     the int8 step's gradient against the same step's without int8 (the model's matmuls
                       in the compute dtype), same state, batch and M: each leaf's direction and norm
    int8_microbatches  M microbatches against one, in float32 compute: every scale a token's (or a
                       weight's) own, a token quantizes alike in any microbatch
    int8_meshes        each mesh layout against one device, in float32 compute: a scale that spans
                       devices (a weight column whose rows fsdp splits) is max-reduced over them

**Agreement.** An int8 operand is its value rounded to the nearest of 127 levels a side: off by
half a level at most, :math:`u_q = 1/254` of the largest magnitude its scale covers
(:data:`~leanstep.verification.bounds.INT8_ROUNDOFF`), as bfloat16's rounding is off by
:math:`2^{-8}` of the value. The step with and without int8 are two programs that round their
operands differently, as ``M`` microbatches and one are (``full_batch``), so each leaf may differ by
:math:`\delta = \sqrt{\max(u_q, u_c)}` of its norm (0.063): a norm ratio within :math:`1 \pm
\delta` and an angle whose sine is at most :math:`\delta`, :math:`1 - \cos \le 1 - \sqrt{1 -
\delta^2} \approx u_q / 2` (0.00197). Measured on the built-in transformer (8 rows of 16 tokens,
``M`` = 4, its worst leaf): tiny, bfloat16 compute, :math:`1 - \cos` = 5.9e-5 (``blocks/ln2_scale``),
norm ratios 0.9969-1.0019; float32 compute 4.3e-5; mini and small (``d_model`` 128, ``M`` = 2) 1.2e-4
and 1.4e-4, the worst leaves' norm ratios 0.9991-1.0017. A gradient that stops at an int8 matmul (its input
gradient quantized to zeros) leaves the leaves below it :math:`1 - \cos = 1`.

**Microbatches and meshes, in float32 compute.** In the compute dtype, ``M`` microbatches and one
differ by their own roundings (the tiny transformer in bfloat16: 0.0019 of the gradient's norm
with int8, 0.0021 without), and a quantization that depends on which rows share a microbatch
hides in that (a gradient scaled over the microbatch's rows: 0.0031). In float32 compute nothing
but float32 sums differs, so these two checks run the step's variant in float32 compute
(:meth:`LeanstepStep.variant`) and hold it to the float32 sum's tolerance, as the gradient checks
do: ``M`` = 4 against 1, 8.9e-8 of :math:`\|G\|` against :math:`2^{-14}` (the scale over the
microbatch's rows: 6.9e-4); ``data=2``, ``fsdp=2`` and ``data=1,tensor=2`` against one device,
7.2e-8 against the meshes check's float32 bound (a weight's column scale from each device's rows:
0.058). ``weight_grad="int8"`` quantizes the weight gradients by the microbatch's (a device's)
rows by design (5.8e-4 of :math:`\|G\|`, tiny, ``M`` = 4 against 1): these checks run its weight
gradients in float32, every other product as the recipe says, and leave the int8 weight gradients
to ``int8_agreement``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np

from leanstep.blocks.int8 import Int8Recipe
from leanstep.verification.bounds import INT8_ROUNDOFF, LAMBDA, unit_roundoff
from leanstep.verification.gradient_checks import SUM_TOLERANCE, relative_error
from leanstep.verification.mesh_check import layout_meshes
from leanstep.verification.report import CheckResult
from leanstep.verification.runs import Outcome, Runs

__all__ = ["check_int8_agreement", "check_int8_meshes", "check_int8_microbatches"]

#: The microbatch or device dependence the float32 checks name: a scale over more than a token's own values.
SHARED_SCALE = (
    "a scale computed over the microbatch's rows (not each token's own) or carried from one microbatch into "
    "another's product: the int8 step's gradient depends on how the batch is cut into microbatches"
)
NOT_MAX_REDUCED = (
    "an int8 scale that spans devices taken from each device's own shard, not max-reduced over them (no pmax): "
    "a weight column whose rows fsdp splits dequantized by the local amax, so the result depends on the layout"
)


def _not_applicable(name: str, runs: Runs, compared: str) -> CheckResult | None:
    """The n/a result where the setup has no int8 recipe, or no variants to compare with."""
    if getattr(runs.setup, "int8", None) is None:
        detail = "the step has no int8 matmuls (an int8 recipe: int8='on', --int8 on)"
    elif not callable(getattr(runs.setup, "variant", None)):
        detail = "the step offers no variant(int8=None, compute_dtype=...): the same step to compare it with"
    else:
        return None
    return CheckResult(name, "n/a", compared, 0.0, 0.0, "-", detail=detail)


def _per_token(runs: Runs) -> tuple[Runs, str]:
    """The runs of the step in float32 compute, its weight gradients in float32 (every scale a token's or a
    weight's own), and how they differ from the step's: these runs where they are the step's."""
    recipe = getattr(runs.setup, "int8", None)
    changes: dict[str, Any] = {}
    if np.dtype(runs.setup.compute_dtype or "float32") != np.float32:
        changes["compute_dtype"] = "float32"
    if isinstance(recipe, Int8Recipe) and recipe.weight_grad != "compute":
        changes["int8"] = dataclasses.replace(recipe, weight_grad="compute")
    if not changes:
        return runs, "the int8 step"
    weights = ", its weight gradients in float32 (int8_agreement holds weight_grad=int8's)" if "int8" in changes else ""
    return runs.variant(**changes), f"the int8 step in float32 compute{weights}"


def _direction_and_norm(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """``(1 - cos, |got| / |want|)``: 0 and 1 for two zeros, 1 and inf (or 0) where one is zero."""
    a, b = float(np.linalg.norm(got)), float(np.linalg.norm(want))
    if a == 0 or b == 0:
        return (0.0, 1.0) if a == b else (1.0, a / b if b else math.inf)
    cos = float(np.dot(got.reshape(-1), want.reshape(-1))) / (a * b)
    return (1.0 - cos if math.isfinite(cos) else math.inf), a / b


def _skipped(name: str, outcome: Outcome, compared: str, started: float) -> CheckResult | None:
    if not bool(np.asarray(outcome.metrics.get("skipped", False))):
        return None
    return CheckResult(
        name, "fail", compared, math.inf, 0.0, "-", "metrics/skipped",
        "the int8 step skipped a batch whose values are all finite (a non-finite scale: an all-zero slice, an "
        "overflowed product)", seconds=time.perf_counter() - started,
    )  # fmt: skip


def check_int8_agreement(runs: Runs, num_microbatches: int) -> CheckResult:
    """Each leaf of the int8 step's gradient against the step's without int8: direction and norm (module doc)."""
    started = time.perf_counter()
    dtype = np.dtype(runs.rounding_dtype).name
    compared = f"G int8 vs G without int8 (matmuls in {dtype}), M={num_microbatches}, per leaf: 1 - cos"
    missing = _not_applicable("int8_agreement", runs, compared)
    if missing is not None:
        return missing
    got = runs.step("batch", num_microbatches)
    skipped = _skipped("int8_agreement", got, compared, started)
    if skipped is not None:
        return skipped
    plain = runs.variant(int8=None).step("batch", num_microbatches).gradient
    delta = math.sqrt(max(INT8_ROUNDOFF, unit_roundoff(runs.rounding_dtype)))
    bound = 1 - math.sqrt(1 - delta**2)
    leaves = {leaf: _direction_and_norm(got.gradient[leaf], want) for leaf, want in plain.items()}
    whole = [np.concatenate([t[leaf].reshape(-1) for leaf in plain]) for t in (got.gradient, plain)]
    leaves["(all leaves)"] = _direction_and_norm(*whole)
    ratios = [ratio for _, ratio in leaves.values()]
    compared += f"; |G int8| / |G| {min(ratios):.4f} to {max(ratios):.4f}"
    tolerance = (
        f"|G int8 - G| <= delta |G| a leaf, delta = sqrt(max(1/254, u of {dtype})) = {delta:.3g}: 1 - cos <= "
        f"1 - sqrt(1 - delta^2) = {bound:.3g}, norm ratio within 1 +- {delta:.3g}"
    )
    worst = max(leaves, key=lambda leaf: max(leaves[leaf][0] / bound, abs(leaves[leaf][1] - 1) / delta))
    direction, ratio = leaves[worst]
    largest = max(d for d, _ in leaves.values())
    elapsed = time.perf_counter() - started
    if direction <= bound and abs(ratio - 1) <= delta:
        detail = f"the worst leaf: {max(leaves, key=lambda leaf: leaves[leaf][0])}"
        return CheckResult(
            "int8_agreement", "pass", compared, largest, bound, tolerance, detail=detail, seconds=elapsed
        )
    where = f"{worst}: 1 - cos {direction:.3g}, norm ratio {ratio:.4g}"
    if ratio < delta:
        diagnosis = (
            "the int8 step's gradient vanishes below an int8 matmul: its input gradient quantized to zeros by a scale "
            "not computed from the gradient it quantizes (taken from the loss-scaled gradient and applied to the "
            "unscaled one), so nothing flows past it"
        )
    elif direction <= bound:
        diagnosis = (
            f"the int8 step's gradient is {ratio:.4g} times the step's without int8: a dequantization scale applied "
            "twice, left out or off by a factor"
        )
    else:
        diagnosis = (
            "the int8 step's gradient points elsewhere than the step's without int8: int8 values that saturate or "
            "collapse (a scale not computed from the tensor it quantizes)"
        )
    return CheckResult("int8_agreement", "fail", compared, largest, bound, tolerance, where, diagnosis, seconds=elapsed)


def check_int8_microbatches(runs: Runs, num_microbatches: int) -> CheckResult:
    """M microbatches against one, the int8 step in float32 compute (module doc)."""
    started = time.perf_counter()
    compared = f"G (M={num_microbatches}) vs G (M=1)"
    missing = _not_applicable("int8_microbatches", runs, compared)
    if missing is not None:
        return missing
    if getattr(runs.setup, "keyed_by_shape", False):
        detail = "the loss draws its random numbers by the microbatch's shape: one microbatch is not M by design"
        return CheckResult("int8_microbatches", "n/a", compared, 0.0, 0.0, "-", detail=detail)
    exact, which = _per_token(runs)
    compared += f", {which}"
    tolerance = "2^-14 of |G|: every scale a token's or a weight's own, so only float32 sums differ"
    many, one = exact.step("batch", num_microbatches), exact.step("batch", 1)
    magnitude = {leaf: np.abs(v) for leaf, v in one.gradient.items()}
    error, leaf_errors = relative_error(many.gradient, one.gradient, magnitude)
    elapsed = time.perf_counter() - started
    if error <= SUM_TOLERANCE:
        return CheckResult("int8_microbatches", "pass", compared, error, SUM_TOLERANCE, tolerance, seconds=elapsed)
    if exact.has_model_state():
        detail = "the model carries state (batch statistics): M microbatches need not be one (the accumulation check)"
        return CheckResult("int8_microbatches", "n/a", compared, error, SUM_TOLERANCE, tolerance, detail=detail)
    leaf = max(leaf_errors, key=leaf_errors.__getitem__)
    where = f"{leaf} (its relative error {leaf_errors[leaf]:.2g})"
    return CheckResult(
        "int8_microbatches", "fail", compared, error, SUM_TOLERANCE, tolerance, where, SHARED_SCALE, seconds=elapsed
    )


def check_int8_meshes(runs: Runs, num_microbatches: int) -> CheckResult:
    """Each mesh layout against one device, the int8 step in float32 compute (module doc)."""
    started = time.perf_counter()
    names = [layout if isinstance(layout, str) else str(dict(layout.shape)) for layout in runs.layouts]
    compared = f"{'; '.join(names) or 'no layout'} vs one device"
    missing = _not_applicable("int8_meshes", runs, compared)
    if missing is not None:
        return missing
    if not runs.layouts:
        return CheckResult("int8_meshes", "n/a", compared, 0.0, 0.0, "-", detail="no mesh layout given (--devices N)")
    exact, which = _per_token(runs)
    compared += f", {which}"
    try:
        meshes = layout_meshes(exact)
    except ValueError as refused:
        return CheckResult("int8_meshes", "n/a", compared, 0.0, 0.0, "-", detail=str(refused))
    one = exact.step("batch", num_microbatches)
    magnitude = {leaf: np.abs(v) for leaf, v in one.gradient.items()}
    allowed = max(SUM_TOLERANCE, LAMBDA * math.sqrt(max(m.size for m in meshes) + 1) * unit_roundoff("float32"))
    tolerance = (
        f"max(2^-14, lambda sqrt(N + 1) u) = {allowed:.2g} of |G|, the meshes check's in float32: a scale that spans "
        "devices is their max, so each device quantizes as one device does"
    )
    largest, where = 0.0, None
    for name, mesh in zip(names, meshes, strict=True):
        got = exact.step("batch", num_microbatches, mesh=mesh)
        error, leaf_errors = relative_error(got.gradient, one.gradient, magnitude)
        largest = max(largest, error)
        if where is None and error > allowed:
            leaf = max(leaf_errors, key=leaf_errors.__getitem__)
            where = f"{name}: {leaf} (its relative error {leaf_errors[leaf]:.2g})"
    elapsed = time.perf_counter() - started
    if where is None:
        return CheckResult("int8_meshes", "pass", compared, largest, allowed, tolerance, seconds=elapsed)
    return CheckResult(
        "int8_meshes", "fail", compared, largest, allowed, tolerance, where, NOT_MAX_REDUCED, seconds=elapsed
    )
