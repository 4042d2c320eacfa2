r"""The update inside the backward pass: each layer updated as the backward pass reaches it.

The standard step (:func:`leanstep.make_train_step`) accumulates the whole model's gradient in
float32 (4 bytes a parameter) before the update reads it. For a model given as a
:class:`leanstep.blocks.layer_stack.LayerStack` this step never holds more than one layer's:

.. code-block:: text

    forward     every microbatch through the stack, layer-major; each layer's inputs kept
    head        loss_m and its backward, for every microbatch: the top's gradient, d x_L
    pass 1      for l = L-1 .. 0: layer l's gradient, summed over microbatches in float32,
                reduced into the global norm's parts and dropped; then the embedding's
    decide      finite = the norm's parts and the loss finite; clip factor from the norm
    pass 2      (only if finite, under lax.cond) for l = L-1 .. 0 again: layer l's gradient,
                unscaled, clipped and given to the optimizer for layer l's rows of the
                masters and the moments, written in place; then the top's, kept from pass 1
    S           = adjust(S, finite)

Clipping by the global norm and skipping a non-finite step need the whole gradient's norm before
anything is applied, hence the two passes: about 1.75 times the standard step's FLOPs with full
remat (forward, then twice a recomputed forward and backward). A skipped step runs pass 1 only and
leaves params and optimizer state bit-identical.

The optimizer is applied to a layer's rows with the chunked update's machinery
(:mod:`leanstep.step.update.chunks`); the passes are :mod:`leanstep.step.layer_passes`: each entry computed with the whole tree's operations, masks
and schedules seeing the whole structure, counts shared, bfloat16 masters rounded with the bits
their rows take in the whole leaf. The optimizer's update of a parameter must depend on nothing of
another and keep the rows of a stacked leaf apart (read from its jaxpr); one that does not is
refused by name.

On a mesh (``make_train_step(..., mesh=)``) the step runs inside the sharding layer's constraints
(:meth:`leanstep.step.ShardingLayer.around`: the state laid out by its partition rules, strided
microbatches over the batch axes) and every reduction is XLA's SPMD partitioner's, as under
``reduce="microbatch"``: each layer's gradient is reduced where it is made.

The state's spike guard judges the loss and the norm after pass 1, so a spike is skipped before
anything is applied; one that watches the update's norm is refused (that norm is known only after pass 2).
Not yet (each refused in one line, by :class:`leanstep.StepSpec` or here): FP8 state, an
offloaded optimizer state, a loss with aux, model state or a PRNG key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from leanstep.blocks.accumulation import Accumulation
from leanstep.blocks.clipping import NormParts, norm_parts
from leanstep.blocks.fp8_state import has_fp8
from leanstep.blocks.layer_stack import LayerStack, require_layer_stack
from leanstep.blocks.precision import check_train_precision
from leanstep.common.checks import INT32_MAX
from leanstep.step.layer_passes import layer_gradient, stack_forward, top_gradient
from leanstep.step.spec import StepSpec
from leanstep.step.state import StepMetrics, TrainState
from leanstep.step.update import (
    ChunkInputs,
    assemble,
    check_opt_state,
    is_offloaded,
    leaf_parts,
    master_finish,
    prepare_grads,
    rounding_key,
    row_put,
    row_slice,
    run_chunk,
    spike_window,
    splittable_rows,
    state_parts,
)

__all__ = ["make_layerwise_step"]


def _no_parts() -> NormParts:
    # made when traced, not at import: an array made at import starts JAX's backend, after which a
    # process can no longer set its device count (jax_num_cpu_devices, configure_devices)
    return NormParts(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32), jnp.ones((), bool))


def _check_state(state: Any, stack: LayerStack) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a TrainState (see TrainState.create), got {type(state).__name__}")
    if state.model_state is not None or has_fp8(state.params) or is_offloaded(state.opt_state):
        raise ValueError(
            "update_in_backward=True takes a state without model state, FP8 state or an offloaded optimizer state"
        )
    if state.spike_guard is not None and "update_norm" in state.spike_guard.watch:
        raise ValueError(
            "update_in_backward=True does not yet take a spike guard watching 'update_norm' (known only after "
            "the update); the state's watches it: build the state with a guard of the loss or gradient norm"
        )
    stack.split(state.params)  # its own errors
    abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.float32), state.params)
    check_opt_state(state.opt_state, state.optimizer, abstract)
    key = None if state.master == "float32" else jax.random.wrap_key_data(state.rng)
    splittable, why = splittable_rows(state.optimizer, state.opt_state, abstract, key)
    stacked = stack.stacked_leaves(state.params)
    rows_apart = splittable is not None and all(
        splittable[i] or jnp.shape(leaf)[0] == 1 for i, leaf in enumerate(jax.tree.leaves(state.params)) if stacked[i]
    )
    if not rows_apart:
        raise ValueError(
            "update_in_backward=True: the optimizer's update of a layer reads other layers or parameters "
            f"({why or 'a stacked leaf whose rows it does not keep apart, or whose rounding bits cannot be drawn by rows'})"
            "; it must update each entry from its own gradient and state (AdamW, Lion, SGD, their chains, "
            "masks and schedules do); the step clips the global norm itself (max_grad_norm=)"
        )


def make_layerwise_step(
    stack: Any, spec: StepSpec, accumulation: Accumulation | None = None
) -> Callable[[TrainState, Any], tuple[TrainState, StepMetrics]]:
    """``step(state, batch) -> (state, metrics)`` updating each layer inside the backward pass (the
    module doc); not jitted. ``spec`` as for :func:`leanstep.make_train_step`; ``accumulation``: the
    spec's as the sharding layer constrains its microbatches (None: the spec's own).

    Raises:
      TypeError, ValueError: ``stack`` not a :class:`LayerStack`, or a setting this step does not
        take yet (named); at trace time, a state it does not take, or an optimizer that mixes
        parameters or layers (named).
    """
    stack = require_layer_stack(stack)
    policy = check_train_precision(spec.precision)
    contract, accumulation = spec.loss, spec.accumulation if accumulation is None else accumulation
    stack = LayerStack(policy.wrap(stack.embed), policy.wrap(stack.layer), policy.wrap(stack.head), stack.stack)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, StepMetrics]:
        _check_state(state, stack)
        top, stacked = stack.split(state.params)
        microbatches = accumulation.split_batch(policy.cast_to_compute(batch) if spec.cast_batch else batch)
        top_c, scale = policy.cast_to_compute(top), state.loss_scale
        forward = stack_forward(stack, top_c, stacked, microbatches, policy.cast_to_compute, contract, scale)
        values = forward.values
        # divided as the standard step divides (StepSpec refuses Accumulation(divide=False))
        counts = forward.counts
        denominator = jnp.float32(values.shape[0]) if counts is None else jnp.sum(counts)
        loss = jnp.sum(values) / denominator
        divide = lambda g: jax.tree.map(lambda x: x / denominator, g)

        def norm_pass(carry: Any, layer_inputs: Any) -> tuple[Any, None]:
            cotangent, parts = carry
            layer, inputs = layer_inputs
            grads, cotangent = layer_gradient(stack, policy.cast_to_compute(layer), inputs, cotangent)
            return (cotangent, parts.merge(norm_parts(divide(grads), scale.unscale))), None

        (cotangent, parts), _ = jax.lax.scan(
            norm_pass, (forward.head_cotangent, _no_parts()), (stacked, forward.inputs), reverse=True
        )
        embed_grads = top_gradient(stack, top_c, microbatches, cotangent)
        top_grads = divide(jax.tree.map(jnp.add, forward.head_grads, embed_grads))
        parts = parts.merge(norm_parts(top_grads, scale.unscale))
        decision = _decide(spec, state, parts, loss)

        def apply(kept: Any) -> Any:
            return _apply(
                stack, spec, state, kept, forward, top_grads, parts, divide, policy.cast_to_compute, decision.scale
            )

        kept = (state.params, state.opt_state, state.master_error)
        params, opt_state, master_error = jax.lax.cond(decision.applied, apply, lambda kept: kept, kept)
        finite = decision.finite
        skips = jnp.where(finite, 0, jnp.minimum(state.consecutive_skips, INT32_MAX - 1) + 1).astype(jnp.int32)
        new_state = state.replace(
            step=jnp.minimum(state.step, INT32_MAX - 1) + 1,
            params=params,
            opt_state=opt_state,
            master_error=master_error,
            loss_scale=scale.adjust(finite),
            consecutive_skips=skips,
            spike=decision.window,
        )
        return new_state, StepMetrics(
            loss=loss,
            grad_norm=parts.norm.astype(jnp.float32),
            loss_scale=jnp.asarray(scale.loss_scale, jnp.float32),
            skipped=~finite,
            clipped=decision.clipped & decision.applied,
            consecutive_skips=skips,
            aux=None,
            spiked=decision.spiked,
            step_saturated=state.step >= INT32_MAX,
        )

    return step


class _Decision(NamedTuple):
    finite: jax.Array
    spiked: jax.Array
    clipped: jax.Array
    window: Any  # the spike guard's window after this step, or None
    scale: Any  # the spike guard's update scale, or None

    @property
    def applied(self) -> jax.Array:
        return self.finite & ~self.spiked


def _decide(spec: StepSpec, state: TrainState, parts: NormParts, loss: jax.Array) -> _Decision:
    """Skip or apply, from the whole gradient's norm parts and the loss (pass 1), as the standard
    step decides: non-finite, or a spike of the loss or the norm past the window of the state's guard."""
    finite = parts.finite & jnp.isfinite(loss)
    norm = parts.norm.astype(jnp.float32)
    clipped = jnp.zeros((), bool) if spec.max_grad_norm is None else parts.norm > spec.max_grad_norm
    guard, window = state.spike_guard, spike_window(state)
    if guard is None:
        return _Decision(finite, jnp.zeros((), bool), clipped, window, None)
    spiked, new_window = guard.decide(window, {"loss": loss, "grad_norm": norm}, finite)
    return _Decision(finite, spiked, clipped, new_window, window.update_scale)


