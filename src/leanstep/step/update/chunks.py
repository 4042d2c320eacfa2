r"""The optimizer applied a chunk at a time, so that one chunk's float32 widening is live at once.

The unchunked update widens every master and every compressed moment to float32 in one program,
and XLA keeps those temporaries live together: with bfloat16 masters and 8-bit moments the step's
peak rises above float32 state's. Here the parameters are cut into chunks of at most
``update_chunk`` entries, in order:

.. code-block:: text

    small leaves         packed into one chunk while they fit
    a leaf too large     split along its leading axis (the transformer's stacked layers): a
                         fori_loop over slices of rows, each read, updated and written in place
    a layer too large    the stack's leaves in groups of at least two, a row of each at most
                         ``update_chunk`` entries where one leaf's row allows it; a loop a group
    chunk k + 1          reads its inputs through an optimization_barrier with chunk k's outputs,
                         so XLA can neither merge the chunks nor start one before the last ends

Each chunk calls ``optimizer.update`` on the whole trees with its own leaves (or slices) in
place, so masks and schedules see the structure they expect; what the other leaves would get is
dead code, removed by XLA. Each entry is computed with the unchunked update's operations: the
update of parameter ``i`` must depend on nothing of another parameter, and be split along its rows
only if it keeps them apart (no value of an entry's position, as noise drawn for a shape), both
read from the optimizer's jaxpr (:mod:`leanstep.step.update.dependence`);
scalar state (counts, schedules) is shared by the chunks and taken from the first. Stochastic
rounding of bfloat16 masters draws, for a slice, the bits its rows take in the whole leaf
(:func:`leanstep.blocks.masters.rows_bits`).

Size: the loop that applies a chunk plan and the row slicing it needs share one vocabulary
(Unit, ChunkPlan, ChunkInputs); the plan's cutting is update.chunk_plan, which leaves may be
split update.dependence, host offload update.offload.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from leanstep.blocks.clipping import NormParts, clip_leaves
from leanstep.blocks.masters import apply_to_master, rows_can_split
from leanstep.blocks.moments import QuantizedArray
from leanstep.step.update.dependence import update_dependence
from leanstep.step.update.offload import back_like, is_offloaded, offloaded_rows, on_device, placeholders

__all__ = [
    "ChunkInputs", "ChunkPlan", "Unit", "chunk_plan", "chunked_apply", "chunked_update", "leaf_parts",
    "master_finish", "prepare_grads", "row_put", "row_slice", "run_chunk", "splittable_rows", "state_parts",
]  # fmt: skip


def _per_param(node: Any) -> bool:
    return isinstance(node, (QuantizedArray, optax.MaskedNode))


class Unit(NamedTuple):
    """Leaf number ``leaf`` (``rows`` rows from ``start`` on its leading axis; both None: the whole leaf)."""

    leaf: int
    start: int | None = None
    rows: int | None = None


class ChunkPlan(NamedTuple):
    """How the update is cut: ``chunks``, each a tuple of :class:`Unit` s updated by one call of
    the optimizer, one chunk after another."""

    chunks: tuple[tuple[Unit, ...], ...]


def state_parts(opt_state: Any, params_def: Any, params: list[Any]) -> tuple[list[Any], Any, list[bool]]:
    """The optimizer state flattened to parts: subtrees with the params' structure, and shared leaves."""

    def is_node(node: Any) -> bool:
        if jax.tree.structure(node, is_leaf=_per_param) != params_def:
            return False
        if params_def.num_nodes == 1:  # the params are one bare array: any array has its structure, the shape decides
            return isinstance(node, QuantizedArray) or tuple(getattr(node, "shape", ())) == tuple(jnp.shape(params[0]))
        return True

    parts, state_def = jax.tree.flatten(opt_state, is_leaf=is_node)
    return parts, state_def, [is_node(part) for part in parts]


def _owners(parts: list[Any], nodes: list[bool], params_def: Any, params: list[Any]) -> list[Any]:
    owners: list[Any] = []
    for part, node in zip(parts, nodes):
        if not node:
            owners += [None] * len(jax.tree.leaves(part))
            continue
        for index, sub in enumerate(params_def.flatten_up_to(part)):
            shape = tuple(jnp.shape(params[index]))
            for leaf in jax.tree.leaves(sub):
                owners.append((index, len(shape) >= 1 and jnp.ndim(leaf) >= 1 and jnp.shape(leaf)[0] == shape[0]))
    return owners


