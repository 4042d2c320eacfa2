"""The planner and the auditor applied to a :class:`RunConfig` (``leanstep plan``, ``audit``, ``train --budget``).

:func:`leanstep.planning.plan` and :func:`leanstep.inspection.audit` are pure functions of a loss, parameters, a
batch and an optimizer; here a config is built into those parts with :func:`build_run`, the
same parts ``leanstep train`` trains with.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from leanstep.inspection.auditing import AuditReport, audit
from leanstep.inspection.memory_spaces import MemorySpaceReport, memory_space_report
from leanstep.planning.one_device import BudgetError, Plan, plan
from leanstep.planning.search_options import SearchOptions, SearchSpace, split_options
from leanstep.step import offload_opt_state
from leanstep.training.build import build_run
from leanstep.training.config import RunConfig
from leanstep.training.machine_size import choose_for_machine

__all__ = ["audit_run", "fit_memory_budget", "offload_audit_run", "plan_run"]


def plan_run(
    config: RunConfig,
    budget_bytes: int | str | None,
    *,
    num_devices: int | None = None,
    accelerator: Any = "h100",
    **options: Any,
) -> Plan:
    """Plans ``config`` (its other fields fixed) under a memory budget: on one device, or on a cluster.

    One device (no ``num_devices``, ``devices``, ``fsdp`` or ``mesh``): microbatches and remat,
    every divisor of ``config.batch_size`` times :data:`leanstep.blocks.REMAT_POLICIES` at
    ``config.precision`` (:func:`leanstep.planning.plan`). A cluster of ``num_devices`` (or the devices of
    ``config.mesh``, whose mesh is then kept): also the mesh and the reduction, per device,
    priced on ``accelerator`` (:func:`leanstep.planning.cluster.plan_cluster`); where this process
    has too few devices, planning runs in a subprocess with ``num_devices`` simulated CPU devices
    (its plan then carries no executables). ``options`` go to the planner, flat: the fields of
    :class:`leanstep.planning.search_options.SearchSpace` (``remat_policies``, ``microbatches``,
    ``meshes``, ``reductions``) and of :class:`~leanstep.planning.search_options.SearchOptions`
    (``exhaustive``, ``rtol``, ``compiler_options``, ``progress``, ...) and ``candidates`` (one
    device); the step's settings are the run's (:attr:`leanstep.training.build.Run.step`, its
    flags parsed once), the planners' spec. Apply the choice with
    ``dataclasses.replace(config, microbatches=s.num_microbatches, remat=s.remat)`` (and
    ``mesh=s.mesh, reduce=s.reduce`` on a cluster, ``update_in_backward="on"`` where
    ``s.update_in_backward``), ``s = plan_run(config, budget).chosen.setting``. On one device,
    where no standard setting fits and the run's model has a :class:`leanstep.LayerStack` form
    (:meth:`leanstep.training.build.Run.layer_stack`), the plan tries the update inside the
    backward pass and says why in its first note.

    Raises:
      BudgetError: nothing fits.
      ValueError: an invalid config or budget; ``fsdp`` (plan with a mesh instead).
      TypeError: an option that is neither the planner's nor ``candidates`` (a step setting is the config's).
    """
    cluster = not (num_devices is None and config.mesh is None and config.devices is None)
    config = choose_for_machine(config, priced_accelerator=cluster).config  # --size and --precision auto
    if "candidates" in options:  # a candidate's precision "auto" is the config's, resolved
        options["candidates"] = [_resolved(c, config.precision) for c in options["candidates"]]
    if config.fsdp:
        raise ValueError("--budget plans --mesh, not --fsdp: use --mesh auto, or name a mesh such as --mesh fsdp=8")
    if not cluster:
        return _plan_one_device(config, budget_bytes, options)
    shape = config.mesh_shape  # --mesh, parsed once (RunConfig.step)
    if shape is not None:
        options.setdefault("meshes", [shape])
        num_devices = math.prod(shape.values()) if num_devices is None else num_devices
    elif num_devices is None:  # --devices without --mesh: data parallel, as the run would be
        num_devices = config.devices * jax.process_count()
        options.setdefault("meshes", [{"data": num_devices}])
    if len(jax.devices("cpu")) < num_devices and len(jax.devices()) < num_devices:
        return _plan_in_child(config, budget_bytes, num_devices, accelerator, options)
    from leanstep.planning.cluster import plan_cluster

    run = build_run(dataclasses.replace(config, microbatches=1, remat="none", mesh=None, devices=None))
    space, search, _ = _planner_options(options, cluster=True)
    return plan_cluster(
        run.loss_fn,
        run.abstract_params(),
        run.batch_spec(),
        run.optimizer,
        run.step,  # the run's spec: each candidate's mesh lays it out, its microbatches strided
        num_devices=num_devices,
        budget_bytes=budget_bytes,
        accelerator=accelerator,
        rules=run.model.rules,
        space=SearchSpace(**space),
        search=SearchOptions(**search),
    )


def fit_memory_budget(config: RunConfig) -> tuple[RunConfig, tuple[str, ...]]:
    """``config`` with what :func:`plan_run` chose for ``config.budget``: ``microbatches`` and
    ``remat`` (with ``mesh="auto"``, also the mesh and ``reduce``, over this process's devices,
    priced on ``config.accelerator``; where only the update inside the backward pass fits,
    ``update_in_backward="on"``), and one line a choice to say; as it is, and nothing to say, without
    a budget. :func:`leanstep.training.train` calls it before it builds the run.

    Raises:
      ValueError: nothing fits (the planner's BudgetError), or an invalid config; naming ``--budget``.
    """
    if config.budget is None:
        return config, ()
    auto = config.mesh == "auto"
    devices = {"num_devices": jax.device_count()} if auto else {}
    try:
        plan = plan_run(
            dataclasses.replace(config, mesh=None) if auto else config,
            config.budget,
            accelerator=config.accelerator,
            **devices,
        )
    except ValueError as error:  # BudgetError included: nothing fits
        raise ValueError(f"--budget: {error}") from None
    chosen, setting = plan.chosen, plan.chosen.setting
    layout: dict[str, Any] = {"mesh": setting.mesh, "reduce": setting.reduce} if setting.mesh else {}
    notes = [f"--budget {config.budget}: {plan.notes[0]}"] if setting.update_in_backward else []  # the first says why
    if setting.update_in_backward:
        layout["update_in_backward"] = "on"
    predicted = "" if chosen.predicted_seconds is None else f", predicted step {chosen.predicted_seconds * 1e3:.1f} ms"
    notes.append(
        f"--budget {config.budget}: chose {setting.describe()} (predicted peak "
        f"{chosen.peak_bytes:,} bytes{' per device' if setting.mesh else ''}{predicted})"
    )
    fitted = dataclasses.replace(config, microbatches=setting.num_microbatches, remat=setting.remat, **layout)
    return fitted.validate(), tuple(notes)


def _plan_one_device(config: RunConfig, budget_bytes: int | str | None, options: dict[str, Any]) -> Plan:
    """:func:`plan_run` on one device: ``options`` sorted into the planner's values."""
    run = build_run(dataclasses.replace(config, microbatches=1, remat="none"))  # both are planned here
    if budget_bytes is None:
        raise ValueError("a one-device plan needs a budget (bytes or a size such as 2GiB)")
    space, search, candidates = _planner_options(options, cluster=False)
    if space and candidates is not None:
        raise ValueError(f"give candidates= or {', '.join(f'{name}=' for name in space)}, not both")
    return plan(
        run.loss_fn,
        run.abstract_params(),
        run.batch_spec(),
        run.optimizer,
        run.step,  # the run's spec (the flags' one parse); its microbatches and remat are searched
        budget_bytes=budget_bytes,
        candidates=SearchSpace(**space) if space else candidates,
        search=SearchOptions(**search),
        stack=run.layer_stack(),  # where the standard step does not fit (None: the run cannot)
    )


def _planner_options(options: dict[str, Any], *, cluster: bool) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """``options`` sorted into the SearchSpace's fields, the SearchOptions' and ``candidates`` (one device).

    Raises:
      TypeError: any other option; a step setting is the config's, planned as the run trains it.
    """
    space, search, rest = split_options(options)
    candidates = None if cluster else rest.pop("candidates", None)
    if rest:
        raise TypeError(
            f"plan_run got the options {', '.join(f'{name}=' for name in sorted(rest))}: it takes the planner's "
            "search options (and candidates= on one device); the step's settings are the config's "
            "(dataclasses.replace(config, ...)), planned as the run trains with them"
        )
    return space, search, candidates


def _resolved(candidate: Any, precision: str) -> Any:
    """``candidate`` (a Setting or its tuple) with precision ``"auto"`` replaced by ``precision``."""
    if len(candidate) < 3 or candidate[2] != "auto":
        return candidate
    if hasattr(candidate, "_replace"):
        return candidate._replace(precision=precision)
    return (*candidate[:2], precision, *candidate[3:])


def _plan_in_child(
    config: RunConfig, budget_bytes: Any, num_devices: int, accelerator: Any, options: dict[str, Any]
) -> Plan:
    """:func:`plan_run` in a subprocess with ``num_devices`` simulated CPU devices."""
    import json
    import tempfile

    from leanstep.planning.cost_model import Accelerator
    from leanstep.sharding.distributed import run_on_simulated_cpus

    if isinstance(accelerator, Accelerator):
        accelerator = dataclasses.asdict(accelerator)
    options = {k: v for k, v in options.items() if k != "progress"}  # a callable: not sent to the child
    with tempfile.TemporaryDirectory() as folder:
        spec, out = f"{folder}/spec.json", f"{folder}/plan.json"
        with open(spec, "w") as f:
            json.dump(
                {
                    "config": config.to_json(),
                    "budget": budget_bytes,
                    "num_devices": num_devices,
                    "accelerator": accelerator,
                    "options": options,
                    "out": out,
                },
                f,
            )
        code = f"from leanstep.training.analysis import plan_in_child; plan_in_child({spec!r})"
        child = run_on_simulated_cpus(code)
        if child.returncode:
            error = child.stderr.strip().splitlines()[-1] if child.stderr.strip() else f"exit {child.returncode}"
            kind, _, message = error.partition(": ")
            if kind.endswith("BudgetError"):
                raise _budget_error(out, message)
            if kind.endswith("ValueError"):
                raise ValueError(message)
            raise RuntimeError(f"planning in a subprocess failed:\n{child.stderr[-3000:]}")
        with open(out) as f:
            return Plan.from_json(json.load(f))


def _budget_error(out: str, message: str) -> Exception:
    """The child's BudgetError, rebuilt from the candidates it wrote (or its message alone)."""
    import json
    import os

    if os.path.exists(out):
        with open(out) as f:
            value = json.load(f)
        plan_ = Plan.from_json({**value, "chosen": value["smallest"], "seconds": 0.0})
        return BudgetError(value["budget_bytes"], plan_.chosen, plan_.candidates)
    return ValueError(message)


def plan_in_child(spec_path: str) -> None:
    """The subprocess side of :func:`plan_run`: sets up the devices, plans, writes the plan as JSON."""
    import json

    from leanstep.planning.cost_model import Accelerator
    from leanstep.sharding.distributed import configure_devices

    with open(spec_path) as f:
        spec = json.load(f)
    configure_devices(spec["num_devices"])
    accelerator = spec["accelerator"]
    accelerator = Accelerator(**accelerator) if isinstance(accelerator, dict) else accelerator
    options = spec["options"]
    if "meshes" in options:
        options["meshes"] = [dict(m) for m in options["meshes"]]
    try:
        result = plan_run(
            RunConfig(**spec["config"]),
            spec["budget"],
            num_devices=spec["num_devices"],
            accelerator=accelerator,
            **options,
        )
    except BudgetError as error:
        with open(spec["out"], "w") as f:
            json.dump(
                {
                    "budget_bytes": error.budget_bytes,
                    "smallest": error.smallest.to_json(),
                    "candidates": [c.to_json() for c in error.candidates],
                },
                f,
            )
        raise
    with open(spec["out"], "w") as f:
        json.dump(result.to_json(), f)


def audit_run(config: RunConfig) -> AuditReport:
    """Audits the step ``config`` trains with (abstract inputs, nothing runs).

    The residuals are those of one microbatch's loss, in the compute dtype. The audit's rules are
    the gradient's (one scan over the microbatches, remat, the matmuls' dtypes), which the optimizer
    does not touch, so ``--optimizer muon`` is audited with AdamW in its place: the rules tell the
    optimizer's loops from the microbatch loop (:attr:`AuditReport.loop_candidates`), but Muon's
    Newton-Schulz matmuls, in float32, would fill the report's table of matmul dtypes.

    Raises:
      ValueError: an invalid config.

    Example:
      >>> report = audit_run(RunConfig(size="tiny", batch_size=4, microbatches=2, remat="dots"))
      >>> [s.length for s in report.top_level_scans], report.accumulation_violations(2)
      ([2], [])
    """
    run = build_run(dataclasses.replace(config, optimizer="adamw"))
    rows = config.batch_size // config.microbatches
    params_c = jax.eval_shape(run.precision.cast_to_compute, run.abstract_params())
    return audit(
        run.make_step(),
        run.abstract_state(),
        run.batch_spec(),
        loss_fn=run.precision.wrap(run.loss_fn()),
        loss_args=(params_c, run.batch_spec(rows)),
    )


def offload_audit_run(config: RunConfig) -> tuple[MemorySpaceReport, MemorySpaceReport]:
    """The memory spaces of the step ``config`` trains with, its state on the device and with the
    optimizer state offloaded (:func:`leanstep.step.offload_opt_state`): compiled, never run. The state
    is built (JAX traces an abstract array in host memory as one on the device).

    Example:
      >>> plain, offloaded = offload_audit_run(RunConfig(size="tiny", batch_size=4, microbatches=2))
      >>> plain.host_argument_bytes == 0 < offloaded.host_argument_bytes
      True
    """
    run = build_run(config)
    state = run.init_state()
    batch = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), run.batch_spec())
    step = run.make_step()
    return memory_space_report(step, state, batch), memory_space_report(step, offload_opt_state(state), batch)
