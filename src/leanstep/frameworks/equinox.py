"""Equinox models in leanstep's step: the floating arrays train, everything else is static.

.. code-block:: python

    params, static = leanstep.frameworks.equinox.split(model)
    step = leanstep.make_train_step(leanstep.frameworks.equinox.loss(static, loss_of_model))
    ...
    model = leanstep.frameworks.equinox.combine(state.params, static)

Models with state (``eqx.nn.BatchNorm``, ``eqx.nn.make_with_state``) pass their
``eqx.nn.State`` as leanstep's model state, with :func:`stateful_loss` and ``has_state=True``.
Under a compute dtype below float32 :func:`stateful_loss` runs each ``eqx.nn.BatchNorm`` in
float32 (its input cast up, its output cast back): the batch statistics and their running
average are computed in float32 and kept in float32, as Flax's BatchNorm does, and the rest of
the model stays in the compute dtype.

FP8: a module field holding an :class:`leanstep.blocks.Fp8Meta` (as :class:`Fp8Linear` does) is a
floating array tree, so :func:`split` puts it among the params, where the step finds it as FP8
state (max-combined over microbatches, out of the optimizer, written once per step).

The update inside the backward pass (``StepSpec(update_in_backward=True)``) takes a model whose
layers are one module with stacked leaves (made with ``eqx.filter_vmap``, run with ``lax.scan``):
:func:`layer_stack` makes its :class:`leanstep.LayerStack` from the model and three functions of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from leanstep.blocks.fp8 import Fp8Recipe
from leanstep.blocks.fp8_dot import Fp8Meta, fp8_matmul
from leanstep.blocks.layer_stack import CONTRACT, LayerStack, StackPath, node_at
from leanstep.frameworks.loss_signature import with_fn_signature

__all__ = ["Float32BatchNorm", "Fp8Linear", "combine", "layer_stack", "loss", "split", "stateful_loss"]


def split(model: eqx.Module) -> tuple[eqx.Module, eqx.Module]:
    """``(params, static)`` = ``eqx.partition(model, eqx.is_inexact_array)``.

    Example:
      >>> import jax
      >>> params, static = split(eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0)))
      >>> len(jax.tree.leaves(params)), static.activation is jax.nn.relu
      (4, True)
    """
    return eqx.partition(model, eqx.is_inexact_array)


def combine(params: eqx.Module, static: eqx.Module) -> eqx.Module:
    """The model again: ``eqx.combine(params, static)``."""
    return eqx.combine(params, static)


def loss(static: eqx.Module, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(model, batch[, key])`` as ``loss_fn(params, batch[, key])``.

    The loss takes a key exactly when ``fn`` does (:mod:`leanstep.frameworks.loss_signature`), so a
    ``uses_rng`` that does not fit ``fn`` is named when the step is built.

    Raises:
      TypeError: ``fn`` takes neither ``(model, batch)`` nor ``(model, batch, key)``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> params, static = split(eqx.nn.Linear(2, 1, key=jax.random.key(0)))
      >>> loss_fn = loss(static, lambda m, batch: jnp.mean(jax.vmap(m)(batch["x"]) ** 2))
      >>> loss_fn(params, {"x": jnp.ones((3, 2))}).shape
      ()
    """
    loss_fn = lambda params, batch, *key: fn(eqx.combine(params, static), batch, *key)
    return with_fn_signature(loss_fn, fn, ("model", "batch"), ("params", "batch"))


