"""Flax Linen models in leanstep's step: the ``params`` collection trains, the others are model state.

.. code-block:: python

    variables = module.init(key, x, train=False)
    params, model_state = leanstep.frameworks.linen.split(variables)

    def loss_fn(params, model_state, batch, key):
        logits, model_state = leanstep.frameworks.linen.apply(
            module, params, model_state, batch["x"], train=True, rngs={"dropout": key})
        return cross_entropy(logits, batch["y"]), model_state

    step = leanstep.make_train_step(loss_fn, has_state=True, uses_rng=True)

:func:`apply` is ``module.apply`` with every collection but ``params`` mutable; a model with
no other collection gets ``model_state = {}`` and may use a plain loss without ``has_state``.

FP8 (Flax's ``fp8_ops``, or leanstep's :class:`Fp8DotGeneral` as a ``dot_general_cls``): the
``_overwrite_with_gradient`` collection, whose "gradient" is its new value, is neither
parameters nor model state. :func:`split` puts it beside the parameters, wrapped in an
:class:`leanstep.blocks.fp8_state.Fp8Collection` (``params = {"params": ..., "_overwrite_with_gradient":
Fp8Collection(...)}``), so the step differentiates it, combines its new values by max over
microbatches and devices, leaves it out of the loss scale, the norm, clipping and the
optimizer, and writes it once per step; :func:`apply` and :func:`merge` unwrap it. The model
code is unchanged.

The update inside the backward pass (``StepSpec(update_in_backward=True)``) takes a model whose
layers are an ``nn.scan``: :func:`layer_stack` makes its :class:`leanstep.LayerStack` from the
model's embedding and head methods and the scanned module.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from leanstep.blocks.fp8 import Fp8Recipe
from leanstep.blocks.fp8_dot import Fp8Meta, fp8_dot_general
from leanstep.blocks.fp8_state import Fp8Collection
from leanstep.blocks.layer_stack import CONTRACT, LayerStack, StackPath
from leanstep.blocks.loss_contract import unbound_axis_message

__all__ = ["OVERWRITE_WITH_GRADIENT", "Fp8DotGeneral", "apply", "layer_stack", "merge", "split"]

#: Flax's name of the collection whose gradient is its new value (``flax.linen.fp8_ops``).
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


def split(variables: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(variables["params"], {every other collection})``; with an ``_overwrite_with_gradient``
    collection (FP8), ``({"params": ..., "_overwrite_with_gradient": Fp8Collection(...)}, {the others})``.

    Raises:
      ValueError: ``variables`` has no ``params`` collection.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> module = nn.BatchNorm(use_running_average=False)
      >>> params, model_state = split(module.init(jax.random.key(0), jnp.ones((4, 3))))
      >>> sorted(params), sorted(model_state["batch_stats"])
      (['bias', 'scale'], ['mean', 'var'])
    """
    if "params" not in variables:
        raise ValueError(f"variables have no 'params' collection, only {sorted(variables)}")
    others = {name: value for name, value in variables.items() if name not in ("params", OVERWRITE_WITH_GRADIENT)}
    if OVERWRITE_WITH_GRADIENT not in variables:
        return variables["params"], others
    fp8 = Fp8Collection(variables[OVERWRITE_WITH_GRADIENT])
    return {"params": variables["params"], OVERWRITE_WITH_GRADIENT: fp8}, others


def _is_with_fp8(params: Any) -> bool:
    return isinstance(params, Mapping) and isinstance(params.get(OVERWRITE_WITH_GRADIENT), Fp8Collection)


def merge(params: Any, model_state: Mapping[str, Any]) -> dict[str, Any]:
    """The ``variables`` dict again, for ``module.apply`` (FP8 state unwrapped)."""
    if _is_with_fp8(params):
        return {
            "params": params["params"],
            OVERWRITE_WITH_GRADIENT: params[OVERWRITE_WITH_GRADIENT].tree,
            **model_state,
        }
    return {"params": params, **model_state}