def _apply(
    stack: LayerStack,
    spec: StepSpec,
    state: TrainState,
    kept: Any,
    forward: Any,
    top_grads: Any,
    parts: NormParts,
    divide: Callable[[Any], Any],
    cast: Callable[[Any], Any],
    update_scale: Any,
) -> Any:
    """Pass 2: every layer's update as the backward pass reaches it, then the top's."""
    params, opt_state, master_error = kept
    leaves, params_def = jax.tree.flatten(params)
    opt_parts, state_def, nodes = state_parts(opt_state, params_def, leaves)
    stacked = stack.stacked_leaves(params)
    errors = None if master_error is None else params_def.flatten_up_to(master_error)  # type: ignore[attr-defined]  # jaxlib's PyTreeDef
    key = rounding_key(state)  # the standard step's
    real = ChunkInputs(
        optimizer=state.optimizer,
        params_def=params_def,
        grads=leaves,  # never read: each owned leaf brings its own gradient
        params=leaves,
        parts=opt_parts,
        state_def=state_def,
        nodes=tuple(nodes),
        errors=errors,
        prepare=prepare_grads(state.loss_scale, parts, spec.max_grad_norm),
        finish=master_finish(state.master, key, [tuple(jnp.shape(p)) for p in leaves]),
        update_scale=update_scale,  # the spike guard's, after a rollback; None: 1
        applied=jnp.ones((), bool),
    )

    # What a call reads for the leaves it does not own is dead code; a stacked leaf's stands in by its
    # first row (a whole-shaped stand-in would be hoisted out of the loop and made: 8 bytes a parameter).
    def placeholder(i: int, value: Any) -> Any:
        return row_slice(value, 0, 1) if stacked[i] else value

    columns = [params_def.flatten_up_to(p) if node else None for p, node in zip(opt_parts, nodes)]  # type: ignore[attr-defined]  # jaxlib's PyTreeDef
    inputs = real._replace(
        grads=[placeholder(i, p) for i, p in enumerate(leaves)],
        params=[placeholder(i, p) for i, p in enumerate(leaves)],
        parts=[p if c is None else params_def.unflatten([placeholder(i, s) for i, s in enumerate(c)]) for p, c in zip(opt_parts, columns)],  # type: ignore[attr-defined]  # jaxlib's PyTreeDef
        errors=None if errors is None else [placeholder(i, e) for i, e in enumerate(errors)],
    )  # fmt: skip
    _, shared = run_chunk(inputs, {}, {})  # counts and schedules
    indices = [i for i, s in enumerate(stacked) if s]
    stack_def = jax.tree.structure(stack.split(params)[1])

    def layer_update(carry: Any, layer_inputs: Any) -> tuple[Any, None]:
        cotangent, buffers = carry
        row, inputs_l = layer_inputs
        rows = {i: tuple(None if w is None else row_slice(w, row, 1) for w in buffers[i]) for i in indices}
        layer_c = cast(jax.tree.unflatten(stack_def, [rows[i][0][0] for i in indices]))  # type: ignore[index]  # a master is never None
        grads, cotangent = layer_gradient(stack, layer_c, inputs_l, cotangent)
        owned = {i: (g[None], *rows[i]) for i, g in zip(indices, jax.tree.leaves(divide(grads)))}
        new, _ = run_chunk(inputs, owned, {i: row for i in indices})
        buffers = {
            i: tuple(None if w is None else row_put(w, n, row) for w, n in zip(buffers[i], new[i])) for i in indices
        }
        return (cotangent, buffers), None

    layers = jnp.shape(leaves[indices[0]])[0]
    buffers = {i: leaf_parts(real, i)[1:] for i in indices}
    (_, buffers), _ = jax.lax.scan(
        layer_update, (forward.head_cotangent, buffers), (jnp.arange(layers), forward.inputs), reverse=True
    )
    top = [i for i, s in enumerate(stacked) if not s]
    owned = {i: (g, *leaf_parts(real, i)[1:]) for i, g in zip(top, jax.tree.leaves(top_grads))}
    results, _ = run_chunk(inputs, owned, dict.fromkeys(top))
    results.update(buffers)
    new_leaves, new_opt_state, new_errors = assemble(real, results, shared)
    return (
        jax.tree.unflatten(params_def, new_leaves),
        new_opt_state,
        None if new_errors is None else jax.tree.unflatten(params_def, new_errors),
    )