def stateful_loss(static: eqx.Module, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(model, model_state, batch[, key]) -> (out, new_model_state)`` as leanstep's stateful loss.

    ``model_state`` is the model's ``eqx.nn.State``; use it with ``has_state=True``; the loss takes a
    key exactly when ``fn`` does (``uses_rng``, as :func:`loss`). Every
    ``eqx.nn.BatchNorm`` of the model runs as a :class:`Float32BatchNorm`: under
    ``compute=bfloat16`` its statistics are computed, and kept, in float32 (``eqx.nn.BatchNorm``
    itself cannot mix a bf16 input with float32 running statistics); in float32 nothing changes.

    Example:
      >>> model, model_state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(2, "batch", mode="ema")
      >>> params, static = split(model)
      >>> def fn(model, model_state, batch):
      ...     y, model_state = jax.vmap(model, (0, None), (0, None), axis_name="batch")(batch, model_state)
      ...     return jnp.mean(y), model_state
      >>> params_c = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
      >>> out, new_state = stateful_loss(static, fn)(params_c, model_state, jnp.ones((4, 2), jnp.bfloat16))
      >>> [leaf.dtype.name for leaf in jax.tree.leaves(new_state)]
      ['bool', 'float32', 'float32']
    """
    loss_fn = lambda params, model_state, batch, *key: fn(
        _batch_norms_in_float32(eqx.combine(params, static)), model_state, batch, *key
    )
    arguments = ("model_state", "batch")
    return with_fn_signature(loss_fn, fn, ("model", *arguments), ("params", *arguments))


def layer_stack(
    model: eqx.Module,
    stack: StackPath,
    *,
    embed: Callable[[Any, Any], Any],
    layer: Callable[[Any, Any], Any],
    head: Callable[[Any, Any, Any], Any],
) -> LayerStack:
    """An Equinox model whose layers are one module with stacked leaves as a :class:`leanstep.LayerStack`,
    over the params :func:`split` gives.

    .. code-block:: text

        x    = embed(eqx.combine(top, static), batch)           # the stack's arrays None
        x    = layer(eqx.combine(row_l, static_layer), x)        for l = 0 .. L-1
        loss = head(eqx.combine(top, static), x, batch)

    Args:
      model: the model (its static part is kept, its arrays are not).
      stack: the field holding the stacked layers (``"layers"``), or the path of fields and
        indices to it: one module whose floating leaves are stacked along a leading axis of
        layers, as ``eqx.filter_vmap`` over a layer's constructor makes it.
      embed: ``embed(model, batch) -> x``; it must not touch the stack.
      layer: ``layer(one_layer, x) -> x``, ``one_layer`` the stack's module holding one row.
      head: ``head(model, x, batch)``, returning the loss (as the step's contract says).

    Raises:
      TypeError: ``model`` not an Equinox module, nothing at ``stack``, a list of layers there,
        arrays in its static part, or its leaves not stacked (each naming the LayerStack contract).

    Example:
      >>> make = lambda key: eqx.nn.Linear(4, 4, key=key)
      >>> class Model(eqx.Module):
      ...     inp: eqx.nn.Linear
      ...     layers: eqx.nn.Linear
      ...     def __init__(self, key):
      ...         self.inp, self.layers = eqx.nn.Linear(3, 4, key=key), eqx.filter_vmap(make)(jax.random.split(key, 2))
      >>> stack = layer_stack(Model(jax.random.key(0)), "layers", embed=lambda m, b: jax.vmap(m.inp)(b["x"]),
      ...                     layer=lambda block, x: jnp.tanh(jax.vmap(block)(x)), head=lambda m, x, b: jnp.mean(x))
      >>> params, static = split(Model(jax.random.key(0)))
      >>> stack(params, {"x": jnp.ones((2, 3))}).shape
      ()
    """
    if not isinstance(model, eqx.Module):
        raise TypeError(f"layer_stack: model must be an eqx.Module, got {type(model).__name__}; {CONTRACT}")
    params, static = split(model)
    layers = node_at(static, stack)
    if layers is None:
        raise TypeError(f"layer_stack: {type(model).__name__} has no module at {stack!r}; {CONTRACT}")
    if not isinstance(layers, eqx.Module):
        raise TypeError(
            f"layer_stack: {type(model).__name__} at {stack!r} is a {type(layers).__name__}, not one module whose "
            f"leaves are stacked (eqx.filter_vmap over the layer's constructor); {CONTRACT}"
        )
    if jax.tree.leaves(eqx.filter(layers, eqx.is_array)):
        raise TypeError(
            f"layer_stack: {type(model).__name__} at {stack!r} holds arrays that are not floating (static, "
            f"not split into rows); {CONTRACT}"
        )
    result = LayerStack(
        lambda top, batch: embed(eqx.combine(top, static), batch),
        lambda row, x: layer(eqx.combine(row, layers), x),
        lambda top, x, batch: head(eqx.combine(top, static), x, batch),
        stack,
    )
    result.split(params)  # its refusals, now rather than when the step is traced
    return result


class Float32BatchNorm(eqx.nn.StatefulLayer):
    """An ``eqx.nn.BatchNorm`` run in float32 on an input of a lower dtype, its output cast back.

    Its ``eqx.nn.State`` entries are the wrapped layer's own (the same ``StateIndex``), so the
    state of a model is the same with or without it; a float32 (or wider) input runs the layer
    unchanged.

    Attributes:
      layer: the ``eqx.nn.BatchNorm``.
    """

    layer: eqx.nn.BatchNorm

    def __call__(
        self, x: jax.Array, state: eqx.nn.State, *, key: Any = None, inference: bool | None = None
    ) -> tuple[jax.Array, eqx.nn.State]:
        dtype = jnp.promote_types(x.dtype, jnp.float32)
        if dtype == x.dtype:
            return self.layer(x, state, key=key, inference=inference)
        out, state = self.layer(x.astype(dtype), state, key=key, inference=inference)
        return out.astype(x.dtype), state


def _is_batch_norm(node: Any) -> bool:
    return isinstance(node, eqx.nn.BatchNorm)


def _batch_norms_in_float32(model: Any) -> Any:
    """``model`` with each ``eqx.nn.BatchNorm`` (not yet wrapped) as a :class:`Float32BatchNorm`."""
    wrapped = lambda node: isinstance(node, (eqx.nn.BatchNorm, Float32BatchNorm))
    norms = lambda tree: [node for node in jax.tree.leaves(tree, is_leaf=wrapped) if _is_batch_norm(node)]
    found = norms(model)
    if not found:
        return model
    if _is_batch_norm(model):
        return Float32BatchNorm(model)
    return eqx.tree_at(norms, model, [Float32BatchNorm(norm) for norm in found])


class Fp8Linear(eqx.Module):
    """``eqx.nn.Linear`` with FP8 operands (:func:`leanstep.blocks.fp8_matmul`), on a whole batch.

    Unlike Equinox's per-example layers, call it on ``(..., in_features)`` arrays, not under a
    ``jax.vmap`` over the batch: an FP8 scale is per tensor, and under ``vmap`` each example
    would record its own amax, so with delayed scaling that is refused when traced, naming the
    fix (layers around it may be vmapped as usual).

    Attributes:
      linear: the ``eqx.nn.Linear`` (its weight ``(out, in)``, bias ``(out,)``).
      fp8: its :class:`leanstep.blocks.Fp8Meta` (delayed scaling), or None (current scaling).
      recipe: the :class:`leanstep.Fp8Recipe` (static).

    Example:
      >>> layer = Fp8Linear(3, 2, recipe=Fp8Recipe(history=4), key=jax.random.key(0))
      >>> params, static = split(layer)
      >>> layer(jnp.ones((5, 3))).shape, params.fp8.input_history.shape
      ((5, 2), (4,))
    """

    linear: eqx.nn.Linear
    fp8: Fp8Meta | None
    recipe: Fp8Recipe = eqx.field(static=True)

    def __init__(self, in_features: int, out_features: int, *, recipe: Fp8Recipe | None = None, key: jax.Array):
        self.linear = eqx.nn.Linear(in_features, out_features, key=key)
        self.recipe = Fp8Recipe() if recipe is None else recipe
        self.fp8 = Fp8Meta.create(self.recipe) if self.recipe.delayed else None

    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.linear.weight.astype(x.dtype).T
        out = fp8_matmul(x, weight, self.fp8, self.recipe)
        if self.linear.bias is None:
            return out
        bias = self.linear.bias.astype(x.dtype)
        return out + bias.reshape((1,) * (x.ndim - 1) + bias.shape)
