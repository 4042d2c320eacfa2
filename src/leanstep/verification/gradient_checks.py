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

Size: three checks (accumulation, full batch, token weighting) that share one float64
reference, its fitted weights and its tolerances.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from leanstep.verification.batches import batch_rows, microbatch_rows, rows_of, uneven_mask
from leanstep.verification.bounds import unit_roundoff
from leanstep.verification.report import CheckResult
from leanstep.verification.runs import Outcome, Runs

__all__ = [
    "PER_MICROBATCH_MEAN",
    "check_accumulation",
    "check_token_weighting",
    "clip_threshold",
    "fitted_weights",
    "full_batch_reference",
    "gradients_of",
    "microbatch_references",
    "precision_of",
    "reference",
    "relative_error",
    "skipped_finite_batch",
    "weights_text",
]

#: The named bug of a sum that has every microbatch's weight but not float32's precision.
LOW_PRECISION_SUM = (
    "gradients accumulated in a low-precision dtype, not float32 (as deepspeedai/DeepSpeed#1800: ZeRO summing "
    "bf16 gradients in bf16)"
)

#: The named bug of microbatches weighed 1/M each where the loss contract weighs them by their tokens.
PER_MICROBATCH_MEAN = (
    "loss normalised per microbatch: each microbatch's mean weighs 1/M, so M microbatches are not the full "
    "batch (the full batch divides the summed loss by the whole batch's token count)"
)

#: The largest relative error (2-norm over the whole gradient, against the norm of
#: ``sum_j |w_j g_j|``) of a float32 sum. A sum kept in bfloat16 or float16 rounds every partial
#: sum to 8 or 11 bits, an error of about u_16 / sqrt(3) >= 2^-12 relative; a float32 sum errs by
#: about sqrt(k) 2^-24 over k partial sums (Higham and Mary), below 2^-14 until k passes 2^19
#: even where they cancel 2^-5 of their magnitude. XLA may add a parameter's partial gradients
#: (a tied embedding's, a scatter's) into the accumulator in any order, so the bound cannot be
#: elementwise over microbatch gradients alone.
SUM_TOLERANCE = 2.0**-14

#: The weights a step used are "right" within this relative distance. Rounding moves a fitted
#: weight by about the unit roundoff of the sum's format (bfloat16: 2^-8 = 0.4%); the bugs this
#: separates from move it by a microbatch's share of the batch, 1/M or more of it (a microbatch
#: left out, the last one kept, 1/M in place of c_j / sum c).
WEIGHT_TOLERANCE = 2.0**-5


def microbatch_references(
    runs: Runs,
    batch: str,
    num_microbatches: int,
    *,
    chained: bool | None = None,
    skip: Sequence[int] = (),
    **settings: Any,
) -> list[Outcome | None]:
    """Each microbatch of the named batch alone: its rows in every microbatch, through the same program.

    The step's own ``M``-microbatch program computes microbatch ``j``'s gradient ``M`` times
    over and averages them: ``r_j = fl(sum of M copies of g_j) / M``, within ``gamma_M`` of
    ``g_j``, the very value (bit for bit) the program computes for microbatch ``j`` of the
    real batch. A program compiled for one microbatch could round differently (XLA fuses
    and contracts per program), and a sum that is wrong is wrong for both alike.

    A model whose gradient reads its own state (EMA batch norm, a counter) sees a different
    state in each copy; for it (``chained``, default: :meth:`Runs.reads_model_state`) the
    references are the one-microbatch program run on each microbatch in turn, each from the
    state the one before left (:meth:`Runs.chain`). The microbatches in ``skip`` (those that
    weigh 0: no tokens) are not run (their entry is None): alone, their loss is 0 / 0.
    """
    if chained is None:
        chained = runs.reads_model_state() and batch in ("batch", "uneven") and not settings
    if chained:
        return [None if j in skip else r for j, r in enumerate(runs.chain(batch, num_microbatches))]
    source = runs.batches[batch]
    rows = microbatch_rows(batch_rows(source), num_microbatches, runs.setup.split)
    outcomes: list[Outcome | None] = []
    for j, microbatch in enumerate(rows):
        if j in skip:
            outcomes.append(None)
            continue
        name = f"{batch}[microbatch {j} of {num_microbatches}, {num_microbatches} times]"
        if name not in runs.batches:
            order = np.empty(batch_rows(source), np.int64)
            for slot in rows:
                order[slot] = microbatch
            runs.register(name, rows_of(source, list(order)))
        outcomes.append(runs.step(name, num_microbatches, **settings))
    return outcomes


