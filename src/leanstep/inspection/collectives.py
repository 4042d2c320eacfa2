r"""Every collective of a compiled step: its kind, bytes, mesh axes, trips per step and payload.

Read from the optimized HLO (``compiled.as_text()``), so it reports what XLA will run, not
what the program asked for. Per collective:

* **kind**: all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute, ...
  XLA:CPU writes a reduce-scatter as an all-reduce whose result is only ever sliced to one
  group member's share; such an all-reduce is reported as a reduce-scatter (``via`` says so).
* **bytes**: of the whole buffer one execution reduces or gathers (an all-reduce's result,
  an all-gather's result, a reduce-scatter's input), summed over a tuple's elements.
* **trips**: executions per step, the product of the trip counts of the while loops around
  it (XLA records each known trip count in the loop's backend config), through nested
  loops, fusions and calls.
* **axes**: the mesh axes its replica groups span (devices of one group differ along them).
* **payload**: ``"parameters"`` when every element is shaped like a parameter, one layer of
  a stacked parameter, or a shard of either (or a scalar); ``"batch"`` otherwise. A
  collective over a batch axis with a batch payload, or any all-to-all or
  collective-permute, **moves batch rows** (activations, token ids) between devices; over
  the tensor axis activations are expected to move.

.. code-block:: python

    report = collectives_report(step.lower(state, batch).compile(), mesh, params=state.params)
    print(report.table())

Size: one reader of optimized HLO: the parsing and the report it feeds are one concern.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from leanstep.inspection.hlo_text import Instruction as _Instruction
from leanstep.inspection.hlo_text import nbytes as _nbytes
from leanstep.inspection.hlo_text import parse_hlo as _parse
from leanstep.inspection.hlo_text import shapes_of as _shapes
from leanstep.inspection.hlo_text import trip_counts as _trips

__all__ = ["Collective", "CollectivesReport", "collectives_report"]

KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled module (see the module doc for the fields)."""

    kind: str
    name: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    bytes: int
    trips: int
    group_size: int
    axes: tuple[str, ...]
    payload: str
    moves_batch: bool
    via: str = ""

    @property
    def bytes_per_step(self) -> int:
        """``bytes * trips``."""
        return self.bytes * self.trips


@dataclasses.dataclass(frozen=True)
class CollectivesReport:
    """The collectives of one compiled step.

    Attributes:
      collectives: every collective, in the order of the HLO text.
    """

    collectives: tuple[Collective, ...]

    def of_kind(self, kind: str) -> tuple[Collective, ...]:
        """The collectives of one kind."""
        return tuple(c for c in self.collectives if c.kind == kind)

    def bytes_per_step(self, kind: str | None = None) -> int:
        """Bytes moved per step, of one kind or of all."""
        return sum(c.bytes_per_step for c in self.collectives if kind is None or c.kind == kind)

    def executions(self, kind: str | None = None) -> int:
        """Collective executions per step, of one kind or of all."""
        return sum(c.trips for c in self.collectives if kind is None or c.kind == kind)

    @property
    def moving_batch(self) -> tuple[Collective, ...]:
        """The collectives that move batch rows between devices."""
        return tuple(c for c in self.collectives if c.moves_batch)

    def table(self) -> str:
        """A plain-text table: one row per collective, then the totals per kind."""
        rows = [f"{'kind':<15}{'axes':<16}{'shape':<34}{'trips':>6}{'MB/exec':>10}{'MB/step':>10}  payload"]
        for c in self.collectives:
            shape = ", ".join(f"{dt}[{','.join(map(str, dims))}]" for dt, dims in c.shapes)
            shape = shape if len(shape) <= 32 else shape[:29] + "..."
            flag = " MOVES BATCH ROWS" if c.moves_batch else ""
            rows.append(
                f"{c.kind:<15}{','.join(c.axes) or '-':<16}{shape:<34}{c.trips:>6}{c.bytes / 1e6:>10.3f}"
                f"{c.bytes_per_step / 1e6:>10.3f}  {c.payload}{flag}"
            )
        for kind in dict.fromkeys(c.kind for c in self.collectives):
            rows.append(f"total {kind}: {self.executions(kind)} per step, {self.bytes_per_step(kind) / 1e6:.3f} MB")
        return "\n".join(rows)


def _braced(text: str) -> str:
    depth = 0
    for end, char in enumerate(text):
        depth += (char == "{") - (char == "}")
        if depth == 0:
            return text[: end + 1]
    return text


