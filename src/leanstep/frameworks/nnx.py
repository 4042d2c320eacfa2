"""Flax NNX models in leanstep's step: ``nnx.Param`` variables train, every other variable is model state.

.. code-block:: python

    graphdef, params, model_state = leanstep.frameworks.nnx.split(model)
    state = leanstep.TrainState.create(params, optax.adamw(1e-3), model_state=model_state)
    step = leanstep.make_train_step(leanstep.frameworks.nnx.loss(graphdef, loss_of_model), has_state=True)
    ...
    model = leanstep.frameworks.nnx.merge(graphdef, state.params, state.model_state)

``loss_of_model(model, batch[, key])`` is the function an ``nnx.Optimizer`` user already
writes for ``nnx.value_and_grad``. BatchNorm statistics and the counters of a model's own
``nnx.Rngs`` (Dropout) are model state: each microbatch sees what the one before it left,
exactly as one call after another of the model would.

FP8: a model keeps each FP8 matmul's :class:`leanstep.blocks.Fp8Meta` in an :class:`Fp8` variable (as
:class:`Fp8Linear` does); a Linen module with Flax's ``fp8_ops`` wrapped by ``nnx.bridge.ToNNX``
keeps its state in the variables of Flax's ``_overwrite_with_gradient`` collection. :func:`split`
puts both beside the ``nnx.Param`` s, where the step finds them as FP8 state (max-combined over
microbatches, out of the optimizer, written once per step), and :func:`loss` leaves them out
of the model state.

The update inside the backward pass (``StepSpec(update_in_backward=True)``) takes a model whose
layers are one module with stacked parameters (made with ``nnx.vmap``, run with ``nnx.scan``):
:func:`layer_stack` makes its :class:`leanstep.LayerStack` from the model and three functions of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from leanstep.blocks.fp8 import Fp8Recipe
from leanstep.blocks.fp8_dot import Fp8Meta, fp8_matmul
from leanstep.blocks.fp8_state import register_fp8_state_type
from leanstep.blocks.layer_stack import CONTRACT, LayerStack, StackPath, node_at
from leanstep.blocks.loss_contract import OPTIONAL_MODEL_STATE
from leanstep.frameworks.loss_signature import with_fn_signature

__all__ = ["Fp8", "Fp8Linear", "OverwriteWithGradient", "layer_stack", "loss", "merge", "split"]


class Fp8(nnx.Variable):
    """A variable holding FP8 state (an :class:`leanstep.blocks.Fp8Meta`): trained by the step as FP8
    state, not by the optimizer; read it with ``variable.get_value()``."""


#: The NNX variable type ``nnx.bridge`` gives Flax's ``_overwrite_with_gradient`` collection (FP8
#: state of Linen ``fp8_ops`` modules): its values are FP8 state.
OverwriteWithGradient = nnx.variable_type_from_name("_overwrite_with_gradient", allow_register=True)
register_fp8_state_type(Fp8)
register_fp8_state_type(OverwriteWithGradient)

#: The variables leanstep's step differentiates: the parameters and the FP8 state.
_TRAINED = nnx.Any(nnx.Param, Fp8, OverwriteWithGradient)


def split(model: nnx.Module) -> tuple[Any, nnx.State, nnx.State]:
    """``(graphdef, params, model_state)``: the ``nnx.Param`` (and :class:`Fp8`) variables, and all the others.

    Example:
      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
      >>> graphdef, params, model_state = split(model)
      >>> sorted(params["layers"][0]), sorted(model_state["layers"][1])
      (['bias', 'kernel'], ['mean', 'var'])
    """
    graphdef, params, *others = nnx.split(model, _TRAINED, ...)  # one State per filter
    (model_state,) = others
    return graphdef, params, model_state


def merge(graphdef: Any, params: nnx.State, model_state: nnx.State) -> nnx.Module:
    """The module again, e.g. from a trained :class:`leanstep.TrainState`'s params and model state."""
    return nnx.merge(graphdef, params, model_state)


