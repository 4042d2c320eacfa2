r"""A reader for XLA's optimized HLO text (``compiled.as_text()``): what compiled steps really do.

:func:`parse_hlo` splits a module into computations of :class:`Instruction`; :func:`trip_counts`
says how many times each computation runs per call of the entry (the product of the known trip
counts of the while loops around it, through fusions and calls); :func:`dot_flops` adds up the
matrix-multiply FLOPs of one device's program:

.. code-block:: text

    dot   2 * prod(result shape) * prod(contracted sizes of the left operand)   x trips

Used by :func:`leanstep.inspection.collectives_report` (collectives) and :func:`leanstep.planning.one_device`
(per-device FLOPs of a sharded step, which the traced program cannot give: it is global).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax

__all__ = ["ITEMSIZE", "Instruction", "compiled_text", "dot_flops", "nbytes", "parse_hlo", "shapes_of", "trip_counts"]

#: Bytes per element of HLO's element types.
ITEMSIZE = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s*\(.*\{\s*$")


def shapes_of(type_text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``(element type, dims)`` of every array in an HLO type (a tuple type has several).

    Example:
      >>> shapes_of("(f32[8,4]{1,0}, bf16[3]{0})")
      (('f32', (8, 4)), ('bf16', (3,)))
    """
    return tuple(
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _SHAPE.findall(type_text)
        if dtype in ITEMSIZE
    )


def nbytes(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> int:
    """Bytes of the arrays :func:`shapes_of` lists."""
    return sum(ITEMSIZE[dtype] * math.prod(dims) for dtype, dims in shapes)


@dataclasses.dataclass
class Instruction:
    """One HLO instruction: ``%name = type_text op(rest``, in ``computation``."""

    name: str
    type_text: str
    op: str
    rest: str
    computation: str

    @property
    def operands(self) -> list[str]:
        """Names of the operands (inside the op's parentheses)."""
        depth, end = 1, 0
        for end, char in enumerate(self.rest):
            depth += char == "("
            depth -= char == ")"
            if depth == 0:
                break
        return re.findall(r"%([^\s,()]+)", self.rest[:end])

    def attribute(self, key: str) -> str | None:
        """The text of attribute ``key=...`` (None when absent)."""
        match = re.search(key + r"=(%[^\s,]+|\{[^}]*\}[^,]*|[^\s,]+)", self.rest)
        return match.group(1) if match else None

    def dimensions(self, key: str) -> tuple[int, ...]:
        """The dimension list of attribute ``key`` (``lhs_contracting_dims={0,2}``: ``(0, 2)``; absent: ``()``)."""
        match = re.search(key + r"=\{([0-9,]*)\}", self.rest)
        return tuple(int(d) for d in match.group(1).split(",") if d) if match else ()


def compiled_text(compiled: jax.stages.Compiled) -> str:
    """``compiled.as_text()``, the optimized HLO; a RuntimeError where the backend has none (JAX allows None)."""
    text = compiled.as_text()
    if text is None:
        raise RuntimeError("the backend gives no HLO text of the compiled program (as_text() returned None)")
    return text


def parse_hlo(hlo: str) -> tuple[dict[str, list[Instruction]], str]:
    """``({computation name: instructions}, entry computation name)`` of an HLO module's text."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        match = _INSTRUCTION.match(line)
        if match:
            name, type_text, op, rest = match.groups()
            computations[current].append(Instruction(name, type_text, op, rest, computation=current))
    return computations, entry


def trip_counts(computations: dict[str, list[Instruction]], entry: str) -> dict[str, int]:
    """Executions per call of the entry of every computation reachable from it.

    A while loop's body runs its known trip count (XLA records it in the loop's backend
    config; 1 when unknown) times per execution of the loop.
    """
    edges: dict[str, list[tuple[str, int]]] = {}
    for name, instructions in computations.items():
        for inst in instructions:
            if inst.op == "while":
                count = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.rest)
                n = int(count.group(1)) if count else 1
                targets = [(inst.attribute(k) or "", n) for k in ("body", "condition")]
            else:
                targets = [
                    (t, 1)
                    for k in ("calls", "to_apply", "branch_computations")
                    for t in re.findall(r"%([^\s,{}]+)", inst.attribute(k) or "")
                ]
            edges.setdefault(name, []).extend((t.lstrip("%"), n) for t, n in targets if t.lstrip("%") in computations)
    # The call graph is a DAG: count in topological order, so every caller is done first.
    order: list[str] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        for callee, _ in edges.get(name, []):
            visit(callee)
        order.append(name)

    visit(entry)
    trips = {name: 0 for name in order}
    trips[entry] = 1
    for name in reversed(order):
        for callee, n in edges.get(name, []):
            trips[callee] += trips[name] * n
    return trips


def dot_flops(hlo: str | Any) -> float:
    """Matrix-multiply FLOPs of one device's compiled program, each times its trips per step.

    Args:
      hlo: a ``jax.stages.Compiled`` or its ``as_text()``.

    Example:
      >>> hlo = '''ENTRY %main (a: f32[2,3], b: f32[3,4]) -> f32[2,4] {
      ...   %a = f32[2,3]{1,0} parameter(0)
      ...   %b = f32[3,4]{1,0} parameter(1)
      ...   ROOT %d = f32[2,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      ... }'''
      >>> dot_flops(hlo)  # 2 * (2 * 4) * 3
      48.0
    """
    text = hlo if isinstance(hlo, str) else hlo.as_text()
    computations, entry = parse_hlo(text)
    trips = trip_counts(computations, entry)
    flops = 0.0
    for name, instructions in computations.items():
        if not trips.get(name):
            continue
        types = {inst.name: inst.type_text for inst in instructions}
        for inst in instructions:
            if inst.op != "dot":
                continue
            lhs = shapes_of(types.get(inst.operands[0], "")) if inst.operands else ()
            if not lhs:
                continue
            contracted = math.prod(lhs[0][1][d] for d in inst.dimensions("lhs_contracting_dims"))
            flops += 2.0 * math.prod(shapes_of(inst.type_text)[0][1]) * contracted * trips[name]
    return flops