def gradients_of(outcomes: Sequence[Outcome | None]) -> list[dict[str, np.ndarray]]:
    """The outcomes' gradients, zeros for a microbatch not run (one that weighs 0)."""
    shapes = next(o.gradient for o in outcomes if o is not None)
    zeros = {leaf: np.zeros_like(v) for leaf, v in shapes.items()}
    return [zeros if o is None else o.gradient for o in outcomes]


def reference(
    parts: list[dict[str, np.ndarray]], weights: list[float]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(sum_j w_j g_j, sum_j |w_j g_j|)`` in float64, leaf by leaf (a term of weight 0 left out)."""
    total: dict[str, np.ndarray] = {}
    magnitude: dict[str, np.ndarray] = {}
    terms = [(w, g) for w, g in zip(weights, parts, strict=True) if w != 0]
    for name in parts[0]:
        total[name] = np.sum([w * g[name] for w, g in terms], axis=0)
        magnitude[name] = np.sum([abs(w) * np.abs(g[name]) for w, g in terms], axis=0)
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


def weights_text(weights: Sequence[float] | np.ndarray) -> str:
    """The weights as the reports print them: ``"0.25, 0.75"``."""
    return ", ".join(f"{w:.4g}" for w in weights)


def _weighted_sum_check(
    name: str, runs: Runs, batch: str, num_microbatches: int, catches: str, started: float, compared: str
) -> CheckResult:
    weights = runs.weights(batch, num_microbatches)
    got = runs.step(batch, num_microbatches)
    skipped = skipped_finite_batch(name, runs, batch, got, weights, compared, started)
    if skipped is not None:
        return skipped
    refs = gradients_of(microbatch_references(runs, batch, num_microbatches, skip=_empty(weights)))
    want, magnitude = reference(refs, weights)
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
    if error <= allowed:
        return CheckResult(name, "pass", compared, error, allowed, tolerance, seconds=time.perf_counter() - started)
    if runs.has_model_state():
        shared = _shared_statistics(name, runs, batch, num_microbatches, got, magnitude, compared, started)
        if shared is not None:
            return shared
    fitted = fitted_weights(got.gradient, refs)
    off = np.abs(fitted - np.asarray(weights)) / np.maximum(np.abs(weights), 1e-30)
    off = np.where(np.asarray(weights) == 0, np.abs(fitted) / max(weights), off)
    j = int(np.argmax(off))
    leaf = max(leaf_errors, key=leaf_errors.__getitem__)
    where = f"{leaf} (its relative error {leaf_errors[leaf]:.2g})"
    if off[j] > WEIGHT_TOLERANCE:
        where += f"; microbatch {j} weighs {fitted[j]:.4g}, expected {weights[j]:.4g}"
        diagnosis = catches if name == "token_weighting" else _weights_diagnosis(fitted, weights)
    else:
        where += "; every microbatch has its weight: the sum itself is imprecise"
        diagnosis = LOW_PRECISION_SUM + precision_of(error)
    detail = f"fitted weights [{weights_text(fitted)}], expected [{weights_text(weights)}]"
    elapsed = time.perf_counter() - started
    return CheckResult(name, "fail", compared, error, allowed, tolerance, where, diagnosis, detail, elapsed)


def _empty(weights: Sequence[float]) -> list[int]:
    return [j for j, w in enumerate(weights) if w == 0]


def skipped_finite_batch(
    name: str, runs: Runs, batch: str, got: Outcome, weights: list[float], compared: str, started: float
) -> CheckResult | None:
    """A failure if the step skipped this batch, whose every value is finite (None if it applied it)."""
    if not bool(np.asarray(got.metrics.get("skipped", False))):
        return None
    empty = _empty(weights)
    if empty:
        diagnosis = (
            f"microbatch {empty[0]} has no tokens and made the step non-finite: its loss divided by its own token "
            "count, 0 (loss normalised per microbatch; the full batch divides by the whole batch's count)"
        )
    else:
        diagnosis = "the step skipped a batch whose values are all finite (its finiteness guard fires on a finite step)"
    return CheckResult(
        name, "fail", compared, math.inf, 0.0, "-", f"metrics/skipped on the batch {batch!r}", diagnosis,
        f"token weights of the microbatches [{weights_text(weights)}]", time.perf_counter() - started,
    )  # fmt: skip


def _shared_statistics(
    name: str,
    runs: Runs,
    batch: str,
    num_microbatches: int,
    got: Outcome,
    magnitude: dict[str, np.ndarray],
    compared: str,
    started: float,
) -> CheckResult | None:
    """A pass if the step's gradient is its full-batch (``M = 1``) gradient within ``sqrt(u)``: the model's
    batch statistics are the whole batch's, shared by the microbatches (None if it is not)."""
    allowed = _program_tolerance(runs.rounding_dtype)
    one = runs.step(batch, 1)
    error, _ = relative_error(got.gradient, one.gradient, magnitude)
    if not error <= allowed:
        return None
    tolerance = (
        f"the model's batch statistics are shared by the microbatches (the whole batch's): G (M={num_microbatches}) "
        f"vs G (M=1), sqrt(u) of {np.dtype(runs.rounding_dtype).name} ({allowed:.2g})"
    )
    detail = "each microbatch alone normalises by its own rows, so the microbatch references do not apply"
    return CheckResult(
        name, "pass", compared + "; vs G (M=1)", error, allowed, tolerance, detail=detail,
        seconds=time.perf_counter() - started,
    )  # fmt: skip


def _program_tolerance(dtype: Any) -> float:
    """What two programs of the step may differ by, relative: ``sqrt(u)`` of the dtype they round to
    (``u`` itself for an 8-bit format, quantized by each program's own amax: one rounding per operand)."""
    u = unit_roundoff(dtype)
    return u if np.dtype(dtype).itemsize == 1 else math.sqrt(u)


def precision_of(relative: float) -> str:
    for dtype in ("bfloat16", "float16"):
        if relative >= unit_roundoff(dtype) / 8:
            return f" (an error of {relative:.2g} relative is {dtype}'s rounding, u = {unit_roundoff(dtype):.3g})"
    return ""


def _weights_diagnosis(fitted: np.ndarray, weights: list[float]) -> str:
    total = float(np.sum(weights))
    count = len(weights)
    if abs(fitted[-1] - total) <= WEIGHT_TOLERANCE * total and np.all(np.abs(fitted[:-1]) <= WEIGHT_TOLERANCE * total):
        return "the step kept the last microbatch's gradient only (an accumulator overwritten, not added to)"
    if np.all(np.abs(fitted - total / count) <= WEIGHT_TOLERANCE * total / count):
        return PER_MICROBATCH_MEAN
    dropped = [j for j, w in enumerate(fitted) if abs(w) <= WEIGHT_TOLERANCE * total and weights[j] != 0]
    if dropped:
        return f"microbatch(es) {dropped} left out of the accumulated gradient"
    return "the microbatches' gradients are combined with the wrong weights (the gradient is not the full batch's)"


def check_accumulation(runs: Runs, num_microbatches: int) -> CheckResult:
    """M microbatches against each microbatch alone, weighed as the loss contract says: the float32 sum."""
    started = time.perf_counter()
    weighed = runs.weighing("batch", num_microbatches)  # as the weights are taken: mask, the loss's counts, or 1/M
    compared = f"G (M={num_microbatches}) vs sum_j w_j g_j of each microbatch alone, w_j = {weighed}, in float64"
    return _weighted_sum_check("accumulation", runs, "batch", num_microbatches, LOW_PRECISION_SUM, started, compared)


def check_full_batch(runs: Runs, num_microbatches: int) -> CheckResult:
    r"""M microbatches against one: the step's gradient over the batch in ``M`` microbatches and in one.

    The two are different programs, each free to round its own way in the compute dtype, so
    they agree only to rounding that compounds through the network; the check allows
    :math:`\sqrt{u_c}` (a difference past the square root of the compute dtype's unit roundoff
    is structure, not rounding: a split along the wrong axis, a microbatch left out or weighed
    wrong), relative to :math:`\|\sum_j |w_j g_j|\|`. A model with batch statistics passes if its
    microbatches share the whole batch's; if each normalises by its own rows, ``M`` microbatches
    are not one by design and the check does not apply.
    """
    started = time.perf_counter()
    compared = f"G (M={num_microbatches}) vs G (M=1)"
    if getattr(runs.setup, "keyed_by_shape", False):
        return CheckResult(
            "full_batch", "n/a", compared, 0.0, 0.0, "-", seconds=time.perf_counter() - started,
            detail="the loss takes a key: its dropout masks are drawn by the microbatch's shape, so one microbatch "
            "of B rows draws others than M of B/M; give make_loss_fn a random=False to compare",
        )  # fmt: skip
    dtype = runs.rounding_dtype
    allowed = _program_tolerance(dtype)
    _, _, magnitude, _ = full_batch_reference(runs, num_microbatches)
    many = runs.step("batch", num_microbatches)
    one = runs.step("batch", 1)
    error, leaf_errors = relative_error(many.gradient, one.gradient, magnitude)
    tolerance = f"sqrt(u) of {np.dtype(dtype).name} (u for FP8: {allowed:.2g}), relative to |sum_j |w_j g_j||"
    elapsed = time.perf_counter() - started
    if error <= allowed:
        return CheckResult("full_batch", "pass", compared, error, allowed, tolerance, seconds=elapsed)
    if runs.has_model_state():
        return CheckResult(
            "full_batch", "n/a", compared, error, allowed, tolerance, seconds=elapsed,
            detail="the model carries state (batch statistics) and each microbatch normalises by its own rows, so M "
            "microbatches are not one by design; the accumulation check still holds them to their microbatches",
        )  # fmt: skip
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
        if getattr(runs.setup, "token_weighted", False):
            detail = (
                "the loss is token-weighted (token_weighted=True) but no token-weight leaf is named: give mask=<the "
                "name of the batch's token-weight leaf> to check it (the other checks weigh microbatch j by "
                f"w_j = {runs.weighing('batch', num_microbatches)})"
            )
        else:
            detail = "the setup names no token-weight leaf (mask): its loss is not token-weighted"
        return CheckResult("token_weighting", "n/a", compared, 0.0, 0.0, "-", detail=detail)
    rows = microbatch_rows(batch_rows(runs.batches["batch"]), num_microbatches, runs.setup.split)
    if "uneven" not in runs.batches:
        uneven, counts = uneven_mask(runs.batches["batch"], mask, rows)
        runs.register("uneven", uneven)
        runs.token_counts = counts
    return _weighted_sum_check(
        "token_weighting", runs, "uneven", num_microbatches, PER_MICROBATCH_MEAN, started, compared
    )


def full_batch_reference(
    runs: Runs, num_microbatches: int
) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray], dict[str, np.ndarray], float]:
    """The microbatch references' gradients of the batch, its float64 gradient ``G*``, ``sum |w_j g_j|`` and ``|G*|``."""
    weights = runs.weights("batch", num_microbatches)
    refs = gradients_of(microbatch_references(runs, "batch", num_microbatches, skip=_empty(weights)))
    want, magnitude = reference(refs, weights)
    norm = math.sqrt(math.fsum(float(np.sum(v * v)) for v in want.values()))
    return refs, want, magnitude, norm


def clip_threshold(runs: Runs, num_microbatches: int) -> float | None:
    """The clip the checks run with, half the full batch's float64 gradient norm (None: no finite norm)."""
    norm = full_batch_reference(runs, num_microbatches)[3]
    return norm / 2 if norm > 0 and math.isfinite(norm) else None