def _groups(inst: _Instruction, num_devices: int) -> list[list[int]]:
    """The replica groups, in any of XLA's three spellings (explicit, iota, mesh axes)."""
    if "source_target_pairs=" in inst.rest:
        pairs = _braced(inst.rest[inst.rest.index("source_target_pairs=") + 20 :])
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs)]
    at = inst.rest.find("replica_groups=")
    text = "" if at < 0 else inst.rest[at + 15 :]
    iota = re.match(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
    mesh = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", text)
    if iota:
        group_shape = [int(x) for x in iota.group(1).split(",")]
        dims = [int(x) for x in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return ids.reshape(group_shape[0], -1).tolist()
    if mesh:
        sizes = [(n, int(size)) for n, size in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))]
        over = set(re.findall(r"'([^']+)'", mesh.group(2)))
        ids = np.arange(math.prod(size for _, size in sizes)).reshape([size for _, size in sizes])
        axes = [i for i, (n, _) in enumerate(sizes) if n in over]
        rest = [i for i in range(len(sizes)) if i not in axes]
        return ids.transpose(rest + axes).reshape(-1, math.prod(sizes[i][1] for i in axes)).tolist()
    groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", _braced(text))]
    groups = [g for g in groups if g]
    return groups or [list(range(num_devices))]


def _hlo_text(compiled: Any) -> str:
    if isinstance(compiled, str):
        return compiled
    if not callable(getattr(compiled, "as_text", None)):
        raise TypeError(
            f"compiled must be a jax.stages.Compiled (jitted.lower(...).compile()) or HLO text (str), "
            f"got {type(compiled).__name__}"
        )
    return compiled.as_text()


def _check_mesh_fits(groups: list[list[int]], mesh: Mesh | None, hlo: str) -> None:
    """Refuses a ``mesh`` of fewer devices than the HLO's collectives name."""
    if mesh is None or not groups:
        return
    needed = max(max(g, default=-1) for g in groups) + 1
    partitions = re.search(r"num_partitions=(\d+)", hlo.split("\n", 1)[0])
    if partitions:
        needed = max(needed, int(partitions.group(1)))
    if needed > mesh.devices.size:
        raise ValueError(
            f"mesh has {mesh.devices.size} devices but the HLO's collectives span {needed}: pass the "
            "mesh the step was compiled for"
        )


def _axes_of(group: Sequence[int], mesh: Mesh | None) -> tuple[str, ...]:
    """The mesh axes along which a group's members differ. Replica-group ids are positions in
    the executable's device assignment, which is the mesh's devices in row-major order."""
    if mesh is None or len(group) < 2:
        return ()
    points = np.array(np.unravel_index(np.asarray(group, int), mesh.devices.shape)).T
    return tuple(name for i, name in enumerate(mesh.axis_names) if len(set(points[:, i])) > 1)


