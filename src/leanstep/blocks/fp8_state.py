r"""FP8 state in the params tree: recognised, set apart, max-reduced, overwritten.

The scales and amax histories of delayed scaling ride the gradient channel, as in Flax's
``fp8_ops`` (its ``_overwrite_with_gradient`` collection) and Transformer Engine: a matmul's
backward pass returns, as the "gradient" of its FP8 state, that state's **new value**. They sit
in the params tree, under an :class:`Fp8State` node (leanstep's own :class:`leanstep.blocks.Fp8Meta`, or
any subtree wrapped in :class:`Fp8Collection`, as the Linen adapter wraps Flax's collection),
so that a model's code reads them where it reads its weights. But they are not parameters:

.. code-block:: text

    microbatches      new values combined by max (elementwise), not summed, never divided
    devices           pmax over the data axes, once per step; replicated, never split
    loss scale        not unscaled (a new value is not multiplied by the scale)
    guarded update    out of the finiteness decision, the global norm, clipping, the optimizer
    applied           overwritten with the new value if the step is applied; a skipped step, or
                      state no matmul used (a zero "gradient"), keeps it bit-identical

Max is the right combination: within one step every microbatch computes the same scales (from
the histories of earlier steps) and the same histories but for the newest entry, the amax it
saw; the max of those is the amax of the whole batch, so M microbatches on D devices give the
bit-identical state of one microbatch on one device (on a mesh, where XLA rounds every bf16
result as the program writes it, ``--xla_allow_excess_precision=false``: a sharded program fuses
otherwise, and by default XLA may keep a bf16 value in float32 where a fusion lets it). A sum
(``optax.MultiSteps`` averages) or the last microbatch's value (a scan's carry) is what peers
have shipped.

Example:
  >>> import jax.numpy as jnp
  >>> params = {"w": jnp.ones(2), "fp8": Fp8Collection({"scale": jnp.ones(1)})}
  >>> trainable, fp8 = split_fp8(params)
  >>> trainable, fp8_leaves(params)
  ({'fp8': None, 'w': Array([1., 1.], dtype=float32)}, [Array([1.], dtype=float32)])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "Fp8Collection",
    "Fp8State",
    "combine_fp8",
    "fp8_leaves",
    "fp8_mask",
    "has_fp8",
    "is_fp8_state",
    "merge_fp8",
    "overwrite_fp8",
    "register_fp8_state_type",
    "split_fp8",
]


class Fp8State:
    """A node of the params tree whose leaves are FP8 state (see the module doc).

    Subclasses: :class:`leanstep.blocks.Fp8Meta` (one matmul's scales and histories) and
    :class:`Fp8Collection` (any subtree, e.g. a Flax ``_overwrite_with_gradient`` collection).
    """


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Fp8Collection(Fp8State):
    """Any subtree of FP8 state whose gradient is its new value, e.g. Flax's
    ``_overwrite_with_gradient`` collection (:func:`leanstep.frameworks.linen.split` wraps it).

    Attributes:
      tree: the subtree (float32 arrays).
    """

    tree: Any

    def tree_flatten(self) -> tuple[tuple[Any], None]:
        return (self.tree,), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: tuple[Any]) -> Fp8Collection:
        return cls(children[0])


#: Node types besides :class:`Fp8State` whose subtree is FP8 state, registered by a framework
#: adapter (the NNX variable type ``nnx.bridge`` gives Flax's ``_overwrite_with_gradient`` collection).
_FP8_TYPES: list[type] = [Fp8State]


def register_fp8_state_type(node_type: type) -> None:
    """Makes every node of ``node_type`` (a pytree node class) a node of FP8 state, as an
    :class:`Fp8State` is: for a framework's own container of it, which cannot subclass it."""
    if node_type not in _FP8_TYPES:
        _FP8_TYPES.append(node_type)


def is_fp8_state(node: Any) -> bool:
    """Whether ``node`` is an :class:`Fp8State` node (or of a registered type)."""
    return isinstance(node, tuple(_FP8_TYPES))


def has_fp8(tree: Any) -> bool:
    """Whether ``tree`` holds FP8 state (statically, from its structure).

    Example:
      >>> has_fp8({"w": 1.0}), has_fp8({"w": 1.0, "fp8": Fp8Collection(1.0)})
      (False, True)
    """
    return any(is_fp8_state(node) for node in jax.tree.leaves(tree, is_leaf=is_fp8_state))


def fp8_mask(tree: Any) -> Any:
    """A tree of the structure of ``tree`` with True at the leaves under an :class:`Fp8State` node.

    Example:
      >>> fp8_mask({"w": 1.0, "fp8": Fp8Collection({"s": 2.0})})
      {'fp8': Fp8Collection(tree={'s': True}), 'w': False}
    """
    return jax.tree.map(
        lambda node: jax.tree.map(lambda _: True, node) if is_fp8_state(node) else False, tree, is_leaf=is_fp8_state
    )


def fp8_leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` under :class:`Fp8State` nodes, in tree order."""
    return [leaf for leaf, fp8 in zip(jax.tree.leaves(tree), jax.tree.leaves(fp8_mask(tree))) if fp8]


def split_fp8(tree: Any) -> tuple[Any, Any]:
    """``(trainable, fp8)``: ``tree`` with its :class:`Fp8State` nodes replaced by None, and
    with everything else replaced by None (each a pytree; :func:`merge_fp8` joins them)."""
    trainable = jax.tree.map(lambda node: None if is_fp8_state(node) else node, tree, is_leaf=is_fp8_state)
    fp8 = jax.tree.map(lambda node: node if is_fp8_state(node) else None, tree, is_leaf=is_fp8_state)
    return trainable, fp8


def merge_fp8(trainable: Any, fp8: Any) -> Any:
    """The tree again from :func:`split_fp8`'s two parts.

    Example:
      >>> params = {"w": 1.0, "fp8": Fp8Collection(2.0)}
      >>> merge_fp8(*split_fp8(params)) == params
      True
    """
    return jax.tree.map(
        lambda t, f: f if t is None else t,
        trainable,
        fp8,
        is_leaf=lambda node: node is None or is_fp8_state(node),
    )


def combine_fp8(tree: Any, other: Any, trainable: Callable[[Any, Any], Any], fp8: Callable[[Any, Any], Any]) -> Any:
    """Leafwise ``trainable(a, b)`` or ``fp8(a, b)`` over two trees of one structure, by where the
    leaf lies (``tree``'s :class:`Fp8State` nodes say; e.g. sum the gradients, max the FP8 state)."""
    leaves, treedef = jax.tree.flatten(tree)
    mask = jax.tree.leaves(fp8_mask(tree))
    others = treedef.flatten_up_to(other)  # type: ignore[attr-defined]  # jaxlib's PyTreeDef, untyped here
    return jax.tree.unflatten(treedef, [(fp8 if m else trainable)(a, b) for a, b, m in zip(leaves, others, mask)])


def overwrite_fp8(old: Any, new: Any, applied: jax.Array) -> Any:
    """The FP8 state after a step: ``new`` where the step is ``applied`` and ``new`` is not all
    zero, else ``old``, bit-identical (a leaf no matmul used has a zero "gradient")."""
    return jax.tree.map(lambda o, n: jnp.where(applied & jnp.any(n != 0), n.astype(o.dtype), o), old, new)