def apply(
    module: nn.Module,
    params: Any,
    model_state: Mapping[str, Any],
    *args: Any,
    axis_name: str | None = None,
    **kwargs: Any,
) -> tuple[Any, dict[str, Any]]:
    """``module.apply`` with the model state's collections mutable: ``(out, new_model_state)``.

    Keyword arguments (``rngs=``, ``train=``, ...) go to ``module.apply``. ``axis_name`` binds the
    name a model written for ``pmap`` reduces over (``nn.BatchNorm(axis_name="batch")``, as in
    flax's imagenet ResNet) to an axis of one member, so its ``pmean`` is the identity: leanstep's
    step hands the loss the whole (micro)batch, whose statistics are already the global ones
    (without it, or with another name than the module's, a ``ValueError`` naming the module's).

    Raises:
      TypeError: ``axis_name`` not a non-empty string.
      ValueError: the module reduces over an axis name that ``axis_name`` does not bind (at trace time).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> module = nn.BatchNorm(use_running_average=False, momentum=0.5)
      >>> params, model_state = split(module.init(jax.random.key(0), jnp.ones((4, 3))))
      >>> y, model_state = apply(module, params, model_state, jnp.full((4, 3), 2.0))
      >>> model_state["batch_stats"]["mean"]
      Array([1., 1., 1.], dtype=float32)
    """
    if axis_name is not None and (not isinstance(axis_name, str) or not axis_name):
        raise TypeError(f"axis_name must be a non-empty string (the module's axis_name=), got {axis_name!r}")
    try:
        return _apply(module, params, model_state, args, axis_name, kwargs)
    except NameError as error:  # JAX's "unbound axis name: NAME": a pmap-written module, its axis not bound
        unbound = re.search(r"unbound axis name: ([^\s.,]+)", str(error))
        if unbound is None:
            raise
        raise ValueError(unbound_axis_message(unbound[1], type(module).__name__, axis_name)) from None


def _apply(
    module: nn.Module, params: Any, model_state: Mapping[str, Any], args: tuple, axis_name: str | None, kwargs: dict
) -> tuple[Any, dict[str, Any]]:
    """:func:`apply`, its ``axis_name`` bound to an axis of one member by ``jax.vmap``."""
    if axis_name is not None:
        bound = lambda p, s, *a: _apply(module, p, s, a, None, kwargs)
        return jax.vmap(bound, in_axes=None, out_axes=None, axis_name=axis_name, axis_size=1)(
            params, model_state, *args
        )
    variables = merge(params, model_state)
    if not model_state:
        return module.apply(variables, *args, **kwargs), dict(model_state)
    out, updates = module.apply(variables, *args, mutable=list(model_state), **kwargs)
    return out, {**model_state, **updates}


