r"""Every matrix multiply of a compiled program, read from its optimized HLO text: :func:`list_matmuls`.

Each ``dot`` and ``convolution`` becomes a :class:`MatmulOp` with its operand shapes, its
dimension numbers, the fusion that runs it (XLA:CPU wraps most dots in a ``kCustom`` fusion
whose kind names the library, e.g. ``__ynn_fusion``) and how often it runs per call of the
program: the product of the known trip counts of the ``while`` loops around it
(:func:`leanstep.inspection.hlo_text.trip_counts`; ``lax.scan`` over layers and over microbatches both
become such loops). :func:`list_loops` lists those loops and their trip counts, and
:func:`count_executed_ops` counts the kernels the runtime launches per call.
:func:`standalone_matmul` rebuilds one op as a program of its own, to time it alone.

.. code-block:: text

    dot          2 * prod(result dims) * prod(contracted dims of lhs)
    convolution  2 * prod(result dims) * prod(kernel dims) / kernel output features
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from leanstep.inspection.hlo_text import Instruction, compiled_text, parse_hlo, shapes_of, trip_counts

__all__ = [
    "Loop",
    "MatmulOp",
    "count_executed_ops",
    "list_loops",
    "list_matmuls",
    "repeated_matmul",
    "standalone_matmul",
]

Shape = tuple[str, tuple[int, ...]]
#: Ops that move no data at run time (tuple plumbing, reinterpretations).
_FREE_OPS = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant"})
_DTYPES = {
    "f32": jnp.float32,
    "bf16": jnp.bfloat16,
    "f16": jnp.float16,
    "f64": jnp.float64,
    "s8": jnp.int8,
    "s32": jnp.int32,
    "u8": jnp.uint8,
}


@dataclasses.dataclass(frozen=True)
class MatmulOp:
    """One ``dot`` or ``convolution`` of a compiled program.

    Attributes:
      name: the HLO instruction's name.
      op: ``"dot"`` or ``"convolution"``.
      computation: the computation that holds it.
      lhs, rhs, result: ``(element type, dims)`` of the operands and the result.
      dimension_numbers: for a dot ``(lhs_contracting, rhs_contracting, lhs_batch, rhs_batch)``;
        for a convolution ``(window text, dim_labels, feature_group_count, batch_group_count)``.
      trips: executions per call of the program.
      fusion: the fusion instruction that calls ``computation`` (None: not fused).
      fusion_kind: that fusion's kind (``kCustom:__ynn_fusion``, ``kOutput``, ...), or None.
      fused_ops: the other ops fused with it (``parameter`` and ``bitcast`` left out).
    """

    name: str
    op: str
    computation: str
    lhs: Shape
    rhs: Shape
    result: Shape
    dimension_numbers: tuple
    trips: int
    fusion: str | None = None
    fusion_kind: str | None = None
    fused_ops: tuple[str, ...] = ()

    @property
    def flops(self) -> float:
        """FLOPs of one execution (a multiply-add is 2)."""
        if self.op == "dot":
            contracted = math.prod(self.lhs[1][d] for d in self.dimension_numbers[0])
        else:
            labels = self.dimension_numbers[1].split("_")[1].split("->")[0]
            contracted = math.prod(self.rhs[1]) // self.rhs[1][labels.index("o")]
        return 2.0 * math.prod(self.result[1]) * contracted

    @property
    def total_flops(self) -> float:
        """FLOPs of all its executions per call: ``flops * trips``."""
        return self.flops * self.trips

    @property
    def key(self) -> tuple:
        """What fixes its standalone cost: op, shapes, element types and dimension numbers."""
        return (self.op, self.lhs, self.rhs, self.result, self.dimension_numbers)


@dataclasses.dataclass(frozen=True)
class Loop:
    """One ``while`` loop: its name, the computation holding it, its body, its known trip count
    (None when XLA did not record one), how often the loop itself runs per call, and the JAX op it
    came from (the last part of its ``op_name``: ``while`` for a scan or a fori loop,
    ``scatter-add`` for a scatter that XLA:CPU's older emitters expand into a loop)."""

    name: str
    computation: str
    body: str
    trip_count: int | None
    runs: int
    source: str = ""


def _callers(computations: dict[str, list[Instruction]]) -> dict[str, Instruction]:
    """``{fused computation: the fusion instruction calling it}``."""
    callers = {}
    for instructions in computations.values():
        for inst in instructions:
            if inst.op == "fusion":
                for target in re.findall(r"%([^\s,{}]+)", inst.attribute("calls") or ""):
                    callers[target] = inst
    return callers


def _fusion_kind(inst: Instruction) -> str:
    kind = inst.attribute("kind") or "?"
    custom = re.search(r'"fusion_config":\{"kind":"([^"]+)"', inst.rest)
    return f"{kind}:{custom.group(1)}" if custom else kind


def list_matmuls(hlo: str) -> list[MatmulOp]:
    r"""Every dot and convolution of an optimized HLO module, with its trips per call.

    Ops in computations that never run from the entry (trips 0) are left out.

    Args:
      hlo: the text of ``jax.stages.Compiled.as_text()``.

    Returns:
      The ops, in the order of the text.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def f(a, b):  # a loop of 3 trips around one (8, 4) @ (4, 2)
      ...     return jax.lax.fori_loop(0, 3, lambda i, c: c + jnp.sin(a * i) @ b, jnp.zeros((8, 2)))
      >>> hlo = jax.jit(f).lower(jnp.ones((8, 4)), jnp.ones((4, 2))).compile().as_text()
      >>> [(m.op, m.lhs[1], m.rhs[1], m.trips, m.flops) for m in list_matmuls(hlo)]
      [('dot', (8, 4), (4, 2), 3, 128.0)]
    """
    computations, entry = parse_hlo(hlo)
    trips = trip_counts(computations, entry)
    callers = _callers(computations)
    ops = []
    for name, instructions in computations.items():
        if not trips.get(name):
            continue
        types = {inst.name: inst.type_text for inst in instructions}
        caller = callers.get(name)
        others = tuple(i.op for i in instructions if i.op not in ("parameter", "bitcast", "dot", "convolution"))
        for inst in instructions:
            if inst.op not in ("dot", "convolution") or len(inst.operands) < 2:
                continue
            lhs, rhs = (shapes_of(types.get(operand, "")) for operand in inst.operands[:2])
            if not lhs or not rhs:
                continue
            if inst.op == "dot":
                numbers: tuple = tuple(
                    inst.dimensions(key)
                    for key in ("lhs_contracting_dims", "rhs_contracting_dims", "lhs_batch_dims", "rhs_batch_dims")
                )
            else:
                window = re.search(r"window=\{([^}]*)\}", inst.rest)
                numbers = (
                    window.group(1) if window else "",
                    inst.attribute("dim_labels") or "",
                    int(inst.attribute("feature_group_count") or 1),
                    int(inst.attribute("batch_group_count") or 1),
                )
            ops.append(
                MatmulOp(
                    inst.name,
                    inst.op,
                    name,
                    lhs[0],
                    rhs[0],
                    shapes_of(inst.type_text)[0],
                    numbers,
                    trips[name],
                    fusion=caller.name if caller else None,
                    fusion_kind=_fusion_kind(caller) if caller else None,
                    fused_ops=others if caller else (),
                )
            )
    return ops


def _op_name(rest: str) -> str:
    found = re.search(r'op_name="([^"]*)"', rest)
    return found.group(1) if found else ""


def list_loops(hlo: str) -> list[Loop]:
    """Every ``while`` loop that runs, with its known trip count (from its backend config).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = lambda x: jax.lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=5)[0]
      >>> [loop.trip_count for loop in list_loops(jax.jit(f).lower(jnp.ones(3)).compile().as_text())]
      [5]
    """
    computations, entry = parse_hlo(hlo)
    trips = trip_counts(computations, entry)
    loops = []
    for name, instructions in computations.items():
        for inst in instructions:
            if inst.op == "while" and trips.get(name):
                count = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.rest)
                loops.append(
                    Loop(
                        inst.name,
                        name,
                        (inst.attribute("body") or "").lstrip("%"),
                        int(count.group(1)) if count else None,
                        trips[name],
                        _op_name(inst.rest).rsplit("/", 1)[-1],
                    )
                )
    return loops