def chunk_plan(
    optimizer: optax.GradientTransformation, opt_state: Any, params: Any, update_chunk: int, key: Any = None
) -> tuple[ChunkPlan | None, str | None]:
    """The chunks of the update of ``params`` (float32 masters, abstract or concrete), or
    ``(None, why)`` where the optimizer needs the whole tree. ``key``: the rounding key of
    bfloat16 masters (a leaf is split only if its bits can be drawn in slices)."""
    splittable, why = splittable_rows(optimizer, opt_state, params, key)
    if splittable is None:
        return None, why
    return ChunkPlan(_cut([tuple(jnp.shape(p)) for p in jax.tree.leaves(params)], splittable, update_chunk)), None


def splittable_rows(
    optimizer: optax.GradientTransformation, opt_state: Any, params: Any, key: Any = None
) -> tuple[list[bool] | None, str | None]:
    """Per leaf of ``params``, whether its update may be applied a block of rows at a time (read
    from the optimizer's jaxpr), or ``(None, why)`` where the update of a parameter reads another."""
    leaves, params_def = jax.tree.flatten(params)
    parts, _, nodes = state_parts(opt_state, params_def, leaves)
    param_owners = [(i, jnp.ndim(p) >= 1) for i, p in enumerate(leaves)]
    state_owners = _owners(parts, nodes, params_def, leaves)
    new_state = jax.eval_shape(optimizer.update, params, opt_state, params)[1]
    new_parts, _, new_nodes = state_parts(new_state, params_def, leaves)
    dependence = update_dependence(
        optimizer.update,
        (params, opt_state, params),
        [*param_owners, *state_owners, *param_owners],
        [*param_owners, *_owners(new_parts, new_nodes, params_def, leaves)],
    )
    if dependence.cross is not None:
        return None, dependence.cross
    return [
        dependence.rows[i] and jnp.ndim(p) >= 1 and jnp.shape(p)[0] > 1 and (key is None or rows_can_split(key, jnp.shape(p)))
        for i, p in enumerate(leaves)
    ], None  # fmt: skip


