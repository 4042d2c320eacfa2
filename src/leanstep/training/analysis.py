"""The planner and the auditor applied to a :class:`RunConfig` (``leanstep plan``, ``audit``, ``train --budget``).

:func:`leanstep.plan` and :func:`leanstep.audit` are pure functions of a loss, parameters, a
batch and an optimizer; here a config is built into those parts with :func:`build_run`, the
same parts ``leanstep train`` trains with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from leanstep.auditing import AuditReport, audit
from leanstep.planning import Plan, plan
from leanstep.training.build import build_run
from leanstep.training.config import RunConfig

__all__ = ["audit_run", "plan_run"]


def plan_run(config: RunConfig, budget_bytes: int | str, **options: Any) -> Plan:
    """Plans microbatches and remat for ``config`` (its other fields fixed) under a memory budget.

    Candidates: every divisor of ``config.batch_size`` times :data:`leanstep.REMAT_POLICIES`,
    at ``config.precision``; ``options`` go to :func:`leanstep.plan` (e.g. ``candidates``,
    ``exhaustive``). Use ``dataclasses.replace(config, microbatches=s.num_microbatches,
    remat=s.remat)`` with ``s = plan_run(config, budget).chosen.setting``.

    Raises:
      BudgetError: nothing fits.
      ValueError: an invalid config or budget, or a multi-device config (``devices``, ``fsdp``).
    """
    run = build_run(dataclasses.replace(config, microbatches=1, remat="none"))  # both are planned here
    if config.devices is not None or config.fsdp or config.mesh is not None:
        raise ValueError("a memory budget is planned for a one-device run; drop --devices, --fsdp and --mesh "
                         f"(got devices={config.devices!r}, fsdp={config.fsdp!r}, mesh={config.mesh!r})")
    options.setdefault("precision", config.precision)
    return plan(run.loss_fn, run.abstract_params(), run.batch_spec(), run.optimizer, budget_bytes=budget_bytes,
                max_grad_norm=config.max_grad_norm, loss_scale=run.loss_scale, **options)


def audit_run(config: RunConfig) -> AuditReport:
    """Audits the step ``config`` trains with (abstract inputs, nothing runs).

    The residuals are those of one microbatch's loss, in the compute dtype.

    Raises:
      ValueError: an invalid config.

    Example:
      >>> report = audit_run(RunConfig(size="tiny", batch_size=4, microbatches=2, remat="dots"))
      >>> [s.length for s in report.top_level_scans], report.accumulation_violations(2)
      ([2], [])
    """
    run = build_run(config)
    rows = config.batch_size // config.microbatches
    params_c = jax.eval_shape(run.precision.cast_to_compute, run.abstract_params())
    return audit(run.make_step(), run.abstract_state(), run.batch_spec(), loss_fn=run.precision.wrap(run.loss_fn()),
                 loss_args=(params_c, run.batch_spec(rows)))
