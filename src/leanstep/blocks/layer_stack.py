"""A loss whose layers are a scanned stack: :class:`LayerStack`, the loss the update inside the
backward pass takes (``StepSpec(update_in_backward=True)``, :mod:`leanstep.step.layerwise`).

.. code-block:: text

    x    = embed(top, microbatch)          # top: params, the stack's leaves None
    x    = layer(stack_params[l], x)       # for l = 0 .. L-1: one lax.scan over the stack
    loss = head(top, x, microbatch)        # what the step's LossContract says: a loss, or (sum, count)

The contract (:data:`CONTRACT`): the layers' parameters are one subtree of the params pytree,
found at ``LayerStack.stack`` (a key, or a path of keys, attributes and indices), and every leaf
of it is stacked along a leading axis, one row a layer. A Flax ``nn.scan`` stack, an NNX stack
made with ``nnx.vmap`` and an Equinox one made with ``eqx.filter_vmap`` are such subtrees;
``leanstep.frameworks.linen``, ``.nnx`` and ``.equinox`` each make a LayerStack of one
(``layer_stack``). Called as ``stack(params, batch)`` it is that loss, so the standard step trains
the same model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from leanstep.common.checks import check_callable

__all__ = ["CONTRACT", "LayerStack", "StackPath", "node_at", "require_layer_stack"]

#: Where the stacked layers are: a key of ``params``, or a path of keys, attribute names and indices.
StackPath = str | tuple[str | int, ...]

#: What a model must be for the update inside the backward pass, as every refusal names it.
CONTRACT = (
    "the LayerStack contract (docs/in-backward.md): the layers' parameters are one subtree of params at "
    "LayerStack.stack, every leaf stacked along a leading axis of one row a layer (Flax nn.scan, nnx.vmap, "
    "eqx.filter_vmap; leanstep.frameworks.linen/nnx/equinox.layer_stack make one)"
)

_MISSING = object()


def _child(node: Any, entry: str | int) -> Any:
    """``node``'s child at one entry of a stack path: a mapping's key, a sequence's index or an attribute."""
    if isinstance(node, Mapping):
        return node.get(entry, _MISSING)
    if isinstance(entry, int):
        return node[entry] if isinstance(node, Sequence) and -len(node) <= entry < len(node) else _MISSING
    return getattr(node, entry, _MISSING)


def node_at(root: Any, stack: StackPath) -> Any:
    """The node of ``root`` (params, or a framework's model) at ``stack``, each entry read as
    :class:`LayerStack` reads it; None where there is none.

    Example:
      >>> node_at({"decoder": [{"w": 1}, {"w": 2}]}, ("decoder", 1, "w")), node_at({"a": 1}, "b")
      (2, None)
    """
    for entry in (stack,) if isinstance(stack, str) else stack:
        root = _child(root, entry)
        if root is _MISSING:
            return None
    return root


def _entry(key: Any) -> Any:
    """The key, attribute name or index of one entry of a JAX key path."""
    for field in ("key", "name", "idx"):
        if hasattr(key, field):
            return getattr(key, field)
    return _MISSING