def layer_stack(
    module: nn.Module,
    stack: StackPath,
    *,
    layer: nn.Module,
    embed: str | Callable[..., Any],
    head: str | Callable[..., Any],
) -> LayerStack:
    """A Linen model whose layers are an ``nn.scan`` as a :class:`leanstep.LayerStack`, over the
    params :func:`split` gives (``variables["params"]``; no other collection).

    .. code-block:: text

        x    = module.apply({"params": top}, batch, method=embed)
        x, _ = layer.apply({"params": params[stack][l]}, x, None)     for l = 0 .. L-1
        loss = module.apply({"params": top}, x, batch, method=head)

    Args:
      module: the model, its layers an ``nn.scan(Layer, variable_axes={"params": 0}, ...)``
        submodule (its parameters stacked along a leading axis of layers).
      stack: the scanned submodule's name (``"blocks"``), or the path of names to it through the
        submodules that hold it (``("decoder", "blocks")``).
      layer: one layer, an instance of the class ``nn.scan`` scans with the same attributes, called
        as ``nn.scan`` calls it with the carry ``x`` and no per-layer input: ``x, _ = layer(x, None)``.
      embed: the model's method ``embed(module, batch) -> x``, by name or as a function, as
        ``module.apply(method=)`` takes it (a setup-style model's method; Linen allows one
        ``@nn.compact`` method).
      head: its method ``head(module, x, batch)``, returning the loss (as the step's contract says).

    Raises:
      TypeError: ``module`` or ``layer`` not a Linen module, or ``embed``/``head`` neither a method's
        name nor callable; at trace time, params with no stacked layers at ``stack`` or a row of
        another shape than ``layer``'s own parameters (each naming the LayerStack contract).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> class Block(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x, _):
      ...         return x + jnp.tanh(nn.Dense(4)(x)), None
      >>> class Model(nn.Module):
      ...     def setup(self):
      ...         self.inp, self.out = nn.Dense(4), nn.Dense(1)
      ...         self.blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)()
      ...     def embed(self, batch):
      ...         return self.inp(batch["x"])
      ...     def head(self, x, batch):
      ...         return jnp.mean((self.out(x) - batch["y"]) ** 2)
      ...     def __call__(self, batch):
      ...         return self.head(self.blocks(self.embed(batch), None)[0], batch)
      >>> batch = {"x": jnp.ones((2, 3)), "y": jnp.zeros((2, 1))}
      >>> params, _ = split(Model().init(jax.random.key(0), batch))
      >>> stack = layer_stack(Model(), "blocks", layer=Block(), embed="embed", head="head")
      >>> bool(jnp.allclose(stack(params, batch), Model().apply({"params": params}, batch)))
      True
    """
    for name, value in (("module", module), ("layer", layer)):
        if not isinstance(value, nn.Module):
            raise TypeError(f"layer_stack: {name} must be a Linen module, got {type(value).__name__}; {CONTRACT}")
    for name, method in (("embed", embed), ("head", head)):
        if not (callable(method) or (isinstance(method, str) and callable(getattr(type(module), method, None)))):
            raise TypeError(
                f"layer_stack: {name} must be a method of {type(module).__name__} (its name, or a function of "
                f"the module), got {method!r}; {CONTRACT}"
            )

    def embed_fn(top: Any, batch: Any) -> Any:
        return module.apply({"params": top}, batch, method=embed)

    def layer_fn(row: Any, x: Any) -> Any:
        _check_row(layer, stack, row, x)
        out = layer.apply({"params": row}, x, None)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"layer_stack: {type(layer).__name__}(x, None) must return nn.scan's (carry, output), "
                f"got {type(out).__name__}; {CONTRACT}"
            )
        return out[0]

    def head_fn(top: Any, x: Any, batch: Any) -> Any:
        return module.apply({"params": top}, x, batch, method=head)

    return LayerStack(embed_fn, layer_fn, head_fn, stack)


def _check_row(layer: nn.Module, stack: StackPath, row: Any, x: Any) -> None:
    """One row of the stack has the shapes of ``layer``'s own parameters for the input ``x``."""
    shapes = lambda tree: [(jax.tree_util.keystr(path), jnp.shape(leaf)) for path, leaf in
                           jax.tree_util.tree_flatten_with_path(tree)[0]]  # fmt: skip
    own = jax.eval_shape(lambda x: layer.init(jax.random.key(0), x, None)["params"], x)
    if shapes(own) != shapes(row):
        raise ValueError(
            f"layer_stack: a row of params at {stack!r} is {dict(shapes(row))}, but {type(layer).__name__}'s own "
            f"parameters are {dict(shapes(own))}; {CONTRACT}"
        )


class Fp8DotGeneral(nn.Module):
    """leanstep's FP8 matmul (:func:`leanstep.blocks.fp8_dot_general`) as a Linen ``dot_general_cls``:
    ``nn.Dense(features, dot_general_cls=Fp8DotGeneral)``, its :class:`leanstep.blocks.Fp8Meta` in the
    ``_overwrite_with_gradient`` collection (delayed scaling), as Flax's ``Fp8DirectDotGeneralOp``.

    Attributes:
      recipe: the :class:`leanstep.Fp8Recipe` (default: delayed scaling, history 1024).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functools import partial
      >>> dense = nn.Dense(2, dot_general_cls=partial(Fp8DotGeneral, recipe=Fp8Recipe(history=4)))
      >>> params, model_state = split(dense.init(jax.random.key(0), jnp.ones((1, 3))))
      >>> params["_overwrite_with_gradient"].tree["Fp8DotGeneral_0"]["meta"].grad_history.shape
      (4,)
    """

    recipe: Fp8Recipe = Fp8Recipe()

    @nn.compact
    def __call__(self, lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None, **kwargs: Any) -> Any:
        if self.recipe.delayed:
            meta = self.variable(OVERWRITE_WITH_GRADIENT, "meta", Fp8Meta.create, self.recipe).value
        else:
            meta = None
        dtype = jnp.result_type(lhs, rhs)
        return fp8_dot_general(
            jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), dimension_numbers, meta=meta, recipe=self.recipe
        )
