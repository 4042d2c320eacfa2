r"""The independent reference: the step's gradient and update against the loss's, computed without the step.

Every other gradient check compares the step with its own programs, so an error by the same
factor everywhere (a loss scale divided out twice, gradients divided by ``M`` twice) passes them
all. This one differentiates the user's unscaled loss itself (the setup's
``reference_loss(params, parts, batch)``) in float32, matmuls at ``"highest"`` precision, with
none of the step's machinery (no microbatches, no loss scale, no compute dtype):

.. math:: G_\mathrm{ref} = \nabla_p\, L(p;\ \text{the whole batch}), \qquad
          \Delta p_\mathrm{ref} = -\eta\, G_\mathrm{ref} \quad (\text{the probe, SGD at } \eta)

A model with batch statistics has two correct designs, the microbatches sharing the whole
batch's statistics or each normalising by its own rows; for it the reference may also be
:math:`\sum_j w_j\, \nabla_p L(p;\ \text{microbatch } j)`, the model state carried from one
microbatch to the next, and the step passes if it matches either. The step and the reference
are different programs, the step's rounding to its compute dtype, so the gradient may differ by
:math:`\sqrt{u}` of the coarsest format either multiplies in, relative to
:math:`\|\sum_j |w_j\, g_j|\|` (the reference's own microbatch gradients); the update by
:math:`\eta` times that, plus one rounding of the new parameters
(:math:`2u_p\,\|p'\|`, stochastic rounding included) and of the product.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from leanstep.inspection.auditing import audit
from leanstep.verification.bounds import unit_roundoff
from leanstep.verification.gradient_checks import (
    PER_MICROBATCH_MEAN,
    fitted_weights,
    reference,
    relative_error,
    weights_text,
)
from leanstep.verification.protocol import PROBE_LEARNING_RATE
from leanstep.verification.report import CheckResult
from leanstep.verification.runs import Runs
from leanstep.verification.trees import to_float64

__all__ = ["ReferenceGradient", "check_reference", "coarsest_of"]

_COMPARED = "G and the update vs the float32 gradient of the unscaled loss without the step, and SGD (the probe) on it"


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def coarsest_of(dtypes: Any) -> float:
    """The largest unit roundoff among matmul operand ``dtypes`` and float32's; integer operands
    (int8 products) are exact. Not ``np.inexact``: ml_dtypes' bfloat16 and FP8 are not numpy floats.

    Example:
      >>> coarsest_of(["float8_e4m3fn", "int8"]) == unit_roundoff("float8_e4m3fn")
      True
    """
    return max(
        [unit_roundoff("float32")] + [unit_roundoff(d) for d in dtypes if not np.issubdtype(np.dtype(d), np.integer)]
    )


class ReferenceGradient:
    """The float32 gradient of ``setup.reference_loss`` by the params, one compiled program per shape.

    Called as ``(parts, batch) -> (G, model state after)``: ``G`` in float64 by leaf name, at
    ``parts["params"]`` (cast to float32), the other parts and the batch as given. Only the array
    leaves go into the program; the others (strings and functions of an Equinox module) are those
    of the first call, closed over. :meth:`coarsest_roundoff` is the largest unit roundoff among the
    operands of its matmuls (float32 when it has none).
    """

    def __init__(self, setup: Any, parts: Mapping[str, Any], batch: Any) -> None:
        self.setup = setup
        self._params = jax.tree.flatten(parts["params"])
        self._others = jax.tree.flatten((self._rest(parts), batch))
        self._program = jax.jit(jax.grad(self._loss, has_aux=True))

    @staticmethod
    def _rest(parts: Mapping[str, Any]) -> dict[str, Any]:
        return {name: value for name, value in parts.items() if name != "params"}

    def _loss(self, params: list[Any], others: list[Any]) -> tuple[jax.Array, list[Any]]:
        p = jax.tree.unflatten(self._params[1], _fill(self._params[0], params))
        rest, batch = jax.tree.unflatten(self._others[1], _fill(self._others[0], others))
        loss, state = self.setup.reference_loss(p, rest, batch)
        return jnp.asarray(loss, jnp.float32), [leaf for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array)]

    def _arrays(self, parts: Mapping[str, Any], batch: Any) -> tuple[list[Any], list[Any]]:
        params = [jnp.asarray(leaf, jnp.float32) for leaf in jax.tree.leaves(parts["params"]) if _is_array(leaf)]
        others = [leaf for leaf in jax.tree.leaves((self._rest(parts), batch)) if _is_array(leaf)]
        return params, others

    def __call__(self, parts: Mapping[str, Any], batch: Any) -> tuple[dict[str, np.ndarray], Any]:
        with jax.default_matmul_precision("highest"):
            grads, state = self._program(*self._arrays(parts, batch))
        tree = jax.tree.unflatten(self._params[1], _fill(self._params[0], grads))
        return to_float64(tree), _rebuild(parts.get("model_state"), state)

    def coarsest_roundoff(self, parts: Mapping[str, Any], batch: Any) -> float:
        """The largest unit roundoff among the matmul operands of the program for these shapes (an int8
        product is exact: its operands' quantization is the loss's own, the same in the step)."""
        with jax.default_matmul_precision("highest"):
            report = audit(self._program, *self._arrays(parts, batch))
        return coarsest_of([d for m in report.matmuls for d in (m.lhs[1], m.rhs[1])])


def _fill(leaves: list[Any], arrays: list[Any]) -> list[Any]:
    given = iter(arrays)
    return [next(given) if _is_array(leaf) else leaf for leaf in leaves]


def _rebuild(template: Any, arrays: list[Any]) -> Any:
    """``template`` with its array leaves replaced, in order, by ``arrays`` (the loss's new model state)."""
    if template is None:
        return None
    leaves, treedef = jax.tree.flatten(template)
    dynamic = [_is_array(leaf) for leaf in leaves]
    if sum(dynamic) != len(arrays):
        raise ValueError(
            "reference_loss: the model state it returns has another structure than the one it was given "
            f"({len(arrays)} arrays, expected {sum(dynamic)})"
        )
    given = iter(arrays)
    return jax.tree.unflatten(treedef, [next(given) if d else leaf for leaf, d in zip(leaves, dynamic, strict=True)])


def _references(runs: Runs, num_microbatches: int, parts: Mapping[str, Any]) -> tuple[dict, dict, dict | None, float]:
    """The full batch's reference gradient, ``sum_j |w_j g_j|`` of the microbatches' (model state
    chained), their weighted sum where the model has state (else None), and the coarsest ``u``."""
    weights = runs.weights("batch", num_microbatches)
    gradient = ReferenceGradient(runs.setup, parts, runs.batches["batch"])
    full, _ = gradient(parts, runs.batches["batch"])
    u = gradient.coarsest_roundoff(parts, runs.batches["batch"])
    current, grads = dict(parts), []
    for weight, rows in zip(weights, runs.microbatches("batch", num_microbatches), strict=True):
        g, current["model_state"] = gradient(current, rows)
        grads.append(g if weight else {leaf: np.zeros_like(v) for leaf, v in full.items()})
    summed, magnitude = reference(grads, weights)
    return full, magnitude, summed if runs.has_model_state() else None, u


def check_reference(runs: Runs, num_microbatches: int) -> CheckResult:
    """The step's gradient and update against the loss's own (see the module doc)."""
    started = time.perf_counter()
    if not callable(getattr(runs.setup, "reference_loss", None)):
        return CheckResult(
            "reference", "n/a", _COMPARED, 0.0, 0.0, "-",
            detail="the step offers no reference_loss(params, parts, batch): the unscaled loss to differentiate",
        )  # fmt: skip
    got = runs.step("batch", num_microbatches)
    if bool(np.asarray(got.metrics.get("skipped", False))):
        return CheckResult(
            "reference", "fail", _COMPARED, math.inf, 0.0, "-", "metrics/skipped",
            "the step skipped a batch whose values are all finite", seconds=time.perf_counter() - started,
        )  # fmt: skip
    full, magnitude, summed, u_reference = _references(runs, num_microbatches, got.before)
    u = max(u_reference, unit_roundoff(runs.rounding_dtype))
    allowed = math.sqrt(u) if u <= unit_roundoff("bfloat16") else u  # an 8-bit format: one rounding an operand
    candidates = {"the full batch's": full, **({"each microbatch's, model state chained": summed} if summed else {})}
    errors = {name: relative_error(got.gradient, want, magnitude) for name, want in candidates.items()}
    which = min(errors, key=lambda name: errors[name][0])
    error, leaf_errors = errors[which]
    want = candidates[which]
    tolerance = (
        f"sqrt(u) (u for FP8: {allowed:.2g}) of the coarsest matmul format of the step or the loss, relative to "
        "|sum_j |w_j g_j||"
    )
    if error > allowed:
        where, diagnosis, detail = _diagnosis(runs, num_microbatches, got.gradient, want, leaf_errors)
        return CheckResult(
            "reference", "fail", _COMPARED, error, allowed, tolerance, where, diagnosis, detail,
            time.perf_counter() - started,
        )  # fmt: skip
    return _check_update(got, want, magnitude, allowed, error, which, tolerance, started)


def _check_update(
    got: Any, want: dict, magnitude: dict, allowed: float, error: float, which: str, tolerance: str, started: float
) -> CheckResult:
    """The step's parameter update against the probe's rule applied to the reference gradient."""
    before, after = to_float64(got.before["params"]), to_float64(got.after["params"])
    update = {leaf: after[leaf] - before[leaf] for leaf in want}
    rule = {leaf: -PROBE_LEARNING_RATE * v for leaf, v in want.items()}
    difference = _norm({leaf: update[leaf] - rule[leaf] for leaf in want})
    leaf_dtypes = [np.asarray(v).dtype for v in jax.tree.leaves(got.after["params"])]
    u_params = max(unit_roundoff(d) for d in leaf_dtypes) if leaf_dtypes else unit_roundoff("float32")
    bound = (
        PROBE_LEARNING_RATE * allowed * _norm(magnitude)
        + 2 * u_params * _norm(after)
        + unit_roundoff("float32") * _norm(rule)
    )
    elapsed = time.perf_counter() - started
    detail = f"the gradient matches {which} ({error:.2g} relative); the update is off by {difference:.3g}"
    if difference <= bound:
        return CheckResult("reference", "pass", _COMPARED, error, allowed, tolerance, detail=detail, seconds=elapsed)
    diagnosis = (
        "the parameters moved otherwise than the optimizer the step was given (SGD at "
        f"{PROBE_LEARNING_RATE:g}) moves them for this gradient: the update is scaled, applied twice or changed "
        "after the optimizer"
    )
    return CheckResult(
        "reference", "fail", _COMPARED, difference, bound, f"{PROBE_LEARNING_RATE:g} x that, 2 u_p |p'| and one "
        "rounding", "params (the update)", diagnosis, detail, elapsed,
    )  # fmt: skip


def _norm(tree: dict) -> float:
    return math.sqrt(math.fsum(float(np.sum(np.square(v))) for v in tree.values()))


def _diagnosis(
    runs: Runs, num_microbatches: int, got: dict, want: dict, leaf_errors: dict[str, float]
) -> tuple[str, str, str]:
    """Where, what and how: the factor the step's gradient is off by, or the weights it gave the microbatches."""
    leaf = max(leaf_errors, key=leaf_errors.__getitem__)
    where = f"{leaf} (its relative error {leaf_errors[leaf]:.2g})"
    names = sorted(want)
    g = np.concatenate([got[n].reshape(-1) for n in names])
    w = np.concatenate([want[n].reshape(-1) for n in names])
    factor = float(np.dot(g, w) / np.dot(w, w)) if np.dot(w, w) > 0 else math.nan
    residual = float(np.linalg.norm(g - factor * w) / max(np.linalg.norm(factor * w), 1e-300))
    detail = f"the step's gradient is {factor:.6g} times the loss's, off its direction by {residual:.2g}"
    if residual <= 2.0**-5 and math.isfinite(factor):
        return where, _factor_diagnosis(factor, runs, num_microbatches), detail
    weights = runs.weights("batch", num_microbatches)
    fitted = _fitted_microbatch_weights(runs, num_microbatches, got)
    if fitted is not None:
        detail += f"; fitted microbatch weights [{weights_text(fitted)}], the loss's [{weights_text(weights)}]"
        if np.allclose(fitted, 1 / num_microbatches, rtol=2.0**-5) and not np.allclose(weights, 1 / num_microbatches):
            return where, PER_MICROBATCH_MEAN, detail
    diagnosis = (
        "the step's gradient is not the gradient of its loss: the step computes another function than the loss "
        "it was given (a wrong split, a statistic, a loss declared as a mean that is a per-microbatch mean)"
    )
    return where, diagnosis, detail


def _fitted_microbatch_weights(runs: Runs, num_microbatches: int, got: dict) -> np.ndarray | None:
    parts = runs.step("batch", num_microbatches).before
    gradient = ReferenceGradient(runs.setup, parts, runs.batches["batch"])
    grads = [gradient(parts, rows)[0] for rows in runs.microbatches("batch", num_microbatches)]
    grads = [{leaf: np.nan_to_num(v) for leaf, v in g.items()} for g in grads]  # an empty microbatch: 0 / 0
    return fitted_weights(got, grads)


def _factor_diagnosis(factor: float, runs: Runs, num_microbatches: int) -> str:
    scale = runs.metric("loss_scale")

    def near(x: float) -> bool:
        return x > 0 and abs(factor / x - 1) <= 2.0**-5

    if scale and scale != 1 and near(1 / scale):
        return f"the loss scale ({scale:g}) divided out twice: the gradient is 1/{scale:g} of the loss's"
    if scale and scale != 1 and near(scale):
        return f"the loss scale ({scale:g}) never divided out: the gradient is {scale:g} times the loss's"
    if near(1 / num_microbatches):
        return (
            f"gradients divided by M={num_microbatches} twice: the step averages over microbatches gradients that "
            "are already the batch's (a mean loss divided by M again)"
        )
    if near(num_microbatches):
        return f"gradients summed over the M={num_microbatches} microbatches, not averaged"
    exponent = math.log2(abs(factor)) if factor else math.nan
    if math.isfinite(exponent) and exponent == round(exponent):
        return f"the gradient is 2^{exponent:.0f} times the loss's: a loss scale divided out twice or not at all"
    return f"the gradient is {factor:.4g} times the loss's: a factor applied twice or left out"
