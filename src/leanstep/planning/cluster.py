r"""Plan a cluster before running: mesh, microbatches, remat and gradient reduction for a per-device budget.

For ``N`` devices the candidates are every mesh ``data x fsdp x tensor = N`` (the tensor axis
at most one node, :attr:`Accelerator.node_size`, and only where the model's partition rules
fit it), every microbatch count that divides each device's rows, every remat policy and the
reductions ``"auto"`` and ``"step"`` (:class:`leanstep.ShardingLayer`). A candidate is traced
and compiled for ``N`` devices (simulated CPU devices; nothing runs) and read three ways:

.. code-block:: text

    peak       = arguments + outputs - aliased + temporaries    (memory_analysis(), per device)
    flops      = dot FLOPs of the compiled per-device program   (leanstep.inspection.hlo_text.dot_flops)
    bytes      = every collective, with its trips per step      (leanstep.collectives_report)
    predicted  = compute + communication seconds                (leanstep.planning.cost_model)

and the chosen setting is the one predicted fastest among those that fit the budget.

The search compiles few candidates. A *family* is a mesh, remat policy and reduction; its
members differ in the microbatch count. Before compiling, every family gets

* its argument bytes (the sharded state and batch, exactly: from the shardings), so a mesh
  whose state alone exceeds the budget is never compiled;
* a lower bound of each member's predicted time: the whole step's dot FLOPs (traced once per remat
  policy on one device) split over ``N`` devices, plus the collectives any implementation
  of its layout needs at their bandwidth-optimal cost (:func:`leanstep.planning.cluster_grid.communication`), plus, for a
  tensor axis, the least tensor-axis communication seen so far on a mesh of that tensor size
  (activations: the same rows per device, so the same traffic, whatever the data x fsdp split);
* an estimate (the bound plus the per-microbatch gathers and reductions at the links their
  axes use), which orders the families.

Families are compiled in estimate order (re-estimated as tensor-axis costs are seen), grouped by mesh and reduction; in a group the
remat policies go from the least recompute (``none``) to the most. In each family the
fewest microbatches are tried first, then the most (if they do not fit, none do), then
bisected, since more microbatches never raise activation memory. Once a policy fits with
``m`` microbatches, the group's later policies are tried only with fewer than ``m``: with
as many they recompute more (more FLOPs and, under remat, the same collectives again), so
they cannot be faster. A family is skipped unseen when its bound is within ``rtol`` of the
best predicted time found (it cannot win by more than ``rtol``), or when a family with the
same rows per device and a larger fsdp axis did not fit (a larger fsdp axis never raises
parameter memory). So, under these two monotonicity assumptions, the chosen setting's
predicted time is within ``rtol`` of the best of every candidate, compiled or not;
``exhaustive=True`` compiles them all to check.

What the plan cannot know: the memory numbers are XLA:CPU's buffer assignment, which an
accelerator's compiler (other fusions, other layouts) can move by some percent; the time is
the stated model's (:mod:`leanstep.planning.cost_model`), not a measurement; collectives that span
nodes are priced as one ring at the slower link, though NCCL and XLA build hierarchical ones.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from leanstep.blocks.loss_scale import LossScale
from leanstep.blocks.loss_scale_registry import get_loss_scale
from leanstep.blocks.precision import get_precision
from leanstep.blocks.rematerialization import REMAT_POLICIES, get_remat_policy
from leanstep.common.memory_sizes import format_bytes, parse_bytes
from leanstep.inspection.collectives import collectives_report
from leanstep.inspection.flops import count_flops
from leanstep.inspection.hlo_text import dot_flops
from leanstep.planning.candidates import (
    abstract_tree,
    compile_candidate,
    compiler_options_for,
    first_fit,
)
from leanstep.planning.cluster_grid import (
    Family,
    argument_bytes,
    communication,
    dominates,
    format_seconds,
    layout_sizes,
    mesh_shapes,
    mesh_text,
)
from leanstep.planning.cost_model import Accelerator, get_accelerator, step_cost
from leanstep.planning.records import BudgetError, Candidate, Plan, Setting, known
from leanstep.sharding.meshes import batch_sharding
from leanstep.step.sharding_layer import REDUCTIONS, ShardingLayer
from leanstep.step.state import TrainState
from leanstep.step.train_step import make_train_step

__all__ = ["plan_cluster"]


def _devices(num_devices: int) -> list[Any]:
    for devices in (jax.devices(), jax.devices("cpu")):
        if len(devices) >= num_devices:
            return sorted(devices, key=lambda d: (d.process_index, d.id))[:num_devices]
    raise ValueError(
        f"num_devices={num_devices}: this process has {len(jax.devices('cpu'))} CPU device(s); planning compiles "
        f"for {num_devices} simulated CPU devices, so call leanstep.configure_devices({num_devices}) before JAX "
        f"starts (or use `leanstep plan --devices {num_devices}`, or leanstep.training.analysis.plan_run, which "
        "plans in a subprocess)"
    )


def plan_cluster(
    make_loss_fn: Callable[[str], Callable[..., Any]],
    params: Any,
    batch: Any,
    optimizer: optax.GradientTransformation,
    *,
    num_devices: int,
    budget_bytes: int | str | None = None,
    accelerator: str | Accelerator = "h100",
    rules: Any = None,
    meshes: Sequence[dict[str, int]] | None = None,
    remat_policies: Iterable[str] = REMAT_POLICIES,
    reductions: Iterable[str] = ("auto", "step"),
    microbatches: Iterable[int] | None = None,
    precision: str = "float32",
    max_grad_norm: float | None = None,
    loss_scale: str | LossScale = "none",
    rtol: float = 0.02,
    exhaustive: bool = False,
    compiler_options: dict[str, Any] | str | None = "auto",
    keep_executables: bool = False,
    progress: Callable[[str], None] | None = None,
    **step_kwargs: Any,
) -> Plan:
    """Plans mesh, microbatches, remat and reduction for ``num_devices`` devices (see the module doc).

    Args:
      make_loss_fn: ``make_loss_fn(remat_policy) -> loss_fn(params, batch)``; the model may call
        :func:`leanstep.gathered` and :func:`leanstep.constrain` (ZeRO-3 per-layer gathers).
      params, batch: arrays or ``jax.ShapeDtypeStruct`` (shapes only); ``batch`` is the global batch.
      optimizer: the run's optimizer.
      num_devices: the cluster's device count; this process must have that many (CPU) devices.
      budget_bytes: memory per device (a size string such as ``"80GiB"``); default the accelerator's.
      accelerator: a preset name (:data:`leanstep.planning.cost_model.ACCELERATORS`) or an :class:`Accelerator`.
      rules: the model's partition rules (:mod:`leanstep.sharding.partition_rules`).
      meshes: the mesh shapes to consider; default :func:`mesh_shapes` up to one node of tensor.
      remat_policies, reductions, microbatches: the other axes of the grid (microbatch counts
        that do not divide a mesh's rows per device are left out for that mesh).
      precision, max_grad_norm, loss_scale, step_kwargs: as the run's :func:`leanstep.make_train_step`.
      rtol: predicted times within this fraction count as equal (the search's pruning margin).
      exhaustive: compile every candidate.
      compiler_options: as :func:`leanstep.plan`.
      keep_executables: keep every compiled executable (default: only the chosen one's).
      progress: called with a line after each compile.

    Returns:
      A :class:`leanstep.Plan` with ``num_devices`` and ``accelerator`` set.

    Raises:
      BudgetError: nothing fits (names the smallest per-device peak found and its setting).
      ValueError: too few devices, a bad budget, grid or accelerator.
    """
    start = time.perf_counter()
    if step_kwargs.get("has_state"):
        raise ValueError("plan_cluster plans stateless losses; a model state (has_state=True) is not supported yet")
    accelerator = get_accelerator(accelerator)
    budget = parse_bytes(accelerator.memory_bytes if budget_bytes is None else budget_bytes)
    if not (isinstance(rtol, (int, float)) and 0 <= rtol < 1):
        raise ValueError(f"rtol must be a number in [0, 1), got {rtol!r}")
    devices = _devices(num_devices)
    batch_size = {np.shape(leaf)[0] for leaf in jax.tree.leaves(batch)}
    if len(batch_size) != 1:
        raise ValueError(f"batch leaves must share one leading batch axis, got {sorted(batch_size)}")
    (batch_size,) = batch_size
    shapes = (
        list(meshes) if meshes is not None else mesh_shapes(num_devices, batch_size, max_tensor=accelerator.node_size)
    )
    for shape in shapes:
        if math.prod(shape.values()) != num_devices:
            raise ValueError(f"mesh {shape} does not have num_devices={num_devices} devices")
    policies = list(remat_policies)
    for policy in policies:
        get_remat_policy(policy)
    reductions = list(reductions)
    for reduce in reductions:
        if reduce not in REDUCTIONS:
            raise ValueError(f"reductions must be among {REDUCTIONS}, got {reduce!r}")
    counts = None if microbatches is None else sorted(set(microbatches))
    compute_dtype = get_precision(precision).compute_dtype
    compiler_options = compiler_options_for(compiler_options, devices[0].platform)
    scale = get_loss_scale(loss_scale)
    params, batch = abstract_tree(params), abstract_tree(batch)
    state = jax.eval_shape(lambda p: TrainState.create(p, optimizer, loss_scale=scale), params)
    loss_fns = {policy: make_loss_fn(policy) for policy in policies}

    # The whole step's dot FLOPs, once per policy, on one device: the compute part of every bound.
    global_flops = {}
    for policy in policies:
        step = make_train_step(loss_fns[policy], precision=precision, max_grad_norm=max_grad_norm, **step_kwargs)
        global_flops[policy] = count_flops(step.trace(state, batch).jaxpr, dots_only=True)
    rate = accelerator.peak_flops(compute_dtype) * accelerator.efficiency

    candidates: list[Candidate] = []
    families: list[Family] = []
    meshes_by_text: dict[str, Mesh] = {}
    placed: dict[str, tuple[Any, Any]] = {}
    invalid: list[Candidate] = []
    for shape in shapes:
        text = mesh_text(shape)
        mesh = Mesh(np.asarray(devices).reshape(tuple(shape.values())), tuple(shape))
        layer = ShardingLayer(mesh, rules=rules)
        try:
            shardings = layer.state_shardings(state)
            specs = layer.param_specs(params)
        except ValueError as error:  # the rules do not fit this mesh (e.g. heads not divisible by tensor)
            invalid.append(
                Candidate(Setting(1, policies[0], precision, text, reductions[0]), note=f"rules do not fit: {error}")
            )
            continue
        meshes_by_text[text] = mesh
        rows = batch_sharding(mesh)
        placed[text] = (
            jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings),
            jax.tree.map(lambda a, r=rows: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=r), batch),
        )
        arguments = argument_bytes(state, shardings, batch, rows)
        d, f, t = (shape.get(k, 1) for k in ("data", "fsdp", "tensor"))
        per_device_rows = batch_size // (d * f)
        sizes = layout_sizes(params, specs, shape, compute_dtype)
        for reduce in reductions:
            if reduce == "step" and f == 1:
                continue  # the same step as "auto" without an fsdp axis
            for policy in policies:
                ms = [
                    m
                    for m in range(1, per_device_rows + 1)
                    if per_device_rows % m == 0 and (counts is None or m in counts)
                ]
                if not ms:
                    continue
                first = len(candidates)
                candidates += [Candidate(Setting(m, policy, precision, text, reduce)) for m in ms]
                compute_bound = global_flops[policy] / num_devices / rate
                bounds = [
                    compute_bound + communication(shape, reduce, m, policy, sizes, accelerator, bound=True) for m in ms
                ]
                family = Family(shape, policy, reduce, list(range(first, len(candidates))), arguments, bounds[0])
                families.append(family)
                for i, b in zip(family.members, bounds):
                    candidates[i] = dataclasses.replace(candidates[i], argument_bytes=arguments, bound_seconds=b)
                family.estimate = compute_bound + communication(
                    shape, reduce, ms[0], policy, sizes, accelerator, bound=False
                )

    if not families:
        raise ValueError(
            f"no candidate for {num_devices} devices: " + "; ".join(f"mesh {c.setting.mesh}: {c.note}" for c in invalid)
            if invalid
            else f"no mesh of {num_devices} devices splits the batch of {batch_size} rows"
        )

    compiles: dict[int, Any] = {}
    tensor_costs: dict[int, float] = {}

    def compile_at(i: int) -> Candidate:
        c = candidates[i]
        s = c.setting
        t0 = time.perf_counter()
        mesh = meshes_by_text[s.mesh]
        step = make_train_step(
            loss_fns[s.remat],
            precision=s.precision,
            num_microbatches=s.num_microbatches,
            max_grad_norm=max_grad_norm,
            mesh=ShardingLayer(mesh, rules=rules, reduce=s.reduce),
            **step_kwargs,
        )
        placed_state, placed_batch = placed[s.mesh]
        traced = step.trace(placed_state, placed_batch)
        c = dataclasses.replace(c, trace_seconds=time.perf_counter() - t0)
        c = compile_candidate(c, traced, budget, compiler_options)
        hlo = c.executable.as_text()  # once: printing a large module takes seconds
        report = collectives_report(hlo, mesh, params=state.params)
        cost = step_cost(
            dot_flops(hlo),
            report,
            dict(mesh.shape),
            accelerator,
            compute_dtype,
            promoted_to_float32=devices[0].platform == "cpu",
        )
        c = dataclasses.replace(
            c,
            flops=cost.flops,
            bytes_per_step=cost.bytes,
            collectives=cost.collectives,
            compute_seconds=cost.compute_seconds,
            communication_seconds=cost.communication_seconds,
            predicted_seconds=cost.seconds,
            compile_seconds=time.perf_counter() - t0 - (c.trace_seconds or 0.0),
            executable=c.executable if keep_executables else None,
        )
        compiles[i] = c.executable
        tensor_costs[i] = sum(v for axes, v in cost.by_axes.items() if axes == ("tensor",))
        candidates[i] = c
        if progress is not None:
            progress(
                f"compiled {s.describe()}: peak {format_bytes(c.peak_bytes)}, predicted "
                f"{format_seconds(cost.seconds)} (bound {format_seconds(known(c.bound_seconds))}), "
                f"{c.compile_seconds:.1f} s"
            )
        return c

    def fits(i: int) -> bool:
        return bool((candidates[i] if candidates[i].compiled else compile_at(i)).fits)

    best: Candidate | None = None
    failed: list[Family] = []
    # Collectives over the tensor axis move activations; they depend on the tensor size and the
    # rows per device, the same for every mesh of that tensor size, so the least seen so far for
    # a tensor size is added to the bound of the meshes of that size not compiled yet.
    tensor_seen: dict[int, float] = {}

    def tensor_part(fam: Family) -> float:
        return tensor_seen.get(fam.shape.get("tensor", 1), 0.0) if fam.shape.get("tensor", 1) > 1 else 0.0

    groups: dict[tuple[str, str], list[Family]] = {}
    for fam in families:
        groups.setdefault((mesh_text(fam.shape), fam.reduce), []).append(fam)
    pending = list(groups.values())
    for group in pending:
        group.sort(key=lambda fam: global_flops[fam.remat])  # the least recompute first
    while pending:
        # Next: the group whose first policy is estimated fastest, with what has been seen so far.
        group = min(pending, key=lambda g: g[0].estimate + tensor_part(g[0]))
        pending.remove(group)
        fewest, fitted_policy = None, ""  # the fewest microbatches a policy of this group fits with, and it
        for fam in group:
            note = ""
            bound = fam.bound + tensor_part(fam)
            # Members that could still win: fewer microbatches than a cheaper policy fitted with,
            # and a bound (which grows with the count under per-microbatch reductions) below the best.
            members = [
                i
                for i in fam.members
                if (fewest is None or candidates[i].setting.num_microbatches < fewest)
                and (
                    best is None
                    or (known(candidates[i].bound_seconds) + tensor_part(fam)) * (1 + rtol)
                    < known(best.predicted_seconds)
                )
            ]
            if fam.argument_bytes > budget:
                note = f"state and batch alone take {format_bytes(fam.argument_bytes)} a device"
            elif not exhaustive and not members and fewest is not None:
                note = f"more recompute than remat {fitted_policy} at no fewer microbatches"
            elif not exhaustive and any(dominates(g, fam) for g in failed):
                note = "does not fit: the same rows with a larger fsdp axis did not"
            elif not exhaustive and not members:
                note = f"bound {format_seconds(bound)} is not below the best found"
            if note:
                for i in fam.members:
                    candidates[i] = dataclasses.replace(candidates[i], note=note)
                continue
            if exhaustive:
                fitting = [i for i in fam.members if fits(i)]
                found = fitting[0] if fitting else None
            else:
                found = first_fit(members, fits)
            t = fam.shape.get("tensor", 1)
            for i in fam.members:
                c = candidates[i]
                if c.compiled and t > 1:
                    tensor_seen[t] = min(tensor_seen.get(t, math.inf), tensor_costs[i])
            if found is None:
                if len(members) == len(fam.members):  # even the most microbatches do not fit
                    failed.append(fam)
                continue
            fewest, fitted_policy = candidates[found].setting.num_microbatches, fam.remat
            for i in fam.members:
                if (
                    candidates[i].compiled
                    and candidates[i].fits
                    and (best is None or known(candidates[i].predicted_seconds) < known(best.predicted_seconds))
                ):
                    best = candidates[i]

    if best is None:
        compiled = [c for c in candidates if c.compiled]
        if not compiled:  # every mesh's state alone exceeds the budget: compile the leanest once, for its peak
            leanest = min(families, key=lambda fam: fam.argument_bytes)
            compiled = [compile_at(leanest.members[-1])]
        smallest = min(compiled, key=lambda c: known(c.peak_bytes))
        raise BudgetError(budget, smallest, tuple(candidates + invalid))

    chosen_index = candidates.index(best)
    if not keep_executables and chosen_index in compiles:
        candidates[chosen_index] = dataclasses.replace(best, executable=compiles[chosen_index])
    chosen = candidates[chosen_index]
    for i, c in enumerate(candidates):
        if i == chosen_index or c.note:
            continue
        if c.compiled and not c.fits:
            note = f"peak {format_bytes(c.peak_bytes)} over the budget"
        elif c.compiled:
            seconds = known(c.predicted_seconds)
            note = f"predicted {format_seconds(seconds)}, {seconds / known(chosen.predicted_seconds) - 1:+.1%}"
        elif c.bound_seconds is not None and c.bound_seconds * (1 + rtol) >= known(chosen.predicted_seconds):
            note = f"bound {format_seconds(c.bound_seconds)} is not below the best found"
        else:
            note = "fewer microbatches fit"
        candidates[i] = dataclasses.replace(c, note=note)
    order = {id(c): k for k, c in enumerate(candidates)}
    ranked = tuple(
        sorted(candidates, key=lambda c: (c.predicted_seconds is None, c.predicted_seconds or 0.0, order[id(c)]))
    ) + tuple(invalid)
    return Plan(budget, ranked, chosen, time.perf_counter() - start, num_devices, accelerator)
