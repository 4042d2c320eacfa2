r"""The candidate space of a cluster plan, and what each layout costs before anything compiles.

:func:`mesh_shapes` lists the meshes of ``N`` devices; for one layout :func:`argument_bytes`
gives the exact per-device bytes of the sharded state and batch, :func:`layout_sizes` the
gradient and parameter bytes its collectives move, and :func:`communication` prices them
(:mod:`leanstep.planning.cost_model`) as the lower bound or the estimate that
:func:`leanstep.planning.cluster.plan_cluster` searches with. :class:`Family` is one mesh,
remat policy and reduction, its members differing in the microbatch count.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from leanstep.common.checks import is_int
from leanstep.planning.cost_model import Accelerator, collective_seconds
from leanstep.planning.records import Candidate, Setting

__all__ = [
    "Family",
    "Layout",
    "argument_bytes",
    "communication",
    "dominates",
    "families_of",
    "format_seconds",
    "layout_sizes",
    "mesh_shapes",
    "mesh_text",
]


def mesh_shapes(num_devices: int, batch_size: int, *, max_tensor: int | None = None) -> list[dict[str, int]]:
    """Every ``{"data": d, "fsdp": f, "tensor": t}`` with ``d * f * t == num_devices``, ``d * f``
    dividing ``batch_size`` and ``t <= max_tensor``; axes of size 1 are left out, except a data
    axis where there is no fsdp axis (the batch axis of the mesh).

    Example:
      >>> mesh_shapes(4, 8, max_tensor=2)
      [{'data': 4}, {'data': 2, 'fsdp': 2}, {'fsdp': 4}, {'data': 2, 'tensor': 2}, {'fsdp': 2, 'tensor': 2}]
      >>> mesh_shapes(2, 1)
      [{'data': 1, 'tensor': 2}]
    """
    for name, value in (("num_devices", num_devices), ("batch_size", batch_size)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    shapes = []
    for t in (t for t in range(1, num_devices + 1) if num_devices % t == 0 and (max_tensor is None or t <= max_tensor)):
        rows = num_devices // t
        for f in (f for f in range(1, rows + 1) if rows % f == 0):
            d = rows // f
            if batch_size % (d * f) == 0:
                shape = {k: v for k, v in (("data", d), ("fsdp", f), ("tensor", t)) if v > 1 or k == "data"}
                shapes.append(shape if d > 1 or f == 1 else {k: v for k, v in shape.items() if k != "data"})
    return shapes


def format_seconds(seconds: float) -> str:
    """``0.0123 -> '12.3 ms'``."""
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def mesh_text(shape: dict[str, int]) -> str:
    """``{"data": 2, "fsdp": 4} -> "data=2,fsdp=4"`` (the form of ``leanstep train --mesh``)."""
    return ",".join(f"{k}={v}" for k, v in shape.items())


def argument_bytes(state: Any, shardings: Any, batch: Any, rows: Any) -> int:
    """Per-device bytes of the state (laid out by ``shardings``) and the batch (by ``rows``):
    the arguments of the compiled step, known without compiling it."""
    return sum(_nbytes(a, s) for a, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings))) + sum(
        _nbytes(a, rows) for a in jax.tree.leaves(batch)
    )


def layout_sizes(params: Any, specs: Any, shape: dict[str, int], compute_dtype: Any) -> dict[str, float]:
    """Per-device bytes a layout's collectives move: the float32 gradient over the tensor axis
    (``gradient``) and over tensor and fsdp (``shard``), and the compute-dtype parameters that are
    split over fsdp, over the tensor axis (``gathered``)."""
    t, f = shape.get("tensor", 1), shape.get("fsdp", 1)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    sizes = {"gradient": 0.0, "shard": 0.0, "gathered": 0.0}
    for leaf, spec in zip(jax.tree.leaves(params), spec_leaves):
        axes = _spec_axes(spec)
        tensor, fsdp = (t if "tensor" in axes else 1), (f if "fsdp" in axes else 1)
        sizes["gradient"] += 4 * math.prod(leaf.shape) / tensor
        sizes["shard"] += 4 * math.prod(leaf.shape) / tensor / fsdp
        if "fsdp" in axes:
            sizes["gathered"] += np.dtype(compute_dtype).itemsize * math.prod(leaf.shape) / tensor
    return sizes


def _nbytes(leaf: Any, sharding: Any = None) -> int:
    shape = tuple(leaf.shape) if sharding is None else tuple(sharding.shard_shape(tuple(leaf.shape)))
    return math.prod(shape) * leaf.dtype.itemsize


def _spec_axes(spec: PartitionSpec) -> set[str]:
    found: set[str] = set()
    for entry in spec:
        found |= {entry} if isinstance(entry, str) else set(entry or ())
    return found


@dataclasses.dataclass(frozen=True)
class Layout:
    """What one mesh's layout costs, known before compiling: the facts a family is built from.

    Attributes:
      shape: the mesh shape.
      rows: batch rows per device.
      argument_bytes: per-device bytes of the sharded state and batch (:func:`argument_bytes`).
      sizes: the bytes its collectives move (:func:`layout_sizes`).
    """

    shape: dict[str, int]
    rows: int
    argument_bytes: int
    sizes: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Family:
    """One mesh, remat policy and reduction; ``members`` index its candidates (by microbatch count).

    ``bound`` is its fewest-microbatch member's lower bound, ``estimate`` that member's estimate
    (:func:`communication`, plus the compute bound of the policy).
    """

    shape: dict[str, int]
    remat: str
    reduce: str
    members: tuple[int, ...]
    argument_bytes: int = 0
    bound: float = 0.0
    estimate: float = 0.0


def families_of(
    layout: Layout,
    space: Any,
    precision: str,
    compute_seconds: dict[str, float],
    accelerator: Accelerator,
    first: int = 0,
) -> tuple[list[Candidate], list[Family]]:
    """The candidates and families of one layout, with their bounds (no compiling).

    Args:
      layout: the mesh's :class:`Layout`.
      space: the :class:`leanstep.planning.search_options.SearchSpace` (its policies, counts and reductions).
      precision: every candidate's precision.
      compute_seconds: by policy, the step's dot FLOPs over all devices at the FLOP rate (the compute bound).
      accelerator: prices the communication.
      first: the index of the first new candidate in the plan's list.

    Example:
      >>> from leanstep.planning.cost_model import get_accelerator
      >>> from leanstep.planning.search_options import SearchSpace
      >>> layout = Layout({"data": 2}, rows=4, argument_bytes=100, sizes={"shard": 0.0})
      >>> found, families = families_of(
      ...     layout, SearchSpace(["none"], [1, 2, 3]), "float32", {"none": 0.5}, get_accelerator("h100"))
      >>> [c.setting.num_microbatches for c in found], families[0].members, families[0].bound
      ([1, 2], (0, 1), 0.5)
    """
    candidates: list[Candidate] = []
    families: list[Family] = []
    text, counts = mesh_text(layout.shape), None if space.microbatches is None else set(space.microbatches)
    ms = [
        m
        for m in range(1, layout.rows + 1)
        if layout.rows % m == 0 and (counts is None or m in counts) and space.allows(m, layout.rows)
    ]
    for reduce in space.reductions or ("auto", "step"):
        if reduce == "step" and layout.shape.get("fsdp", 1) == 1:
            continue  # the same step as "auto" without an fsdp axis
        for policy in space.remat_policies if ms else ():

            def seconds(m: int, bound: bool, policy: str = policy, reduce: str = reduce) -> float:
                comm = communication(layout.shape, reduce, m, policy, layout.sizes, accelerator, bound=bound)
                return compute_seconds[policy] + comm

            start = first + len(candidates)
            bounds = [seconds(m, True) for m in ms]
            candidates += [
                Candidate(
                    Setting(m, policy, precision, text, reduce), argument_bytes=layout.argument_bytes, bound_seconds=b
                )
                for m, b in zip(ms, bounds)
            ]
            members = tuple(range(start, first + len(candidates)))
            estimate = seconds(ms[0], False)
            families.append(Family(layout.shape, policy, reduce, members, layout.argument_bytes, bounds[0], estimate))
    return candidates, families


def communication(
    shape: dict[str, int],
    reduce: str,
    m: int,
    remat: str,
    sizes: dict[str, float],
    accelerator: Accelerator,
    *,
    bound: bool,
) -> float:
    """Seconds of the collectives a layout needs, priced by :func:`leanstep.planning.cost_model.collective_seconds`.

    ``bound=True``: what the layout must send under leanstep's schedule, at the
    bandwidth-optimal cost and without latency: the per-device gradient shard all-reduced over
    the data axis (every microbatch for ``reduce="microbatch"``), the gradient reduce-scattered
    over the fsdp axis and the fsdp-split parameters all-gathered, once per step for
    ``reduce="step"``, else once per microbatch (ZeRO-3: the accumulator is sharded, each layer
    is gathered where it is used; XLA does not hoist these out of the microbatch loop).
    (Merged into one collective over both axes, the gradient reduction costs the same: the
    terms add up to it.)
    ``bound=False``: an estimate that orders the search: leanstep's own schedule, with the
    per-microbatch reduce-scatters and gathers (twice under remat: forward and recompute).
    """
    links = accelerator.replace(latency=0.0) if bound else accelerator
    d, f = shape.get("data", 1), shape.get("fsdp", 1)
    per_step = reduce == "step"
    seconds = 0.0
    if d > 1:
        seconds += collective_seconds(
            "all-reduce", sizes["shard"], d, ("data",), shape, links, trips=m if reduce == "microbatch" else 1
        )
    if f > 1:
        seconds += collective_seconds(
            "reduce-scatter", sizes["gradient"], f, ("fsdp",), shape, links, trips=1 if per_step else m
        )
        gathers = 1 if per_step else m * (1 if remat == "none" or bound else 2)
        seconds += collective_seconds("all-gather", sizes["gathered"], f, ("fsdp",), shape, links, trips=gathers)
    return seconds


def dominates(failed: Family, family: Family) -> bool:
    """``failed`` did not fit at its most microbatches; ``family`` has the same rows per device
    and tensor axis, the same policy and reduction, and no larger fsdp axis: it holds more."""
    rows = lambda s: s.get("data", 1) * s.get("fsdp", 1)
    return (failed.remat, failed.reduce, failed.shape.get("tensor", 1), rows(failed.shape)) == (
        family.remat,
        family.reduce,
        family.shape.get("tensor", 1),
        rows(family.shape),
    ) and (family.shape.get("fsdp", 1) <= failed.shape.get("fsdp", 1))
