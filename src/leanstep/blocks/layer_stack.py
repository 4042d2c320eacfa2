"""A loss whose layers are a scanned stack: :class:`LayerStack`, the loss the update inside the
backward pass takes (``StepSpec(update_in_backward=True)``, :mod:`leanstep.step.layerwise`).

.. code-block:: text

    x    = embed(top, microbatch)          # top: params without params[stack]
    x    = layer(params[stack][l], x)      # for l = 0 .. L-1: one lax.scan over the stack
    loss = head(top, x, microbatch)        # what the step's LossContract says: a loss, or (sum, count)

Called as ``stack(params, batch)`` it is that loss, so the standard step trains the same model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from leanstep.common.checks import check_callable

__all__ = ["LayerStack"]


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """A loss as embedding, a stack of layers of one structure and a head (see the module doc).

    Attributes:
      embed: ``embed(top, microbatch) -> x``, ``top`` the params without ``params[stack]``;
        ``x`` any pytree of arrays (the residual stream).
      layer: ``layer(layer_params, x) -> x``, ``layer_params`` one row of every leaf of
        ``params[stack]`` (leaves stacked along their leading axis, one row a layer); ``x`` keeps
        its structure, shapes and dtypes.
      head: ``head(top, x, microbatch)``, returning what the step's loss contract says
        (a scalar loss, or ``(loss_sum, count)`` with ``token_weighted``).
      stack: the key of ``params`` (a mapping) that holds the stacked layers.

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
    """

    embed: Callable[[Any, Any], Any]
    layer: Callable[[Any, Any], Any]
    head: Callable[[Any, Any, Any], Any]
    stack: str = "blocks"

    def __post_init__(self) -> None:
        for name in ("embed", "layer", "head"):
            check_callable(f"LayerStack.{name}", getattr(self, name))
        if not isinstance(self.stack, str) or not self.stack:
            raise TypeError(f"LayerStack.stack must be the key of the stacked layers in params, got {self.stack!r}")

    def split(self, params: Any) -> tuple[dict[str, Any], Any]:
        """``(top, stacked)``: the params without ``params[stack]``, and ``params[stack]``.

        Raises:
          TypeError: ``params`` is not a mapping holding ``stack``, or a stacked leaf has no leading axis.
          ValueError: the stacked leaves differ in their leading axis (the number of layers).
        """
        if not isinstance(params, Mapping) or self.stack not in params:
            raise TypeError(
                f"a LayerStack's params must be a mapping with the stacked layers under {self.stack!r} "
                f"(LayerStack.stack), got {type(params).__name__}"
                + (f" with keys {sorted(params)}" if isinstance(params, Mapping) else "")
            )
        stacked = params[self.stack]
        layers = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in jax.tree.leaves(stacked)}
        if None in layers or not layers:
            raise TypeError(f"params[{self.stack!r}]: every leaf needs a leading axis of layers")
        if len(layers) > 1:
            raise ValueError(
                f"params[{self.stack!r}]: the leaves' leading axes differ ({sorted(layers, key=str)}); one row a layer"
            )
        return {k: v for k, v in params.items() if k != self.stack}, stacked

    def __call__(self, params: Any, batch: Any) -> Any:
        top, stacked = self.split(params)
        x = self.embed(top, batch)
        x, _ = jax.lax.scan(lambda carry, layer: (self.layer(layer, carry), None), x, stacked)
        return self.head(top, x, batch)
