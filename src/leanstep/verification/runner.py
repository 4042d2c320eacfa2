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

from leanstep.blocks.accumulation import Accumulation
from leanstep.blocks.compute_dtype_check import PrecisionWarning
from leanstep.blocks.loss_contract import LossContract
from leanstep.verification.batches import batch_rows
from leanstep.verification.clip_check import check_clip
from leanstep.verification.gradient_checks import check_accumulation, check_full_batch, check_token_weighting
from leanstep.verification.in_backward_check import check_in_backward
from leanstep.verification.int8_checks import check_int8_agreement, check_int8_meshes, check_int8_microbatches
from leanstep.verification.leanstep_step import LeanstepStep
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


#: What :func:`verify` takes as the run's settings: :class:`LeanstepStep`'s keywords, and the short
#: form of its ``loss`` (a :class:`leanstep.LossContract`) and ``accumulation``.
_CONTRACT = ("has_aux", "token_weighted", "uses_rng", "has_state")
_SETTINGS = (
    "precision", "remat", "loss", "loss_scale", "model_state", "master", "mask", "rules", "accumulation", "int8",
    "layer_stack",
)  # fmt: skip


def verify(
    make_loss_fn: Callable[[str], Callable[..., Any]],
    params: Any,
    batch: Any,
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
      checks: the checks to run (default: all).
      meshes: the mesh layouts to compare with one device (see :func:`verify_step`).
      name: what the report calls the setup.
      **settings: the run's settings, as :class:`LeanstepStep` takes them (``precision``,
        ``remat``, ``loss``, ``loss_scale``, ``model_state``, ``master``, ``mask``, ``rules``,
        ``accumulation``, ``int8``, ``layer_stack``), with the short forms of ``make_train_step``: ``num_microbatches`` and
        ``split`` for ``accumulation`` (the checks use 2 microbatches if it is 1), ``has_aux``,
        ``token_weighted``, ``uses_rng`` and ``has_state`` for ``loss``.

    Returns:
      A :class:`VerifyReport`.

    Raises:
      TypeError: a setting :class:`LeanstepStep` does not take.
      ValueError: ``params`` do not fit the loss under the remat policy (pass a params builder).
    """
    unknown = sorted(set(settings) - {*_SETTINGS, *_CONTRACT, "num_microbatches", "split"})
    if unknown:
        raise TypeError(f"verify: unknown settings {unknown}; expected among {sorted({*_SETTINGS, *_CONTRACT})}")
    flags = {key: settings.pop(key) for key in _CONTRACT if key in settings}
    if flags:
        settings["loss"] = LossContract(**flags)
    if "num_microbatches" in settings or "split" in settings:
        count = settings.pop("num_microbatches", 1)
        settings["accumulation"] = Accumulation(count, split=settings.pop("split", "contiguous"))
    setup = LeanstepStep(make_loss_fn, params, batch, **settings)
    setup.check_structure()
    int8 = "" if setup.int8 is None else f", int8 {setup.int8.to_string()}"
    label = (
        name or f"leanstep step (precision {setup.precision}, M={setup.num_microbatches}, remat {setup.remat}{int8})"
    )
    return verify_step(setup, num_microbatches=max(2, setup.num_microbatches), checks=checks, meshes=meshes, name=label)