def _cut(shapes: list[tuple[int, ...]], splittable: list[bool], limit: int) -> tuple[tuple[Unit, ...], ...]:
    """The chunks: leaves too large together that share a leading axis (a stack of layers) in
    blocks of rows, block ``j`` of every one of them in chunk ``j``; the other leaves packed whole.

    XLA rewrites ``x / s`` as ``x * (1 / s)`` where the scalar ``s`` (Adam's bias correction) has
    one user, so a chunk that updates one leaf can round otherwise than the whole tree: with more
    than one leaf, every chunk updates at least two (a stack of one leaf is not split)."""
    sizes = [math.prod(shape) for shape in shapes]
    several = len(shapes) > 1
    stacks: dict[int, list[int]] = {}
    for index, shape in enumerate(shapes):
        if splittable[index]:
            stacks.setdefault(shape[0], []).append(index)
    chunks: list[tuple[Unit, ...]] = []
    whole = set(range(len(shapes)))
    for length, members in stacks.items():
        total = sum(sizes[i] for i in members)
        if total <= limit or (several and len(members) < 2):
            continue
        for group in _stack_groups(members, [sizes[i] // length for i in members], limit):
            row = sum(sizes[i] for i in group) // length
            rows = max([r for r in range(1, length) if length % r == 0 and row * r <= limit], default=1)
            chunks += [tuple(Unit(i, start, rows) for i in group) for start in range(0, length, rows)]
        whole -= set(members)
    groups: list[list[int]] = []
    for index in sorted(whole):
        if groups and sum(sizes[i] for i in groups[-1]) + sizes[index] <= limit:
            groups[-1].append(index)
        else:
            groups.append([index])
    for position, group in enumerate(groups):  # no chunk of one leaf (see above)
        if several and len(group) == 1 and len(groups) > 1:
            groups[position + 1 if position + 1 < len(groups) else position - 1] += group
            group.clear()
    groups = [group for group in groups if group]
    return tuple(tuple(Unit(i) for i in group) for group in groups) + tuple(chunks)


def _stack_groups(members: list[int], row_sizes: list[int], limit: int) -> list[list[int]]:
    """The leaves of a stack in groups, each looped over on its own, so that a row of a group holds
    at most ``limit`` entries where it can: largest first, each into the first group it fits; a
    group of one leaf joins the smallest other group (see :func:`_cut`: no chunk of one leaf)."""
    if sum(row_sizes) <= limit:
        return [list(members)]
    groups: list[list[int]] = []
    totals: list[int] = []
    for size, index in sorted(zip(row_sizes, members), key=lambda pair: (-pair[0], pair[1])):
        fit = next((g for g, total in enumerate(totals) if total + size <= limit), None)
        if fit is None:
            groups.append([index])
            totals.append(size)
        else:
            groups[fit].append(index)
            totals[fit] += size
    size_of = dict(zip(members, row_sizes))
    while len(groups) > 1 and min(len(g) for g in groups) < 2:
        lone = next(g for g, group in enumerate(groups) if len(group) < 2)
        donor = max(range(len(groups)), key=lambda g: len(groups[g]))
        if len(groups[donor]) > 2:  # the donor's smallest leaf keeps the lone leaf company
            moved = min(groups[donor], key=lambda i: (size_of[i], i))
            groups[donor].remove(moved)
            groups[lone].append(moved)
            totals[donor] -= size_of[moved]
            totals[lone] += size_of[moved]
            continue
        other = min((g for g in range(len(groups)) if g != lone), key=lambda g: totals[g])
        groups[other] += groups[lone]
        totals[other] += totals[lone]
        del groups[lone], totals[lone]
    return [sorted(group) for group in groups]


class ChunkInputs(NamedTuple):
    """What a chunk needs besides its leaves: the whole trees, the step's decisions."""

    optimizer: optax.GradientTransformation
    params_def: Any
    grads: list[Any]  # the scaled gradient, as the gradient stage gave it
    params: list[Any]  # the masters, as kept
    parts: list[Any]  # the optimizer state's parts
    state_def: Any
    nodes: tuple[bool, ...]
    errors: list[Any] | None
    prepare: Callable[[list[Any]], list[Any]]  # scaled gradient leaves -> what the optimizer takes
    finish: Callable[..., tuple[Any, Any]]  # (index, param, update, error, first_row) -> (new, new_error)
    update_scale: Any
    applied: jax.Array
    kept_parts: list[Any] | None = None  # an offloaded state's parts as kept (host); ``parts`` then has placeholders


def row_slice(tree: Any, start: Any, rows: int) -> Any:
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, rows, axis=0), tree)


def row_put(tree: Any, piece: Any, start: Any) -> Any:
    return jax.tree.map(lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, start, axis=0), tree, piece)


def _where(applied: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(applied, n, o), new, old)


def run_chunk(inputs: ChunkInputs, owned: dict[int, Any], rows: dict[int, Any]) -> tuple[dict[int, Any], list[Any]]:
    """``optimizer.update`` with leaf ``i`` replaced by ``owned[i] = (grad, param, state_subs, error)``
    (rows from ``rows[i]`` on, or None: whole); returns the new ``(param, state_subs, error)`` of
    the owned leaves and the new shared parts of the state."""
    grads, params = list(inputs.grads), list(inputs.params)
    per_param = [inputs.params_def.flatten_up_to(p) if node else None for p, node in zip(inputs.parts, inputs.nodes)]
    for index, (grad, param, subs, _) in owned.items():
        grads[index], params[index] = grad, param
        for column, sub in zip([c for c in per_param if c is not None], subs):
            column[index] = sub
    parts = [p if c is None else inputs.params_def.unflatten(c) for p, c in zip(inputs.parts, per_param)]
    tree = lambda leaves: jax.tree.unflatten(inputs.params_def, leaves)
    wide = [p.astype(jnp.float32) for p in params]
    ready = [g.astype(w.dtype) for g, w in zip(inputs.prepare(grads), wide)]
    updates, new_state = inputs.optimizer.update(tree(ready), jax.tree.unflatten(inputs.state_def, parts), tree(wide))
    update_leaves = inputs.params_def.flatten_up_to(updates)
    new_parts = inputs.state_def.flatten_up_to(new_state)
    new_columns = [inputs.params_def.flatten_up_to(p) for p, node in zip(new_parts, inputs.nodes) if node]
    out = {}
    for index, (_, param, subs, error) in owned.items():
        update = update_leaves[index]
        if inputs.update_scale is not None:
            update = update * inputs.update_scale.astype(update.dtype)
        new, new_error = inputs.finish(index, param, update, error, rows[index])
        out[index] = (
            jnp.where(inputs.applied, new, param),
            [_where(inputs.applied, column[index], old) for column, old in zip(new_columns, subs)],
            None if error is None else jnp.where(inputs.applied, new_error, error),
        )
    shared = [_where(inputs.applied, n, o) for n, o, node in zip(new_parts, inputs.parts, inputs.nodes) if not node]
    return out, shared