def _refused(what: str) -> str:
    return f"{what}; {CONTRACT}"


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """A loss as embedding, a stack of layers of one structure and a head (see the module doc).

    Attributes:
      embed: ``embed(top, microbatch) -> x``, ``top`` the params with every leaf of the stack
        None (the same tree otherwise); ``x`` any pytree of arrays (the residual stream).
      layer: ``layer(layer_params, x) -> x``, ``layer_params`` one row of every leaf of the stack
        (leaves stacked along their leading axis, one row a layer; the stack's tree structure);
        ``x`` keeps its structure, shapes and dtypes.
      head: ``head(top, x, microbatch)``, returning what the step's loss contract says
        (a scalar loss, or ``(loss_sum, count)`` with ``token_weighted``).
      stack: where the stacked layers are in ``params``: a key (``"blocks"``), or a path of keys,
        attribute names and indices (``("decoder", "layers")``), each entry read as a mapping's
        key, a sequence's index or an attribute.

    Example:
      >>> import jax.numpy as jnp
      >>> stack = LayerStack(
      ...     embed=lambda top, b: b["x"] @ top["w_in"],
      ...     layer=lambda p, x: jnp.tanh(x @ p["w"]),
      ...     head=lambda top, x, b: jnp.mean((x @ top["w_out"] - b["y"]) ** 2),
      ... )
      >>> params = {"w_in": jnp.ones((3, 4)), "blocks": {"w": jnp.zeros((2, 4, 4))}, "w_out": jnp.ones((4, 1))}
      >>> float(stack(params, {"x": jnp.ones((2, 3)), "y": jnp.ones((2, 1))}))
      1.0
      >>> top, layers = stack.split(params)
      >>> top["blocks"], layers["w"].shape
      ({'w': None}, (2, 4, 4))
    """

    embed: Callable[[Any, Any], Any]
    layer: Callable[[Any, Any], Any]
    head: Callable[[Any, Any, Any], Any]
    stack: StackPath = "blocks"

    def __post_init__(self) -> None:
        for name in ("embed", "layer", "head"):
            check_callable(f"LayerStack.{name}", getattr(self, name))
        entries = (self.stack,) if isinstance(self.stack, str) else self.stack
        valid = lambda e: (isinstance(e, str) and e) or (isinstance(e, int) and not isinstance(e, bool))
        if not isinstance(entries, tuple) or not entries or not all(valid(e) for e in entries):
            raise TypeError(
                "LayerStack.stack must be where the stacked layers are in params: a key, or a tuple of keys, "
                f"attribute names and indices, got {self.stack!r}"
            )

    @property
    def path(self) -> tuple[str | int, ...]:
        """``stack`` as a tuple of entries (a key alone is a path of one)."""
        return (self.stack,) if isinstance(self.stack, str) else self.stack

    def stacked_leaves(self, params: Any) -> list[bool]:
        """For each leaf of ``params`` (in ``jax.tree.leaves`` order), whether it is in the stack."""
        depth = len(self.path)
        return [
            tuple(_entry(key) for key in path[:depth]) == self.path
            for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
        ]

    def split(self, params: Any) -> tuple[Any, Any]:
        """``(top, stacked)``: ``params`` with the stack's leaves None, and the stack's subtree.

        Raises:
          TypeError: ``params`` holds nothing at ``stack``, or a list or tuple of layers there, or a
            stacked leaf has no leading axis (each message naming :data:`CONTRACT`).
          ValueError: the stacked leaves differ in their leading axis (the number of layers).
        """
        node = params
        for depth, entry in enumerate(self.path):
            child = _child(node, entry)
            if child is _MISSING:
                where = "params" if depth == 0 else f"params at {self.path[:depth]!r}"
                keys = f" with keys {sorted(map(str, node))}" if isinstance(node, Mapping) else ""
                raise TypeError(
                    _refused(f"params hold no stacked layers under {self.stack!r} (LayerStack.stack): "
                             f"{where} is a {type(node).__name__}{keys}")
                )  # fmt: skip
            node = child
        self._check_stacked(node)
        flat, treedef = jax.tree.flatten(params)
        stacked = self.stacked_leaves(params)
        if sum(stacked) != len(jax.tree.leaves(node)):
            raise TypeError(
                _refused(f"params[{self.stack!r}] is reached by attribute or key, but params' pytree "
                         f"({type(params).__name__}) does not name its leaves so")
            )  # fmt: skip
        top = jax.tree.unflatten(treedef, [None if s else leaf for s, leaf in zip(stacked, flat)])
        return top, node

    def _check_stacked(self, stacked: Any) -> None:
        where = f"params at {self.stack!r}"
        if isinstance(stacked, (list, tuple)):
            raise TypeError(
                _refused(f"{where} is a {type(stacked).__name__} of {len(stacked)} layers, not one stacked layer")
            )
        leaves = jax.tree.leaves(stacked)
        layers = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in leaves}
        if None in layers or not layers:
            raise TypeError(_refused(f"{where}: every leaf needs a leading axis of layers ({len(leaves)} leaves)"))
        if len(layers) > 1:
            raise ValueError(
                _refused(f"{where}: the leaves' leading axes differ ({sorted(layers, key=str)}); one row a layer")
            )

    def __call__(self, params: Any, batch: Any) -> Any:
        top, stacked = self.split(params)
        x = self.embed(top, batch)
        x, _ = jax.lax.scan(lambda carry, layer: (self.layer(layer, carry), None), x, stacked)
        return self.head(top, x, batch)


def require_layer_stack(loss: Any) -> LayerStack:
    """``loss`` if it is a :class:`LayerStack`, for the update inside the backward pass.

    Raises:
      TypeError: it is not, naming :data:`CONTRACT`.
    """
    if not isinstance(loss, LayerStack):
        raise TypeError(
            f"update_in_backward=True needs the loss as a leanstep.LayerStack (embed, layer, head), got "
            f"{type(loss).__name__}: the update inside the backward pass must see the model's layers; {CONTRACT}"
        )
    return loss
