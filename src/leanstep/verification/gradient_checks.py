r"""The gradient checks: accumulation, M against one, token weighting and clipping, against float64 references.

The reference of a step over ``M`` microbatches is each microbatch alone, through the step's own
program (:func:`microbatch_references`): its gradients :math:`g_j`, combined in float64,

.. math:: G^\star = \sum_j w_j\, g_j, \qquad w_j = \frac{1}{M} \text{ (a mean loss)}, \quad
          w_j = \frac{c_j}{\sum_k c_k} \text{ (a token-weighted loss, } c_j \text{ tokens)}

is the full batch's gradient. The step and its references compute every :math:`g_j` with one
program and add them in float32, in whatever order XLA chooses (it may add a parameter's partial
gradients, a tied embedding's or a scatter's, into the accumulator one by one), so the difference
allowed is a float32 sum's, normwise (:data:`SUM_TOLERANCE`):

.. math:: \|G - G^\star\| \le 2^{-14}\, \Big\|\sum_j |w_j\, g_j|\Big\|.

A sum kept in bfloat16 misses that bound by about :math:`2^{5}`; a microbatch given the wrong
weight by the weight's error. On a failure the report fits the weights the step did use (least
squares, :math:`\hat w = \arg\min \|G - \sum_j \hat w_j g_j\|`) and names the microbatch whose
weight is furthest from :math:`w_j`, or, every weight right, the sum's precision.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import numpy as np

from leanstep.verification.batches import batch_rows, microbatch_rows, rows_of, uneven_mask
from leanstep.verification.bounds import TINY, norm_bound, unit_roundoff
from leanstep.verification.report import CheckResult
from leanstep.verification.runs import Outcome, Runs
from leanstep.verification.trees import worst_excess

__all__ = [
    "check_accumulation",
    "check_clip",
    "check_token_weighting",
    "clip_threshold",
    "microbatch_references",
    "reference",
]

#: The named bug of a sum that has every microbatch's weight but not float32's precision.
LOW_PRECISION_SUM = (
    "gradients accumulated in a low-precision dtype, not float32 (as deepspeedai/DeepSpeed#1800: ZeRO summing "
    "bf16 gradients in bf16)"
)

#: The largest relative error (2-norm over the whole gradient, against the norm of
#: ``sum_j |w_j g_j|``) of a float32 sum. A sum kept in bfloat16 or float16 rounds every partial
#: sum to 8 or 11 bits, an error of about u_16 / sqrt(3) >= 2^-12 relative; a float32 sum errs by
#: about sqrt(k) 2^-24 over k partial sums (Higham and Mary), below 2^-14 until k passes 2^19
#: even where they cancel 2^-5 of their magnitude. XLA may add a parameter's partial gradients
#: (a tied embedding's, a scatter's) into the accumulator in any order, so the bound cannot be
#: elementwise over microbatch gradients alone.
SUM_TOLERANCE = 2.0**-14

#: A norm summed in a 16-bit format errs by a few of its unit roundoffs, at most about
#: sqrt(n) 2^-8 for n values that do not cancel; a norm off by more than 2^-4 is another norm.
LOW_PRECISION_NORM = 2.0**-4

#: The weights a step used are "right" within this relative distance. Rounding moves a fitted
#: weight by about the unit roundoff of the sum's format (bfloat16: 2^-8 = 0.4%); the bugs this
#: separates from move it by a microbatch's share of the batch, 1/M or more of it (a microbatch
#: left out, the last one kept, 1/M in place of c_j / sum c).
WEIGHT_TOLERANCE = 2.0**-5


def microbatch_references(
    runs: Runs, batch: str, num_microbatches: int, *, chained: bool | None = None, **settings: Any
) -> list[Outcome]:
    """Each microbatch of the named batch alone: its rows in every microbatch, through the same program.

    The step's own ``M``-microbatch program computes microbatch ``j``'s gradient ``M`` times
    over and averages them: ``r_j = fl(sum of M copies of g_j) / M``, within ``gamma_M`` of
    ``g_j``, the very value (bit for bit) the program computes for microbatch ``j`` of the
    real batch. A program compiled for one microbatch could round differently (XLA fuses
    and contracts per program), and a sum that is wrong is wrong for both alike.

    A model whose gradient reads its own state (EMA batch norm, a counter) sees a different
    state in each copy; for it (``chained``, default: :meth:`Runs.reads_model_state`) the
    references are the one-microbatch program run on each microbatch in turn, each from the
    state the one before left (:meth:`Runs.chain`).
    """
    if chained is None:
        chained = runs.reads_model_state() and batch in ("batch", "uneven") and not settings
    if chained:
        return runs.chain(batch, num_microbatches)
    source = runs.batches[batch]
    rows = microbatch_rows(batch_rows(source), num_microbatches, runs.setup.split)
    outcomes = []
    for j, microbatch in enumerate(rows):
        name = f"{batch}[microbatch {j} of {num_microbatches}, {num_microbatches} times]"
        if name not in runs.batches:
            order = np.empty(batch_rows(source), np.int64)
            for slot in rows:
                order[slot] = microbatch
            runs.register(name, rows_of(source, list(order)))
        outcomes.append(runs.step(name, num_microbatches, **settings))
    return outcomes


def reference(
    parts: list[dict[str, np.ndarray]], weights: list[float]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(sum_j w_j g_j, sum_j |w_j g_j|)`` in float64, leaf by leaf."""
    total: dict[str, np.ndarray] = {}
    magnitude: dict[str, np.ndarray] = {}
    for name in parts[0]:
        total[name] = np.sum([w * g[name] for w, g in zip(weights, parts, strict=True)], axis=0)
        magnitude[name] = np.sum([abs(w) * np.abs(g[name]) for w, g in zip(weights, parts, strict=True)], axis=0)
    return total, magnitude