def leaf_parts(inputs: ChunkInputs, index: int) -> tuple[Any, Any, list[Any], Any]:
    parts = inputs.parts if inputs.kept_parts is None else inputs.kept_parts
    subs = [inputs.params_def.flatten_up_to(p)[index] for p, node in zip(parts, inputs.nodes) if node]
    error = None if inputs.errors is None else inputs.errors[index]
    return inputs.grads[index], inputs.params[index], subs, error


def chunked_apply(inputs: ChunkInputs, plan: ChunkPlan) -> tuple[list[Any], Any, list[Any] | None]:
    """The new params (leaves), optimizer state and Kahan buffer (leaves or None), chunk by chunk:
    a chunk reads its inputs through an optimization barrier with the last chunk's outputs; a leaf
    cut in blocks of rows is written block by block into its buffer (in place)."""
    results: dict[int, Any] = {}
    _, shared = run_chunk(inputs, {}, {})  # counts and schedules: no parameter's entries are read
    current: dict[int, Any] = {}  # the leaves being written block by block: (param, subs, error)
    previous: Any = ()
    for chunk in plan.chunks:
        if chunk[0].start is None:  # whole leaves
            kept = {unit.leaf: leaf_parts(inputs, unit.leaf) for unit in chunk}
            owned, previous = jax.lax.optimization_barrier((on_device(kept), previous))
            new, _ = run_chunk(inputs, owned, {unit.leaf: None for unit in chunk})
            new = back_like(new, {i: kept[i][1:] for i in kept})  # an offloaded state goes back to the host
            results.update(new)
            previous = new
        elif chunk[0].start == 0:  # a stack: every block in one loop
            stack = {unit.leaf: leaf_parts(inputs, unit.leaf)[1:] for unit in chunk}
            carry, _ = jax.lax.optimization_barrier((offloaded_rows(stack), previous))
            current.update(back_like(_stack_loop(inputs, {unit.leaf: unit.rows or 1 for unit in chunk}, carry), stack))
            previous = {unit.leaf: current[unit.leaf] for unit in chunk}
    results.update(current)
    return assemble(inputs, results, shared)


def _stack_loop(inputs: ChunkInputs, stack: dict[int, int], carry: dict[int, Any]) -> dict[int, Any]:
    """The blocks of the leaves of a stack (``index -> rows``), one block of each leaf an
    iteration of a ``fori_loop`` (a loop body is scheduled alone, so one block's widening is live
    at a time), written in place into ``carry`` (``index -> (param, subs, error)``)."""
    rows = next(iter(stack.values()))
    blocks = jnp.shape(inputs.grads[next(iter(stack))])[0] // rows

    def body(j: Any, carry: dict[int, Any]) -> dict[int, Any]:
        start = j * rows
        owned = {}
        for i in stack:
            param, subs, error = carry[i]
            owned[i] = (row_slice(inputs.grads[i], start, rows), row_slice(param, start, rows),
                        row_slice(subs, start, rows), None if error is None else row_slice(error, start, rows))  # fmt: skip
        new, _ = run_chunk(inputs, on_device(owned), {i: start for i in stack})  # an offloaded block: one transfer
        new = back_like(new, carry)  # an offloaded block goes back into its host buffer
        return {i: tuple(None if w is None else row_put(w, n, start) for w, n in zip(carry[i], new[i])) for i in stack}

    return jax.lax.fori_loop(0, blocks, body, carry)


