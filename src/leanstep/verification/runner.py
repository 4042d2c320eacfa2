"""verify and verify_step: run the checks on a setup and gather their report.

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> def make_loss(policy):
  ...     def loss(p, b):
  ...         error = (jnp.tanh(b["x"] @ p["w"]) - b["y"]) ** 2
  ...         return jnp.sum(error * b["mask"]), jnp.sum(b["mask"])
  ...     return loss
  >>> rng = np.random.default_rng(0)
  >>> batch = {"x": rng.normal(size=(8, 3)).astype(np.float32), "y": rng.normal(size=(8, 2)).astype(np.float32),
  ...          "mask": np.ones((8, 2), np.float32)}
  >>> report = verify(make_loss, {"w": jnp.ones((3, 2))}, batch, num_microbatches=4, token_weighted=True,
  ...                 mask="mask", checks=("accumulation", "token_weighting", "clip", "non_finite"))
  >>> report.passed, [c.status for c in report.checks]
  (True, ['pass', 'pass', 'pass', 'pass'])
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from leanstep.blocks.compute_dtype_check import PrecisionWarning
from leanstep.common.checks import check_keywords
from leanstep.step.spec import SHORT_KEYWORDS, StepSpec
from leanstep.verification.batches import batch_rows
from leanstep.verification.clip_check import check_clip
from leanstep.verification.gradient_checks import check_accumulation, check_full_batch, check_token_weighting
from leanstep.verification.in_backward_check import check_in_backward
from leanstep.verification.int8_checks import check_int8_agreement, check_int8_meshes, check_int8_microbatches
from leanstep.verification.leanstep_step import LeanstepStep, ModelExtras
from leanstep.verification.mesh_check import check_meshes
from leanstep.verification.program_checks import check_compute_dtype, check_remat
from leanstep.verification.protocol import VerifiableStep
from leanstep.verification.reference_check import check_reference
from leanstep.verification.report import CheckResult, VerifyReport
from leanstep.verification.runs import Runs
from leanstep.verification.state_checks import check_fp8, check_keys, check_non_finite

__all__ = ["CHECKS", "verify", "verify_step"]

#: Every check, by name, in the order they run.
CHECKS: dict[str, Callable[[Runs, int], CheckResult]] = {
    "accumulation": check_accumulation,
    "full_batch": check_full_batch,
    "reference": check_reference,
    "token_weighting": check_token_weighting,
    "clip": check_clip,
    "non_finite": check_non_finite,
    "keys": check_keys,
    "fp8": check_fp8,
    "int8_agreement": check_int8_agreement,
    "int8_microbatches": check_int8_microbatches,
    "compute_dtype": check_compute_dtype,
    "remat": check_remat,
    "meshes": check_meshes,
    "int8_meshes": check_int8_meshes,
    "in_backward": check_in_backward,
}


def _check_names(checks: Sequence[str] | None) -> tuple[str, ...]:
    if checks is None:
        return tuple(CHECKS)
    if isinstance(checks, str):
        raise TypeError(f"checks: expected a sequence of check names, got the string {checks!r}")
    unknown = [name for name in checks if name not in CHECKS]
    if unknown:
        raise ValueError(f"checks: unknown {unknown}; expected names among {list(CHECKS)}")
    return tuple(checks)


def verify_step(
    step: VerifiableStep,
    *,
    num_microbatches: int,
    checks: Sequence[str] | None = None,
    meshes: Sequence[Any] = (),
    name: str = "step",
) -> VerifyReport:
    """Runs the checks on any :class:`~leanstep.verification.protocol.VerifiableStep`.

    Args:
      step: the setup: a hand-written step through the protocol, or a :class:`LeanstepStep`.
      num_microbatches: the microbatch count the checks run the step with (2 or more; it must
        divide the batch's rows).
      checks: the names of the checks to run (default: all of :data:`CHECKS`).
      meshes: the mesh layouts the ``meshes`` and ``int8_meshes`` checks compare with one device (``"data=4"``,
        ``"fsdp=2,tensor=2"`` or a ``jax.sharding.Mesh``); they need that many devices here.
      name: what the report calls the setup.

    Returns:
      A :class:`VerifyReport`; ``report.passed`` is False if any check failed, and
      ``report.verdict`` says what was verified: nothing, where every check is ``n/a``; not the
      step against its loss, where the step offers no ``reference_loss``.

    Raises:
      ValueError: ``num_microbatches`` below 2 or not a divisor of the batch's rows; an unknown check.
    """
    names = _check_names(checks)
    rows = batch_rows(step.batch)
    if not isinstance(num_microbatches, int) or num_microbatches < 2 or rows % num_microbatches:
        raise ValueError(
            f"num_microbatches: expected an int >= 2 that divides the batch's {rows} rows, got {num_microbatches!r} "
            "(the checks compare microbatches with the whole batch)"
        )
    runs = Runs(step, num_microbatches=num_microbatches)
    runs.register("batch", step.batch)
    runs.layouts = tuple(meshes)
    results = []
    for check in names:
        started = time.perf_counter()
        with warnings.catch_warnings():  # the compute-dtype check reports what a PrecisionWarning would say
            warnings.simplefilter("ignore", PrecisionWarning)
            result = CHECKS[check](runs, num_microbatches)
        results.append(result if result.seconds else _timed(result, time.perf_counter() - started))
    return VerifyReport(name, tuple(results))


def _timed(result: CheckResult, seconds: float) -> CheckResult:
    return dataclasses.replace(result, seconds=seconds)


#: What :func:`verify` takes beside the step's settings: :class:`LeanstepStep`'s keywords and :class:`ModelExtras`' fields.
_SETUP = ("remat", "model_state", "mask")
_EXTRAS = ("rules", "layer_stack")


def verify(
    make_loss_fn: Callable[[str], Callable[..., Any]],
    params: Any,
    batch: Any,
    spec: StepSpec | None = None,
    *,
    checks: Sequence[str] | None = None,
    meshes: Sequence[Any] = (),
    name: str | None = None,
    **settings: Any,
) -> VerifyReport:
    """Verifies leanstep's step for a model: the inputs :func:`leanstep.planning.plan` takes, and the run's settings.

    Args:
      make_loss_fn: ``make_loss_fn(remat_policy) -> loss_fn``, as for :func:`leanstep.planning.plan`
        (``make_loss_fn(remat_policy, random=False)`` if it takes ``random``: see
        :meth:`LeanstepStep.loss_fn`).
      params: the parameters (arrays), or a params builder ``params(remat_policy) -> params`` for
        a model whose remat policy renames its parameters (as :func:`leanstep.planning.plan` takes).
      batch: one global batch (arrays).
      spec: the run's :class:`leanstep.StepSpec` (None: built from the step keywords among ``settings``).
      checks: the checks to run (default: all).
      meshes: the mesh layouts to compare with one device (see :func:`verify_step`).
      name: what the report calls the setup.
      **settings: :class:`LeanstepStep`'s ``remat``, ``model_state`` and ``mask``, and the model's
        ``rules`` and ``layer_stack`` (:class:`ModelExtras`); without ``spec``, the step's settings
        as :func:`leanstep.make_train_step`'s keywords (:meth:`leanstep.StepSpec.from_keywords`:
        ``precision``, ``num_microbatches``, ``token_weighted``, ``loss_scale``, ``master``,
        ``int8``, ...). The checks use 2 microbatches where the spec has 1.

    Returns:
      A :class:`VerifyReport`.

    Raises:
      TypeError: a setting neither takes (the nearest named); a spec and step keywords both.
      ValueError: ``params`` do not fit the loss under the remat policy (pass a params builder).
    """
    check_keywords("verify", settings, (*_SETUP, *_EXTRAS, *SHORT_KEYWORDS))
    setup = {name: settings.pop(name) for name in _SETUP if name in settings}
    extras = ModelExtras(**{name: settings.pop(name) for name in _EXTRAS if name in settings})
    if spec is None:
        spec = StepSpec.from_keywords(**settings)  # the user's short form, as make_train_step takes it
    elif settings:
        raise TypeError(
            f"verify got a spec and the keywords {', '.join(sorted(settings))}: give the step's settings once, in "
            "the spec (spec.replace(...)) or as keywords"
        )
    step = LeanstepStep(make_loss_fn, params, batch, spec, extras=extras, **setup)
    step.check_structure()
    int8 = "" if step.int8 is None else f", int8 {step.int8.to_string()}"
    label = name or f"leanstep step (precision {step.precision}, M={step.num_microbatches}, remat {step.remat}{int8})"
    return verify_step(step, num_microbatches=max(2, step.num_microbatches), checks=checks, meshes=meshes, name=label)