def loss(graphdef: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(model, batch[, key])`` as ``loss_fn(params, model_state, batch[, key]) -> (out, new_model_state)``.

    Use it with ``make_train_step(..., has_state=True)``; ``out`` is whatever ``fn``
    returns (a loss, ``(loss, aux)``, ``(loss_sum, count)``). The loss takes a key exactly when
    ``fn`` does (:mod:`leanstep.frameworks.loss_signature`), so a ``uses_rng`` that does not fit
    ``fn`` is named when the step is built.

    A model without state (every variable an ``nnx.Param``: no BatchNorm, no ``nnx.Rngs`` of its
    own) gets ``loss_fn(params, batch[, key]) -> out``: no ``has_state``, no model state. Handed
    its empty model state after the params (``has_state=True``, as before), it takes it and
    returns ``(out, model_state)``.

    Raises:
      TypeError: ``fn`` takes neither ``(model, batch)`` nor ``(model, batch, key)``.

    Example:
      >>> import jax.numpy as jnp
      >>> model = nnx.Sequential(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), nnx.BatchNorm(1, rngs=nnx.Rngs(0)))
      >>> graphdef, params, model_state = split(model)
      >>> loss_fn = loss(graphdef, lambda m, batch: jnp.mean(m(batch["x"]) ** 2))
      >>> value, new_state = loss_fn(params, model_state, {"x": jnp.ones((4, 2))})
      >>> value.shape, new_state["layers"][1]["mean"][...].shape
      ((), (1,))
    """

    def loss_fn(params: nnx.State, model_state: nnx.State, batch: Any, *key: Any) -> tuple[Any, nnx.State]:
        # Fresh variables (copy=True) belong to the trace of the transform calling this
        # (value_and_grad inside leanstep's scan), so the model may update them there.
        model = nnx.merge(graphdef, params, model_state, copy=True)
        out = fn(model, batch, *key)
        return out, nnx.state(model, nnx.Not(_TRAINED))

    if _holds_state(graphdef):
        return with_fn_signature(loss_fn, fn, ("model", "batch"), ("params", "model_state", "batch"))

    def stateless_loss_fn(params: nnx.State, *arguments: Any) -> Any:
        given = bool(arguments) and isinstance(arguments[0], nnx.State)  # has_state=True: the empty state
        model = nnx.merge(graphdef, params, *arguments[:given], copy=True)
        out = fn(model, *arguments[given:])
        return (out, nnx.state(model, nnx.Not(_TRAINED))) if given else out

    setattr(stateless_loss_fn, OPTIONAL_MODEL_STATE, True)
    return with_fn_signature(stateless_loss_fn, fn, ("model", "batch"), ("params", "batch"))


def layer_stack(
    model: nnx.Module,
    stack: StackPath,
    *,
    embed: Callable[[Any, Any], Any],
    layer: Callable[[Any, Any], Any],
    head: Callable[[Any, Any, Any], Any],
) -> LayerStack:
    """An NNX model whose layers are one module with stacked parameters as a :class:`leanstep.LayerStack`,
    over the params :func:`split` gives.

    .. code-block:: text

        x    = embed(nnx.merge(graphdef, top), batch)           # the stack's variables None
        x    = layer(nnx.merge(layer_graphdef, row_l), x)        for l = 0 .. L-1
        loss = head(nnx.merge(graphdef, top), x, batch)

    Args:
      model: the model (its graph is read, its arrays are not kept); every variable an
        ``nnx.Param`` (no BatchNorm statistics, no ``nnx.Rngs`` of its own).
      stack: the attribute holding the stacked layers (``"blocks"``), or the path of attributes
        to it (``("decoder", "blocks")``): one module whose parameters are stacked along a leading
        axis of layers, as ``nnx.vmap`` over a layer's constructor makes it.
      embed: ``embed(model, batch) -> x``; it must not touch the stack.
      layer: ``layer(one_layer, x) -> x``, ``one_layer`` the stack's module holding one row.
      head: ``head(model, x, batch)``, returning the loss (as the step's contract says).

    Raises:
      TypeError: ``model`` not an NNX module, a variable that is not an ``nnx.Param``, nothing at
        ``stack``, a list of layers there, or its parameters not stacked (each naming the
        LayerStack contract).

    Example:
      >>> import jax.numpy as jnp
      >>> class Model(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.inp, self.out = nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 1, rngs=rngs)
      ...         self.blocks = nnx.vmap(lambda rngs: nnx.Linear(4, 4, rngs=rngs))(rngs.split(2))
      >>> model = Model(nnx.Rngs(0))
      >>> stack = layer_stack(model, "blocks", embed=lambda m, b: m.inp(b["x"]),
      ...                     layer=lambda block, x: jnp.tanh(block(x)), head=lambda m, x, b: jnp.mean(m.out(x)))
      >>> graphdef, params, _ = split(model)
      >>> stack(params, {"x": jnp.ones((2, 3))}).shape
      ()
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"layer_stack: model must be an nnx.Module, got {type(model).__name__}; {CONTRACT}")
    graphdef, params, model_state = split(model)
    if jax.tree.leaves(model_state):
        kinds = sorted({type(v).__name__ for v in jax.tree.leaves(model_state, is_leaf=_is_variable)})
        raise TypeError(
            f"layer_stack: the model holds variables that are not nnx.Param ({', '.join(kinds)}); {CONTRACT}"
        )
    layers = node_at(model, stack)
    if layers is None:
        raise TypeError(f"layer_stack: {type(model).__name__} has no module at {stack!r}; {CONTRACT}")
    if not isinstance(layers, nnx.Module) or isinstance(layers, (nnx.List, nnx.Sequential)):
        raise TypeError(
            f"layer_stack: {type(model).__name__} at {stack!r} is a {type(layers).__name__}, not one module whose "
            f"parameters are stacked (nnx.vmap over the layer's constructor); {CONTRACT}"
        )
    layer_graphdef = nnx.graphdef(layers)
    result = LayerStack(
        lambda top, batch: embed(nnx.merge(graphdef, top, copy=True), batch),
        lambda row, x: layer(nnx.merge(layer_graphdef, row, copy=True), x),
        lambda top, x, batch: head(nnx.merge(graphdef, top, copy=True), x, batch),
        stack,
    )
    result.split(params)  # its refusals, now rather than when the step is traced
    return result