def fitted_weights(got: dict[str, np.ndarray], parts: list[dict[str, np.ndarray]]) -> np.ndarray:
    """The least-squares weights of ``got`` in the microbatch gradients ``parts``."""
    names = sorted(got)
    columns = np.stack([np.concatenate([g[name].reshape(-1) for name in names]) for g in parts], axis=1)
    target = np.concatenate([got[name].reshape(-1) for name in names])
    finite = np.isfinite(target) & np.isfinite(columns).all(axis=1)
    weights, *_ = np.linalg.lstsq(columns[finite], target[finite], rcond=None)
    return weights


def relative_error(
    got: dict[str, np.ndarray], want: dict[str, np.ndarray], magnitude: dict[str, np.ndarray]
) -> tuple[float, dict[str, float]]:
    """``|got - want| / |magnitude|`` (2-norms) over the whole tree, and leaf by leaf (NaN counts as inf)."""

    def ratio(pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> float:
        difference = math.fsum(float(np.sum(np.square(g - w))) for g, w, _ in pairs)
        scale = math.fsum(float(np.sum(np.square(m))) for _, _, m in pairs)
        if not math.isfinite(difference):
            return math.inf
        return math.sqrt(difference / scale) if scale > 0 else (0.0 if difference == 0 else math.inf)

    triples = {leaf: (got[leaf], want[leaf], magnitude[leaf]) for leaf in want}
    return ratio(list(triples.values())), {leaf: ratio([t]) for leaf, t in triples.items()}


def _weighted_sum_check(
    name: str,
    runs: Runs,
    batch: str,
    num_microbatches: int,
    weights: list[float],
    catches: str,
    started: float,
    compared: str,
) -> CheckResult:
    got = runs.step(batch, num_microbatches)
    refs = microbatch_references(runs, batch, num_microbatches)
    want, magnitude = reference([r.gradient for r in refs], weights)
    error, leaf_errors = relative_error(got.gradient, want, magnitude)
    allowed, tolerance = (
        SUM_TOLERANCE,
        "|G - G*| / |sum_j |w_j g_j|| <= 2^-14 (float16's u / 8: any 16-bit sum errs more)",
    )
    if runs.reads_model_state():
        dtype = runs.rounding_dtype
        allowed = max(SUM_TOLERANCE, math.sqrt(unit_roundoff(dtype)))
        tolerance = (
            f"the gradient reads the model state: references from the one-microbatch program, chained; sqrt(u) of "
            f"{np.dtype(dtype).name} ({allowed:.2g}): the weights are checked, a low-precision sum only below it"
        )
    elapsed = time.perf_counter() - started
    if error <= allowed:
        return CheckResult(name, "pass", compared, error, allowed, tolerance, seconds=elapsed)
    fitted = fitted_weights(got.gradient, [r.gradient for r in refs])
    off = np.abs(fitted - np.asarray(weights)) / np.maximum(np.abs(weights), 1e-30)
    j = int(np.argmax(off))
    shown = ", ".join(f"{w:.4g}" for w in fitted)
    expected = ", ".join(f"{w:.4g}" for w in weights)
    leaf = max(leaf_errors, key=leaf_errors.__getitem__)
    where = f"{leaf} (its relative error {leaf_errors[leaf]:.2g})"
    if off[j] > WEIGHT_TOLERANCE:
        where += f"; microbatch {j} weighs {fitted[j]:.4g}, expected {weights[j]:.4g}"
        diagnosis = catches if name == "token_weighting" else _weights_diagnosis(fitted, weights)
    else:
        where += "; every microbatch has its weight: the sum itself is imprecise"
        diagnosis = LOW_PRECISION_SUM + _precision_of(error)
    detail = f"fitted weights [{shown}], expected [{expected}]"
    return CheckResult(name, "fail", compared, error, allowed, tolerance, where, diagnosis, detail, elapsed)


def _precision_of(relative: float) -> str:
    for dtype in ("bfloat16", "float16"):
        if relative >= unit_roundoff(dtype) / 8:
            return f" (an error of {relative:.2g} relative is {dtype}'s rounding, u = {unit_roundoff(dtype):.3g})"
    return ""


def _weights_diagnosis(fitted: np.ndarray, weights: list[float]) -> str:
    total = float(np.sum(weights))
    if abs(fitted[-1] - total) <= WEIGHT_TOLERANCE * total and np.all(np.abs(fitted[:-1]) <= WEIGHT_TOLERANCE * total):
        return "the step kept the last microbatch's gradient only (an accumulator overwritten, not added to)"
    dropped = [j for j, w in enumerate(fitted) if abs(w) <= WEIGHT_TOLERANCE * total]
    if dropped:
        return f"microbatch(es) {dropped} left out of the accumulated gradient"
    return "the microbatches' gradients are combined with the wrong weights (the gradient is not the full batch's)"


def check_accumulation(runs: Runs, num_microbatches: int) -> CheckResult:
    """M microbatches against each microbatch alone, equal weights: the float32 sum, exactly."""
    started = time.perf_counter()
    weights = [1.0 / num_microbatches] * num_microbatches
    compared = f"G (M={num_microbatches}) vs sum_j g_j / M of each microbatch alone, in float64"
    return _weighted_sum_check(
        "accumulation", runs, "batch", num_microbatches, weights, LOW_PRECISION_SUM, started, compared
    )


def check_full_batch(runs: Runs, num_microbatches: int) -> CheckResult:
    r"""M microbatches against one: the step's gradient over the batch in ``M`` microbatches and in one.

    The two are different programs, each free to round its own way in the compute dtype, so
    they agree only to rounding that compounds through the network; the check allows
    :math:`\sqrt{u_c}` (a difference past the square root of the compute dtype's unit roundoff
    is structure, not rounding: a split along the wrong axis, a microbatch left out or weighed
    wrong), relative to :math:`\|\sum_j |w_j g_j|\|`.
    """
    started = time.perf_counter()
    compared = f"G (M={num_microbatches}) vs G (M=1)"
    state = runs.step("batch", num_microbatches).before.get("model_state")
    if jax.tree.leaves(state):
        return CheckResult(
            "full_batch", "n/a", compared, 0.0, 0.0, "-", seconds=time.perf_counter() - started,
            detail="the model carries state (batch statistics): each microbatch normalises by its own rows, so M "
            "microbatches are not one by design; the accumulation check still holds them to their microbatches",
        )  # fmt: skip
    if getattr(runs.setup, "keyed_by_shape", False):
        return CheckResult(
            "full_batch", "n/a", compared, 0.0, 0.0, "-", seconds=time.perf_counter() - started,
            detail="the loss takes a key: its dropout masks are drawn by the microbatch's shape, so one microbatch "
            "of B rows draws others than M of B/M; give make_loss_fn a random=False to compare",
        )  # fmt: skip
    dtype = runs.rounding_dtype
    # an 8-bit format (FP8 quantized by each microbatch's current amax) rounds each operand once: u itself
    u = unit_roundoff(dtype)
    allowed = u if np.dtype(dtype).itemsize == 1 else math.sqrt(u)
    _, _, magnitude, _ = full_batch_reference(runs, num_microbatches)
    many = runs.step("batch", num_microbatches)
    one = runs.step("batch", 1)
    error, leaf_errors = relative_error(many.gradient, one.gradient, magnitude)
    tolerance = f"sqrt(u) of {np.dtype(dtype).name} (u for FP8: {allowed:.2g}), relative to |sum_j |w_j g_j||"
    elapsed = time.perf_counter() - started
    if error <= allowed:
        return CheckResult("full_batch", "pass", compared, error, allowed, tolerance, seconds=elapsed)
    leaf = max(leaf_errors, key=leaf_errors.__getitem__)
    diagnosis = (
        "M microbatches are not the full batch: the batch is split along another axis than its rows, or microbatches "
        "are left out or weighed wrong"
    )
    where = f"{leaf} (its relative error {leaf_errors[leaf]:.2g})"
    return CheckResult("full_batch", "fail", compared, error, allowed, tolerance, where, diagnosis, seconds=elapsed)


def check_token_weighting(runs: Runs, num_microbatches: int) -> CheckResult:
    """A token-weighted loss over microbatches of different token counts: weights ``c_j / sum c``."""
    started = time.perf_counter()
    mask = runs.setup.mask
    compared = "uneven token counts: G vs sum_j c_j g_j / sum_j c_j"
    if mask is None:
        return CheckResult(
            "token_weighting", "n/a", compared, 0.0, 0.0, "-",
            detail="the setup names no token-weight leaf (mask): its loss is not token-weighted",
        )  # fmt: skip
    rows = microbatch_rows(batch_rows(runs.batches["batch"]), num_microbatches, runs.setup.split)
    if "uneven" not in runs.batches:
        uneven, counts = uneven_mask(runs.batches["batch"], mask, rows)
        runs.register("uneven", uneven)
        runs.token_counts = counts
    counts = runs.token_counts
    weights = [c / math.fsum(counts) for c in counts]
    catches = (
        "loss normalised per microbatch: each microbatch's mean weighs 1/M, so M microbatches are not the full "
        "batch (the full batch divides the summed loss by the whole batch's token count)"
    )
    return _weighted_sum_check("token_weighting", runs, "uneven", num_microbatches, weights, catches, started, compared)


def full_batch_reference(
    runs: Runs, num_microbatches: int
) -> tuple[list[Outcome], dict[str, np.ndarray], dict[str, np.ndarray], float]:
    """The microbatch references of the batch, its float64 gradient ``G*``, ``sum |w_j g_j|`` and ``|G*|``."""
    weights = [1.0 / num_microbatches] * num_microbatches
    refs = microbatch_references(runs, "batch", num_microbatches)
    want, magnitude = reference([r.gradient for r in refs], weights)
    norm = math.sqrt(math.fsum(float(np.sum(v * v)) for v in want.values()))
    return refs, want, magnitude, norm


def clip_threshold(runs: Runs, num_microbatches: int) -> float | None:
    """The clip the checks run with, half the full batch's float64 gradient norm (None: no finite norm)."""
    norm = full_batch_reference(runs, num_microbatches)[3]
    return norm / 2 if norm > 0 and math.isfinite(norm) else None


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
    clipped = runs.step("batch", num_microbatches, max_grad_norm=threshold)
    unclipped = runs.step("batch", num_microbatches)
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
            "float32 norm was reported)" + _precision_of(abs(used - 1)),
            detail,
        )
    return "the reported gradient norm is not the norm of the gradient the step applied", detail
