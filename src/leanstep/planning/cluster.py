r"""Plan a cluster before running: mesh, microbatches, remat and gradient reduction for a per-device budget.

For ``N`` devices the candidates are every mesh ``data x fsdp x tensor = N`` (the tensor axis
at most one node, :attr:`Accelerator.node_size`, and only where the model's partition rules
fit it), every microbatch count that divides each device's rows, every remat policy and the
reductions ``"auto"`` and ``"step"`` (:class:`leanstep.step.ShardingLayer`). A candidate is traced
and compiled for ``N`` devices (simulated CPU devices; nothing runs) and read three ways:

.. code-block:: text

    peak       = arguments + outputs - aliased + temporaries    (memory_analysis(), per device)
    flops      = dot FLOPs of the compiled per-device program   (leanstep.inspection.hlo_text.dot_flops)
    bytes      = every collective, with its trips per step      (leanstep.inspection.collectives_report)
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
``SearchOptions(exhaustive=True)`` compiles them all to check. The search itself is
:mod:`leanstep.planning.cluster_search`, a state and small pure functions; the compiles are
:mod:`leanstep.planning.cluster_compile`.

What the plan cannot know: the memory numbers are XLA:CPU's buffer assignment, which an
accelerator's compiler (other fusions, other layouts) can move by some percent; the time is
the stated model's (:mod:`leanstep.planning.cost_model`), not a measurement; collectives that span
nodes are priced as one ring at the slower link, though NCCL and XLA build hierarchical ones.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax

from leanstep.common.memory_sizes import parse_bytes
from leanstep.common.removed import refuses_removed_keywords
from leanstep.planning.candidates import abstract_tree, compiler_options_for
from leanstep.planning.cluster_compile import ClusterCompiler, place_meshes, step_flops
from leanstep.planning.cluster_grid import Family, families_of, mesh_shapes
from leanstep.planning.cluster_search import Limits, SearchState, final_row, rank, run_search, start, strip
from leanstep.planning.cost_model import Accelerator, get_accelerator
from leanstep.planning.fp8_sizes import fp8_notes
from leanstep.planning.plan_inputs import (
    abstract_state,
    candidate_spec,
    is_params_builder,
    plan_spec,
    state_format_notes,
)
from leanstep.planning.records import BudgetError, Candidate, Plan, Setting, known
from leanstep.planning.search_options import SearchOptions, SearchSpace
from leanstep.step.spec import StepSpec
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


def _batch_size(batch: Any) -> int:
    sizes = {np.shape(leaf)[0] for leaf in jax.tree.leaves(batch)}
    if len(sizes) != 1:
        raise ValueError(f"batch leaves must share one leading batch axis, got {sorted(sizes)}")
    return int(next(iter(sizes)))


def _mesh_shapes(space: SearchSpace, num_devices: int, batch_size: int, node_size: int) -> list[dict[str, int]]:
    shapes = (
        list(space.meshes) if space.meshes is not None else mesh_shapes(num_devices, batch_size, max_tensor=node_size)
    )
    for shape in shapes:
        if math.prod(shape.values()) != num_devices:
            raise ValueError(f"mesh {shape} does not have num_devices={num_devices} devices")
    return shapes


@refuses_removed_keywords("plan_cluster")
def plan_cluster(
    make_loss_fn: Callable[[str], Callable[..., Any]],
    params: Any,
    batch: Any,
    optimizer: optax.GradientTransformation,
    spec: StepSpec | None = None,
    *,
    num_devices: int,
    budget_bytes: int | str | None = None,
    accelerator: str | Accelerator = "h100",
    rules: Any = None,
    space: SearchSpace | None = None,
    search: SearchOptions | None = None,
) -> Plan:
    """Plans mesh, microbatches, remat and reduction for ``num_devices`` devices (see the module doc).

    Args:
      make_loss_fn: ``make_loss_fn(remat_policy) -> loss_fn(params, batch)``; the model may call
        :func:`leanstep.sharding.gathered` and :func:`leanstep.sharding.constrain` (ZeRO-3 per-layer gathers).
      params: arrays or ``jax.ShapeDtypeStruct`` (shapes only).
      batch: arrays or ``jax.ShapeDtypeStruct`` (shapes only): the global batch.
      optimizer: the run's optimizer.
      spec: the run's :class:`leanstep.StepSpec` (None: ``StepSpec()``): its precision is every
        candidate's; its microbatch count is searched and its layout is each candidate mesh's; the
        state is built from it (loss scale, masters, moments, spike guard). ``StepSpec.from_keywords``
        makes one of :func:`leanstep.make_train_step`'s keywords (0.11's ``plan_cluster(...,
        max_grad_norm=...)``: a TypeError names that spelling).
      num_devices: the cluster's device count; this process must have that many (CPU) devices.
      budget_bytes: memory per device (a size string such as ``"80GiB"``); default the accelerator's.
      accelerator: a preset name (:data:`leanstep.planning.cost_model.ACCELERATORS`) or an :class:`Accelerator`.
      rules: the model's partition rules (:mod:`leanstep.sharding.partition_rules`).
      space: what to try (:class:`leanstep.planning.search_options.SearchSpace`): meshes (default
        :func:`mesh_shapes` up to one node of tensor), remat policies, reductions and microbatch
        counts (those that do not divide a mesh's rows per device are left out for that mesh).
      search: how (:class:`leanstep.planning.search_options.SearchOptions`): ``rtol`` is the
        pruning margin (predicted times within it count as equal), ``exhaustive`` compiles every
        candidate, ``keep_executables`` keeps every executable (default: only the chosen one's),
        ``progress`` is called with a line after each compile.
        0.8.0's flat search keywords (``meshes=``, ``rtol=``, ``exhaustive=``, ...) were removed
        in 0.12: a TypeError names their place in ``space=`` or ``search=``.

    Returns:
      A :class:`leanstep.planning.Plan` with ``num_devices`` and ``accelerator`` set.

    Raises:
      BudgetError: nothing fits (names the smallest per-device peak found and its setting).
      ValueError: too few devices, a bad budget, grid or accelerator; a model state (``has_state``).
      TypeError: ``spec`` not a StepSpec.
    """
    start_time = time.perf_counter()
    space = SearchSpace() if space is None else space
    search = SearchOptions() if search is None else search
    if not isinstance(space, SearchSpace):
        raise TypeError(f"space must be a SearchSpace, got {type(space).__name__}")
    if is_params_builder(params):
        raise ValueError(
            "a params builder (params=policy -> params) plans one device; plan_cluster takes one params tree"
        )
    spec = plan_spec(spec)
    if spec.loss.has_state:
        raise ValueError("plan_cluster plans stateless losses; a model state (has_state=True) is not supported yet")
    spec, precision = _unplaced(spec), str(spec.precision)
    accelerator = get_accelerator(accelerator)
    budget = parse_bytes(accelerator.memory_bytes if budget_bytes is None else budget_bytes)
    devices = _devices(num_devices)
    batch_size = _batch_size(batch)
    shapes = _mesh_shapes(space, num_devices, batch_size, accelerator.node_size)
    compute_dtype = spec.precision.compute_dtype
    params, batch = abstract_tree(params), abstract_tree(batch)
    state = abstract_state(params, optimizer, spec, None)
    loss_fns = {policy: make_loss_fn(policy) for policy in space.remat_policies}
    # The whole step's dot FLOPs, once per policy, on one device: the compute part of every bound.
    flops = step_flops(loss_fns, state, batch, spec)
    rate = accelerator.peak_flops(compute_dtype) * accelerator.efficiency
    compute = {policy: f / num_devices / rate for policy, f in flops.items()}
    placed, errors = place_meshes(shapes, devices, params, state, batch, rules, compute_dtype)
    candidates: list[Candidate] = []
    families: list[Family] = []
    for where in placed.values():
        found, new = families_of(where.layout, space, precision, compute, accelerator, len(candidates))
        candidates, families = candidates + found, families + new
    reduce = (space.reductions or ("auto",))[0]
    invalid = tuple(
        Candidate(Setting(1, space.remat_policies[0], precision, text, reduce), note=f"rules do not fit: {error}")
        for text, error in errors.items()
    )
    if not families and space.max_microbatches is not None and not invalid:
        raise ValueError(
            f"no microbatch count of the rows per device is within SearchSpace.max_microbatches="
            f"{space.max_microbatches} on any mesh of {num_devices} devices; raise the bound"
        )
    if not families:
        raise ValueError(
            f"no candidate for {num_devices} devices: " + "; ".join(f"mesh {c.setting.mesh}: {c.note}" for c in invalid)
            if invalid
            else f"no mesh of {num_devices} devices splits the batch of {batch_size} rows"
        )
    compile_one = ClusterCompiler(
        loss_fns=loss_fns,
        placed=placed,
        params=state.params,
        rules=rules,
        budget=budget,
        accelerator=accelerator,
        compute_dtype=compute_dtype,
        compiler_options=compiler_options_for(search.compiler_options, devices[0].platform),
        spec=spec,
        progress=search.progress,
    )
    limits = Limits(budget, search.rtol, search.exhaustive)
    searched = run_search(start(candidates, families, flops), limits, compile_one)
    chosen, rows = _finish(searched, families, invalid, limits, search, compile_one, space.max_microbatches)
    s = chosen.setting  # its step traced on one device (nothing compiled), for the FP8 figures
    step = make_train_step(loss_fns[s.remat], candidate_spec(spec, s))
    notes = fp8_notes(state, step.trace(state, batch).jaxpr) + state_format_notes(params, optimizer, spec, None)
    return Plan(budget, rows, chosen, time.perf_counter() - start_time, num_devices, accelerator, notes)


def _unplaced(spec: StepSpec) -> StepSpec:
    """``spec`` without a layout (each candidate's is its mesh's) and with one microbatch (the count
    is searched), its microbatches strided where a spec made for one device has them contiguous: as
    a run on a mesh takes them (no row moves between devices; :meth:`leanstep.StepSpec.from_keywords`
    on a mesh)."""
    split = spec.accumulation.split
    split = "strided" if spec.sharding is None and split == "contiguous" else split
    return spec.replace(
        sharding=None, accumulation=dataclasses.replace(spec.accumulation, num_microbatches=1, split=split)
    )


def _finish(
    state: SearchState,
    families: Sequence[Family],
    invalid: tuple[Candidate, ...],
    limits: Limits,
    search: SearchOptions,
    compile_one: ClusterCompiler,
    max_microbatches: int | None,
) -> tuple[Candidate, tuple[Candidate, ...]]:
    """The chosen candidate and the plan's rows (ranked, then ``invalid``).

    Raises:
      BudgetError: nothing fits; where nothing was compiled (every mesh's state alone exceeds
        the budget), the leanest family is compiled once, for its peak. It names
        ``max_microbatches`` where the space bounded the count.
    """
    keep_executables = search.keep_executables
    if state.best is None:
        candidates = list(state.candidates)
        if not any(c.compiled for c in candidates):
            i = min(families, key=lambda family: family.argument_bytes).members[-1]
            candidates[i] = compile_one(candidates[i]).candidate
        candidates = [strip(c, keep_executables) for c in candidates]
        smallest = min((c for c in candidates if c.compiled), key=lambda c: known(c.peak_bytes))
        raise BudgetError(limits.budget, smallest, tuple(candidates) + invalid, max_microbatches)
    chosen = state.candidates[state.best]
    rows = [
        c if i == state.best else strip(final_row(c, chosen, limits.rtol), keep_executables)
        for i, c in enumerate(state.candidates)
    ]
    return chosen, rank(rows) + invalid