def _is_variable(node: Any) -> bool:
    return isinstance(node, nnx.Variable)


def _holds_state(graphdef: Any) -> bool:
    """Whether the model of ``graphdef`` has variables :func:`split` puts in the model state.

    Read from the variable types the graph definition lists (its nodes, in flax 0.11 and later;
    its attributes before); where it lists none that leanstep can find, the model is taken to hold
    state, as every NNX model was before.
    """
    types, seen, stack = [], set(), [graphdef]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        kind = getattr(node, "type", None)
        if isinstance(kind, type) and issubclass(kind, nnx.Variable):
            types.append(kind)
        if isinstance(node, (list, tuple)):
            stack.extend(node)
        elif dataclasses.is_dataclass(node):
            stack.extend(getattr(node, field.name, None) for field in dataclasses.fields(node))
    return not types or not all(issubclass(kind, (nnx.Param, Fp8, OverwriteWithGradient)) for kind in types)


class Fp8Linear(nnx.Module):
    """``nnx.Linear`` with FP8 operands (:func:`leanstep.blocks.fp8_matmul`), its state in an :class:`Fp8`.

    Example:
      >>> import jax.numpy as jnp
      >>> layer = Fp8Linear(3, 2, recipe=Fp8Recipe(history=4), rngs=nnx.Rngs(0))
      >>> graphdef, params, model_state = split(layer)
      >>> layer(jnp.ones((1, 3))).shape, params["fp8"].get_value().input_history.shape
      ((1, 2), (4,))
    """

    def __init__(self, in_features: int, out_features: int, *, recipe: Fp8Recipe | None = None, rngs: nnx.Rngs):
        self.linear = nnx.Linear(in_features, out_features, rngs=rngs)
        self.recipe = Fp8Recipe() if recipe is None else recipe
        self.fp8 = Fp8(Fp8Meta.create(self.recipe)) if self.recipe.delayed else None

    def __call__(self, x: jax.Array) -> jax.Array:
        meta = None if self.fp8 is None else self.fp8.get_value()
        kernel = self.linear.kernel.get_value().astype(x.dtype)
        out = fp8_matmul(x, kernel, meta, self.recipe)
        if self.linear.bias is None:
            return out
        bias = self.linear.bias.get_value().astype(x.dtype)
        return out + bias.reshape((1,) * (x.ndim - 1) + bias.shape)