def count_executed_ops(hlo: str) -> int:
    """Ops the runtime executes per call (one kernel each): those outside fusions, times their trips.

    Fusion bodies and reduction computations are not counted (their fusion or reduce is);
    tuple plumbing, bitcasts, constants and parameters are free and not counted either. A
    loop's condition is counted once per trip (it runs one more time).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def ops(trips):  # per trip: sin, the counter's add, the dot's fusion, a copy, the condition
      ...     f = lambda x: jax.lax.fori_loop(0, trips, lambda i, c: jnp.sin(c) @ c, x)
      ...     return count_executed_ops(jax.jit(f).lower(jnp.ones((8, 8))).compile().as_text())
      >>> ops(4), ops(8)
      (23, 43)
    """
    computations, entry = parse_hlo(hlo)
    trips = trip_counts(computations, entry)
    executed, stack = set(), [entry]
    while stack:  # the entry, loop bodies and conditions, called computations and branches
        name = stack.pop()
        if name in executed or name not in computations:
            continue
        executed.add(name)
        for inst in computations[name]:
            keys = {
                "while": ("body", "condition"),
                "call": ("to_apply",),
                "conditional": ("branch_computations", "true_computation", "false_computation"),
            }
            for key in keys.get(inst.op, ()):
                stack.extend(re.findall(r"%([^\s,{}]+)", inst.attribute(key) or ""))
    return sum(trips.get(name, 0) for name in executed for inst in computations[name] if inst.op not in _FREE_OPS)