def assemble(
    inputs: ChunkInputs, results: dict[int, Any], shared: list[Any]
) -> tuple[list[Any], Any, list[Any] | None]:
    count = len(inputs.params)
    new_params = [results[i][0] for i in range(count)]
    parts, node_column, shared_iter = [], 0, iter(shared)
    for part, node in zip(inputs.parts, inputs.nodes):
        if node:
            parts.append(inputs.params_def.unflatten([results[i][1][node_column] for i in range(count)]))
            node_column += 1
        else:
            parts.append(next(shared_iter))
    errors = None if inputs.errors is None else [results[i][2] for i in range(count)]
    return new_params, jax.tree.unflatten(inputs.state_def, parts), errors


def master_finish(master: Any, key: jax.Array, shapes: list[tuple[int, ...]]) -> Callable[..., tuple[Any, Any]]:
    """``finish(index, param, update, error, first_row) -> (new, new_error)``: ``param + update`` in the
    masters' format; leaf ``index`` rounds with ``fold_in(key, index)``, a slice with the bits of its rows."""

    def finish(index: int, param: Any, update: Any, error: Any, first_row: Any) -> tuple[Any, Any]:
        if master == "float32":
            return jnp.asarray(param + update).astype(param.dtype), None
        leaf_key = jax.random.fold_in(key, index)
        return apply_to_master(param, update, master, leaf_key, error, first_row=first_row, leaf_shape=shapes[index])

    return finish


def prepare_grads(loss_scale: Any, norm: NormParts, max_grad_norm: float | None) -> Callable[[list[Any]], list[Any]]:
    """Scaled gradient leaves -> unscaled and clipped, entry by entry as the whole tree is
    (:func:`leanstep.blocks.clipping.clip_leaves`, from the same norm)."""

    def prepare(leaves: list[Any]) -> list[Any]:
        grads = list(loss_scale.unscale(leaves))
        return grads if max_grad_norm is None else clip_leaves(grads, norm, max_grad_norm)

    return prepare


def chunked_update(
    state: Any, params: Any, scaled_grads: Any, plan: ChunkPlan, applied: jax.Array, norm: NormParts,
    max_grad_norm: float | None, key: jax.Array, update_scale: Any,
) -> tuple[Any, Any, Any]:  # fmt: skip
    """``(params, opt_state, master_error)`` after the update of the trainable ``params`` (as
    kept), applied where ``applied``, chunk by chunk (see the module doc)."""
    leaves, params_def = jax.tree.flatten(params)
    parts, state_def, nodes = state_parts(state.opt_state, params_def, leaves)
    inputs = ChunkInputs(
        optimizer=state.optimizer,
        params_def=params_def,
        grads=params_def.flatten_up_to(scaled_grads),  # type: ignore[attr-defined]  # jaxlib's PyTreeDef
        params=leaves,
        parts=parts,
        state_def=state_def,
        nodes=tuple(nodes),
        errors=None if state.master_error is None else params_def.flatten_up_to(state.master_error),  # type: ignore[attr-defined]  # jaxlib's PyTreeDef
        prepare=prepare_grads(state.loss_scale, norm, max_grad_norm),
        finish=master_finish(state.master, key, [tuple(jnp.shape(p)) for p in leaves]),
        update_scale=update_scale,
        applied=applied,
    )
    if is_offloaded(parts):  # the state in host memory: leanstep.step.update.offload
        inputs = inputs._replace(
            parts=[placeholders(p) if node else on_device(p) for p, node in zip(parts, nodes)], kept_parts=parts
        )
    new_params, opt_state, errors = chunked_apply(inputs, plan)
    opt_state = back_like(opt_state, state.opt_state)
    error_tree = None if errors is None else jax.tree.unflatten(params_def, errors)
    return jax.tree.unflatten(params_def, new_params), opt_state, error_tree