def _parameter_shapes(params: Any, mesh: Mesh | None) -> set[tuple[int, ...]]:
    divisors = {1}
    if mesh is not None:
        sizes = [int(s) for s in mesh.shape.values()]
        for r in range(1, len(sizes) + 1):
            divisors |= {math.prod(c) for c in itertools.combinations(sizes, r)}
    allowed: set[tuple[int, ...]] = {()}
    for leaf in jax.tree.leaves(params):
        shape = tuple(np.shape(leaf))
        for base in (shape, shape[1:]):
            for split in itertools.product(*[[n // d for d in divisors if n % d == 0] for n in base]):
                allowed.add(tuple(sorted(s for s in split if s != 1)))
    return allowed


def _element(name: str, index: int, users: dict[str, list[_Instruction]]) -> str | None:
    """The get-tuple-element that reads element ``index`` of ``name`` (None if none does)."""
    for use in users.get(name, []):
        if use.op == "get-tuple-element" and re.search(rf"index={index}\b", use.rest):
            return use.name
    return None


def _only_sliced(
    name: str,
    by_name: dict[str, _Instruction],
    users: dict[str, list[_Instruction]],
    computations: dict[str, list[_Instruction]],
    fraction: int,
    depth: int = 0,
) -> bool:
    """Whether ``name``'s value reaches nothing but slices of ``1/fraction`` of it."""
    size = _nbytes(_shapes(by_name[name].type_text)) if name in by_name else 0
    uses = users.get(name, [])
    if not uses or depth > 6:
        return False
    for use in uses:
        if use.op in ("dynamic-slice", "slice"):
            if _nbytes(_shapes(use.type_text)) * fraction != size:
                return False
        elif use.op in (
            "bitcast",
            "copy",
            "transpose",
            "get-tuple-element",
            "add",
            "multiply",
            "subtract",
            "divide",
            "convert",
        ):
            # elementwise on the whole reduced value (e.g. two reduced contributions summed)
            if _nbytes(_shapes(use.type_text)) != size and use.op != "convert":
                return False
            if not _only_sliced(use.name, by_name, users, computations, fraction, depth + 1):
                return False
        elif use.op == "fusion":
            callee = (use.attribute("calls") or "").lstrip("%")
            index = use.operands.index(name)
            params = [i for i in computations.get(callee, []) if i.op == "parameter" and i.rest.startswith(f"{index})")]
            inner_users: dict[str, list[_Instruction]] = {}
            for inst in computations.get(callee, []):
                for operand in inst.operands:
                    inner_users.setdefault(operand, []).append(inst)
            inner = {i.name: i for i in computations.get(callee, [])}
            if not params or not _only_sliced(params[0].name, inner, inner_users, computations, fraction, depth + 1):
                return False
        else:
            return False
    return True


def collectives_report(
    compiled: Any, mesh: Mesh | None = None, *, params: Any = None, batch_axes: Sequence[str] | None = None
) -> CollectivesReport:
    """The collectives of a compiled step (or of its HLO text).

    Args:
      compiled: a ``jax.stages.Compiled`` (``jitted.lower(...).compile()``) or HLO text.
      mesh: the mesh it was compiled for, to name each collective's axes; None: unnamed.
      params: the parameters (or their shapes), to tell parameter traffic from batch traffic;
        None: every non-scalar payload counts as a batch payload.
      batch_axes: the axes batch rows are split over; None: every axis but one named "tensor".

    Returns:
      A :class:`CollectivesReport`.

    Example:
      >>> hlo = '''ENTRY %main (p: f32[8]) -> f32[8] {
      ...   %p = f32[8]{0} parameter(0)
      ...   ROOT %r = f32[8]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
      ... }'''
      >>> report = collectives_report(hlo, params={"w": np.zeros(8)})
      >>> [(c.kind, c.bytes, c.trips, c.payload) for c in report.collectives]
      [('all-reduce', 32, 1, 'parameters')]
    """
    hlo = _hlo_text(compiled)
    computations, entry = _parse(hlo)
    if not entry:
        raise ValueError(
            "compiled must be a jax.stages.Compiled or HLO text with an ENTRY computation (as "
            f"Compiled.as_text() gives, from 'HloModule ...'); got text without one: {hlo[:60]!r}"
        )
    trips = _trips(computations, entry)
    by_name = {i.name: i for insts in computations.values() for i in insts}
    users: dict[str, list[_Instruction]] = {}
    for inst in by_name.values():
        for operand in inst.operands:
            users.setdefault(operand, []).append(inst)
    num_devices = 1 if mesh is None else mesh.devices.size
    if batch_axes is None:
        batch_axes = () if mesh is None else tuple(a for a in mesh.axis_names if a != "tensor")
    allowed = _parameter_shapes(params, mesh) if params is not None else {()}
    found = []
    for name, inst in by_name.items():
        op = inst.op.removesuffix("-start")
        if op not in KINDS or inst.op.endswith("-done"):
            continue
        shapes = _shapes(inst.type_text)
        if inst.op.endswith("-start") and op != "all-reduce":
            shapes = shapes[len(shapes) // 2 :]  # async (operands, results): the results
        groups = _groups(inst, num_devices)
        _check_mesh_fits(groups, mesh, hlo)
        group_size = max((len(g) for g in groups), default=1)
        axes = _axes_of(groups[0] if groups else (), mesh)
        over_batch = any(a in batch_axes for a in axes) or (mesh is None and group_size > 1)
        # A tuple collective (XLA combines small ones) is reported element by element.
        parts = (
            [(name, shapes, name)]
            if len(shapes) <= 1
            else [(f"{name}#{i}", (shape,), _element(name, i, users)) for i, shape in enumerate(shapes)]
        )
        for part_name, part_shapes, value in parts:
            kind, via, size = op, "", _nbytes(part_shapes)
            if (
                op == "all-reduce"
                and group_size > 1
                and value is not None
                and _only_sliced(value, by_name, users, computations, group_size)
            ):
                kind, via = "reduce-scatter", "all-reduce + slice"
            if op == "reduce-scatter":
                size *= group_size  # the input: every member's share
            parameter_like = all(tuple(sorted(d for d in dims if d != 1)) in allowed for _, dims in part_shapes)
            moves = op in ("all-to-all", "collective-permute", "ragged-all-to-all") or (
                over_batch and not parameter_like
            )
            found.append(
                Collective(
                    kind=kind,
                    name=part_name,
                    shapes=part_shapes,
                    bytes=size,
                    trips=trips.get(inst.computation, 0),
                    group_size=group_size,
                    axes=axes,
                    payload="parameters" if parameter_like else "batch",
                    moves_batch=moves,
                    via=via,
                )
            )
    return CollectivesReport(tuple(found))