def _conv_arguments(op: MatmulOp) -> dict[str, Any]:
    """``lax.conv_general_dilated`` keywords of an HLO convolution (window and dim_labels)."""
    window, labels, features, batches = op.dimension_numbers
    lhs, rhs, out = re.split(r"_|->", labels)
    spatial = sum(c.isdigit() for c in lhs)
    fields = dict(item.split("=") for item in window.split() if "=" in item)

    def sizes(key: str, default: str) -> list[str]:
        return fields.get(key, "x".join([default] * spatial)).split("x")

    def spec(text: str, first: str, second: str) -> tuple[int, ...]:
        return (text.index(first), text.index(second), *(text.index(str(d)) for d in range(spatial)))

    return {
        "window_strides": [int(s) for s in sizes("stride", "1")],
        "padding": [tuple(int(p) for p in pair.split("_")) for pair in sizes("pad", "0_0")],
        "lhs_dilation": [int(s) for s in sizes("lhs_dilate", "1")],
        "rhs_dilation": [int(s) for s in sizes("rhs_dilate", "1")],
        "dimension_numbers": jax.lax.ConvDimensionNumbers(
            spec(lhs, "b", "f"), spec(rhs, "o", "i"), spec(out, "b", "f")
        ),
        "feature_group_count": features,
        "batch_group_count": batches,
    }


def standalone_matmul(op: MatmulOp) -> tuple[jax.stages.Wrapped, tuple[jax.Array, jax.Array]]:
    """``fn(lhs, rhs, n)``: what ``op`` does, ``n`` times in one compiled loop, and random operands for it.

    A jitted ``lax.dot_general`` (or ``conv_general_dilated``) with ``op``'s operand shapes,
    element types, dimension numbers and result type, run ``n`` (an int32 scalar) times
    under ``lax.fori_loop``, the last result returned. The loop runs the op as the step's
    loops do, without a host dispatch per call (which costs more than a small matmul); an
    optimization barrier on the operands keeps XLA from hoisting the op out of the loop.

    Example:
      >>> op = MatmulOp("d", "dot", "main", ("f32", (2, 8, 4)), ("f32", (2, 4, 3)), ("f32", (2, 8, 3)),
      ...               ((2,), (1,), (0,), (0,)), trips=1)
      >>> fn, args = standalone_matmul(op)
      >>> fn(*args, 3).shape
      (2, 8, 3)
    """
    rng = np.random.default_rng(0)  # NumPy: a jitted random draw would compile once per shape
    lhs, rhs = (
        jnp.asarray(rng.standard_normal(dims, np.float32).astype(_DTYPES[dtype])) for dtype, dims in (op.lhs, op.rhs)
    )
    result = _DTYPES[op.result[0]]
    if op.op == "dot":
        lhs_contracting, rhs_contracting, lhs_batch, rhs_batch = op.dimension_numbers
        numbers = ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))

        def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
            return jax.lax.dot_general(a, b, numbers, preferred_element_type=result)
    else:
        kwargs = _conv_arguments(op)

        def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
            return jax.lax.conv_general_dilated(a, b, preferred_element_type=result, **kwargs)

    def repeated(a: jax.Array, b: jax.Array, n: jax.Array) -> jax.Array:
        def body(_: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
            a, b = jax.lax.optimization_barrier(carry[:2])
            return a, b, matmul(a, b)

        zeros = jnp.zeros(op.result[1], result)
        return jax.lax.fori_loop(0, n, body, (a, b, zeros))[2]

    return jax.jit(repeated), (lhs, rhs)


def repeated_matmul(op: MatmulOp, *, min_call_s: float = 0.02) -> tuple[Callable[[], Any], int, tuple[str, ...]]:
    """``(call, n, kinds)``: ``call()`` runs ``op`` alone ``n`` times (:func:`standalone_matmul`), to completion.

    ``n`` doubles from 1 until one call takes ``min_call_s``, so a call's time over ``n`` is
    one execution's, host dispatch spread thin. ``kinds`` lists the fusion kinds of the
    standalone program's matmuls, to compare with the step's.

    Example:
      >>> op = MatmulOp("d", "dot", "main", ("f32", (8, 4)), ("f32", (4, 2)), ("f32", (8, 2)),
      ...               ((1,), (0,), (), ()), trips=1)
      >>> call, n, kinds = repeated_matmul(op, min_call_s=1e-3)
      >>> call().shape, n >= 1
      ((8, 2), True)
    """
    fn, (lhs, rhs) = standalone_matmul(op)
    compiled = fn.lower(lhs, rhs, jnp.int32(1)).compile()
    kinds = tuple(sorted({m.fusion_kind or "unfused" for m in list_matmuls(compiled_text(compiled))}))

    def runner(count: int) -> Callable[[], Any]:
        n = jnp.int32(count)
        return lambda: compiled(lhs, rhs, n).block_until_ready()

    def seconds(count: int) -> float:
        start = time.perf_counter()
        runner(count)()
        return time.perf_counter() - start

    count = 1
    while seconds(count) < min_call_s and count < 2**20:
        count *= 2
    return runner(count), count, kinds
