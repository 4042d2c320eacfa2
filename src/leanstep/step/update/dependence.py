r"""Which parameters each output of an optimizer's update depends on, read from its jaxpr.

The chunked update (:mod:`leanstep.step.update.chunks`) applies the optimizer to a few
parameters at a time. That gives the unchunked result only if the update of parameter ``i``
(and its slice of the state) depends on nothing shaped like another parameter, and, to split
parameter ``i`` along its leading axis, only if no value mixes its rows. Both are read from
``jax.make_jaxpr(optimizer.update)`` on abstract inputs (nothing runs), by propagating, for
every value, the parameters it depends on and the axis that carries their rows:

.. code-block:: text

    input  grads[i], params[i], state[i]     {i}, axis 0 (a leaf whose leading axis is not i's: rows mixed)
    input  scalar state (counts, schedules)  {} (shared by every chunk)
    elementwise / broadcast / reshape / ...  union of the operands' sets; the row axis followed
    a reduction, a dot, a sort over rows     rows mixed (a dot keeps them as a batch dimension of
                                             each operand that has them, or a free one of the only one)
    iota, random bits (of any shape)         {}, rows mixed: a value of its position, which a slice
                                             of rows would draw anew (optax.add_noise's noise)
    an unknown primitive                     union of the sets; rows mixed (conservative)

An output of parameter ``i`` that depends on another parameter, or a scalar (shared) output that
depends on any parameter, is a cross-parameter transformation (``optax.clip_by_global_norm``,
LAMB's trust ratio over the whole tree): the equation where two parameters first meet is named.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from jax._src import source_info_util  # the traceback of an equation: JAX has no public reader
from jax.extend import core as jex_core

from leanstep.common.jaxprs import ELEMENTWISE_PRIMITIVES

__all__ = ["Dep", "Dependence", "update_dependence"]

#: Primitives computed entry by entry (operands of the output's shape, or scalars): the FLOP
#: count's list, and those that cost no FLOP (conversions, copies, bit operations, the PRNG).
_ELEMENTWISE = ELEMENTWISE_PRIMITIVES | {
    "conj", "convert_element_type", "copy", "copy_p", "digamma", "eq_to", "le_to", "lt_to", "optimization_barrier",
    "population_count", "shift_left", "shift_right_arithmetic", "shift_right_logical", "threefry2x32",
}  # fmt: skip
_REDUCTIONS = frozenset(
    ["reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin"]
)
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
#: Primitives whose output is a function of each entry's position in it: computed for a slice of
#: rows, they give other values than the whole leaf's rows (noise drawn for ``g.shape``).
_POSITIONAL = frozenset(["iota", "random_bits", "rng_bit_generator", "rng_uniform"])


class Dep(NamedTuple):
    """What a value depends on: parameter indices, and the axis holding their rows (None: mixed)."""

    leaves: frozenset[int]
    axis: int | None


class Dependence(NamedTuple):
    """The dependence of an optimizer's update.

    Attributes:
      cross: None, or where a value of one parameter first meets another (or a shared output
        depends on a parameter): the transformation that needs the whole tree.
      rows: per parameter, whether its outputs keep its rows apart (it may be split along
        its leading axis).
    """

    cross: str | None
    rows: tuple[bool, ...]


def _join(deps: Sequence[Dep | None], shapes: Sequence[Any] | None = None, out_shape: Any = None) -> Dep | None:
    """The union of ``deps``; their common row axis where every one is aligned with ``out_shape``
    (``shapes`` None: where they agree; ``out_shape`` None: rows mixed)."""
    present = [(d, None if shapes is None else s) for d, s in zip(deps, shapes or [None] * len(deps)) if d is not None]
    if not present:
        return None
    leaves = frozenset().union(*(d.leaves for d, _ in present))
    if shapes is not None and out_shape is None:
        return Dep(leaves, None)
    axes = {
        d.axis if shapes is None or _aligned(tuple(s or ()), tuple(out_shape or ()), d.axis) else None
        for d, s in present
    }
    return Dep(leaves, axes.pop() if len(axes) == 1 else None)


def _aligned(shape: tuple[int, ...], out_shape: tuple[int, ...], axis: int | None) -> bool:
    """An operand of an elementwise primitive keeps its rows where the output has them (dims of 1 broadcast)."""
    if axis is None or len(shape) != len(out_shape) or shape[axis] != out_shape[axis]:
        return False
    return all(a == b or a == 1 for a, b in zip(shape, out_shape))


def _reshaped_axis(axis: int, before: tuple[int, ...], after: tuple[int, ...]) -> int | None:
    prefix = math.prod(before[:axis])
    for b in range(len(after)):
        if math.prod(after[:b]) == prefix and after[b] == before[axis]:
            return b
    return None


def _moved_axis(eqn: Any, dep: Dep, shape: tuple[int, ...]) -> int | None:
    """Where the row axis of the first operand lands in the output of a structural primitive."""
    name, p, axis = eqn.primitive.name, eqn.params, dep.axis
    out_shape = tuple(eqn.outvars[0].aval.shape)
    if axis is None:
        return None
    if name == "broadcast_in_dim":
        target = p["broadcast_dimensions"][axis]
        return target if out_shape[target] == shape[axis] else None
    if name == "reshape":
        return _reshaped_axis(axis, shape, out_shape)
    if name == "squeeze":
        return None if axis in p["dimensions"] else axis - sum(d < axis for d in p["dimensions"])
    if name == "transpose":
        return tuple(p["permutation"]).index(axis)
    if name in _REDUCTIONS:
        return None if axis in p["axes"] else axis - sum(d < axis for d in p["axes"])
    if name == "pad":
        return axis if tuple(p["padding_config"][axis]) == (0, 0, 0) else None
    if name in ("slice", "dynamic_slice"):
        return axis if out_shape[axis] == shape[axis] else None
    if name in ("concatenate", "dynamic_update_slice"):
        return axis if axis != p.get("dimension") and out_shape[axis] == shape[axis] else None
    return None


def _dot_axis(eqn: Any, deps: list[Dep | None]) -> int | None:
    """Where a ``dot_general`` keeps the rows: a batch dimension of every operand that has them (a
    per-layer matrix product: Muon's Newton-Schulz over a stack), or a free dimension of the one
    operand that has them (a product with a matrix of no parameter); None: mixed (contracted)."""
    (contracting, batch), ranks = eqn.params["dimension_numbers"], [len(v.aval.shape) for v in eqn.invars]
    free = [[d for d in range(r) if d not in contracting[i] and d not in batch[i]] for i, r in enumerate(ranks)]
    positions = set()
    for side, dep in enumerate(deps[:2]):
        if dep is None:
            continue
        if dep.axis is None or dep.axis in contracting[side]:
            return None
        if dep.axis in batch[side]:
            positions.add(tuple(batch[side]).index(dep.axis))
        else:  # the output: batch dimensions, the left operand's free ones, the right's
            positions.add(len(batch[0]) + (len(free[0]) if side else 0) + free[side].index(dep.axis))
    return positions.pop() if len(positions) == 1 else None


def _gather_axis(eqn: Any, operand: Dep | None, indices: Dep | None) -> Dep | None:
    """``table[indices]`` with a table that depends on no parameter keeps the indices' rows."""
    if operand is not None or indices is None:
        return _join([operand, indices], [(), ()])
    numbers = eqn.params["dimension_numbers"]
    index_shape = tuple(eqn.invars[1].aval.shape)
    out_rank = len(eqn.outvars[0].aval.shape)
    batch = [d for d in range(out_rank) if d not in numbers.offset_dims]
    ok = indices.axis is not None and indices.axis < len(index_shape) - 1 and not numbers.operand_batching_dims
    return Dep(indices.leaves, batch[indices.axis] if ok and indices.axis is not None else None)


def _sub_jaxpr(eqn: Any) -> Any:
    for key in _CALLS:
        inner = eqn.params.get(key)
        if inner is not None:
            return inner.jaxpr if hasattr(inner, "jaxpr") and not hasattr(inner, "eqns") else inner
    return None


def _loop(eqn: Any, ins: list[Dep | None], meet: list[str]) -> list[Dep | None]:
    """A scan (rows of ``xs`` are its iterations: mixed) or a while loop, to a fixed point of the carry."""
    name, p = eqn.primitive.name, eqn.params
    if name == "scan":
        body, consts, carries = p["jaxpr"].jaxpr, p["num_consts"], p["num_carry"]
        xs = [None if d is None else Dep(d.leaves, None if d.axis in (None, 0) else d.axis - 1) for d in ins]
        fixed, carry, xs = ins[:consts], ins[consts : consts + carries], xs[consts + carries :]
        for _ in range(len(carry) + 2):
            outs = _propagate(body, [*fixed, *carry, *xs], meet)
            joined = [_join([a, b]) for a, b in zip(carry, outs[:carries])]
            if joined == carry:
                break
            carry = joined
        ys = [None if d is None else Dep(d.leaves, None if d.axis is None else d.axis + 1) for d in outs[carries:]]
        return [*carry, *ys]
    # while: everything the loop reads may reach everything it carries
    everything = _join(ins, [()] * len(ins))
    return [everything for _ in eqn.outvars]


def _named(eqn: Any) -> str:
    """Where an equation was traced: its primitive, the functions that called it (innermost
    first, up to the caller of the optimizer), and the innermost file and line."""
    frames = list(source_info_util.user_frames(eqn.source_info.traceback))
    calls = [f.function_name for f in frames if "leanstep" not in f.file_name][:6]
    where = f" at {frames[0].file_name}:{frames[0].start_line}" if frames else ""
    return f"{eqn.primitive.name} in {' < '.join(calls)}{where}"


def _propagate(jaxpr: Any, ins: list[Dep | None], meet: list[str]) -> list[Dep | None]:
    """The dependence of ``jaxpr``'s outputs; ``meet`` collects where two parameters first meet."""
    env: dict[Any, Dep | None] = dict(zip(jaxpr.invars, ins))
    read = lambda v: None if isinstance(v, jex_core.Literal) else env.get(v)
    for eqn in jaxpr.eqns:
        deps = [read(v) for v in eqn.invars]
        shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
        name, inner = eqn.primitive.name, _sub_jaxpr(eqn)
        if inner is not None and name not in ("scan", "while"):
            outs = _propagate(inner, deps[len(deps) - len(inner.invars) :], meet)
        elif name in ("scan", "while"):
            outs = _loop(eqn, deps, meet)
        elif name == "cond":
            branches = [_propagate(b.jaxpr, deps[1:], meet) for b in eqn.params["branches"]]
            if deps[0] is None:  # an index of no parameter (lax.platform_dependent's): rows where the branches agree
                outs = [_join(list(column)) for column in zip(*branches)]
            else:
                outs = [_join([*column, deps[0]], [()] * (len(column) + 1)) for column in zip(*branches)]
        elif name == "optimization_barrier":
            outs = deps
        elif name in _POSITIONAL:
            outs = [Dep(frozenset(), None) if getattr(v.aval, "shape", ()) else None for v in eqn.outvars]
        elif name == "gather":
            outs = [_gather_axis(eqn, deps[0], deps[1])]
        elif name == "dot_general":
            joined = _join(deps, [()] * len(deps))
            outs = [None if joined is None else Dep(joined.leaves, _dot_axis(eqn, deps))]
        elif name in _ELEMENTWISE:
            outs = [_join(deps, shapes, tuple(v.aval.shape)) for v in eqn.outvars]
        else:
            first = next((d for d in deps if d is not None), None)
            joined = _join(deps, [()] * len(deps))
            axis = None
            if first is not None and sum(d is not None for d in deps) == 1:
                axis = _moved_axis(eqn, first, shapes[deps.index(first)])
            outs = [None if joined is None else Dep(joined.leaves, axis) for _ in eqn.outvars]
        for out in outs:
            if out is not None and len(out.leaves) > 1 and not meet:
                meet.append(_named(eqn))
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def update_dependence(update: Any, args: tuple[Any, ...], in_owners: list[Any], out_owners: list[Any]) -> Dependence:
    """The dependence of ``update(*args)``: ``in_owners``/``out_owners`` give, per flat input and
    output leaf, ``(index, rows)`` (the parameter it belongs to, and whether its leading axis is
    that parameter's rows) or None for a shared leaf."""
    closed = jax.make_jaxpr(update)(*args)
    ins = [None if o is None else Dep(frozenset({o[0]}), 0 if o[1] else None) for o in in_owners]
    meet: list[str] = []
    outs = _propagate(closed.jaxpr, ins, meet)
    count = 1 + max((o[0] for o in [*in_owners, *out_owners] if o is not None), default=-1)
    rows = [True] * count
    cross = None
    for dep, owner in zip(outs, out_owners):
        if dep is None or owner is None and not dep.leaves:  # a shared output of no parameter
            continue
        if owner is None or not dep.leaves <= {owner[0]}:
            cross = cross or (meet[0] if meet else "an output shared by all parameters depends on one of them")
            continue
        rows[owner[0]] = rows[owner[0]] and owner[1] and dep.axis == 0
    return Dependence(cross, tuple(rows))
