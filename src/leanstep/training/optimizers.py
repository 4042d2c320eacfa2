"""The run's optimizer, ``--optimizer``: AdamW, or Muon for the matrices with AdamW for the rest.

``adamw``: optax's Adam direction (b1 0.9, b2 0.95) plus decoupled weight decay, times the
scheduled learning rate (``--lr``), for every parameter.

``muon``: for each matrix :func:`muon_dimension_numbers` names, optax's Muon direction
(``optax.contrib.scale_by_muon``: Nesterov momentum 0.95, orthogonalized by five Newton-Schulz
iterations) plus decoupled weight decay, times :data:`MUON_LEARNING_RATE` in place of ``--lr``;
for the rest (embeddings, biases, norms, a head), AdamW as above. Both follow the one schedule's
shape: Muon's rate is ``--lr``'s times ``MUON_LEARNING_RATE / lr``.

Which leaves are matrices (:func:`muon_dimension_numbers`, :func:`muon_labels`):

.. code-block:: text

    leanstep's models          each 3-D leaf of params["blocks"]: (layers, in, out), each layer's
    (leanstep.models.MODELS)   matrix on its own; the embeddings, positions and head: AdamW
    any other model            each 2-D leaf: (in, out), as optax.contrib.muon labels, but for a
                               leaf named "bias" (an attention's (heads, head_dim) bias is a
                               vector); every leaf of another rank (biases, norms, an
                               (embed, heads, head_dim) kernel, a convolution's): AdamW, its
                               matrix axes never guessed

A 3-D leaf of a model of your own is not taken for a stack of layers: from its shape alone an
``(embed, heads, head_dim)`` kernel and ``(layers, in, out)`` look the same. Nor can a shape tell
an embedding table or an output head from a hidden matrix: in a model of your own both are 2-D,
so Muon, as optax labels them (leanstep's models keep theirs on AdamW, as Muon's authors advise).
To choose otherwise, start from :func:`muon_dimension_numbers`' tree and give a leaf its axes
(``MuonDimensionNumbers(reduction_axis=0, output_axis=(1, 2))`` for an ``(embed, heads,
head_dim)`` kernel) or None (AdamW), and pass it to ``optax.contrib.muon(...,
muon_weight_dimension_numbers=...)``.

How it composes with leanstep's step: the optimizer sees the gradient after accumulation,
unscaling and clipping by the global norm, so the clip bounds what enters Muon's momentum, not its
orthogonalized update (whose scale Muon sets); a step whose gradient is not finite is skipped: the
update it computed is dropped, and Muon's momentum, like every part of the state, stays bit for bit.

Example:
  >>> import jax.numpy as jnp
  >>> labels = muon_labels({"dense": {"kernel": jnp.zeros((4, 8)), "bias": jnp.zeros(8)},
  ...                       "attention": jnp.zeros((8, 2, 4))})
  >>> labels["dense"]["kernel"], labels["dense"]["bias"], labels["attention"]
  ('muon', 'adamw', 'adamw')
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import optax

from leanstep.training.schedule import Schedule, scale_by_run_schedule

__all__ = [
    "MUON_LEARNING_RATE",
    "OPTIMIZERS",
    "check_optimizer_name",
    "muon_dimension_numbers",
    "muon_labels",
    "run_optimizer",
]

#: ``--optimizer``'s choices.
OPTIMIZERS = ("adamw", "muon")

#: Muon's peak learning rate for the layers' matrices (their orthogonalized updates have singular
#: values near 1, so the rate is about their step's size, not a multiple of the gradient's).
MUON_LEARNING_RATE = 0.02

#: The key under which leanstep's models stack their layers (a leading ``layers`` axis).
_STACK = "blocks"


@functools.cache
def _built_in_layouts() -> frozenset[frozenset[str]]:
    """The top-level names of each built-in model's parameters (from the registry's own ``init``,
    shapes only), which tell leanstep's stacked layout from a model of the user's own."""
    from leanstep.models.registry import MODELS, build_model

    key = jax.random.key(0)
    return frozenset(frozenset(jax.eval_shape(build_model(name, "tiny").init, key)) for name in MODELS)


def _is_built_in(params: Any) -> bool:
    return (
        isinstance(params, Mapping)
        and isinstance(params.get(_STACK), Mapping)
        and frozenset(params) in _built_in_layouts()
    )


def _leaf_dimension_numbers(stacked: bool) -> Any:
    """``(path, leaf) -> MuonDimensionNumbers | None`` for one tree, by the module doc's rule."""
    layer_matrix = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)  # axis 0: the layer
    matrix = optax.contrib.MuonDimensionNumbers(reduction_axis=0, output_axis=1)

    def rule(path: Any, leaf: Any) -> Any:
        if stacked:
            in_stack = bool(path) and getattr(path[0], "key", None) == _STACK
            return layer_matrix if in_stack and leaf.ndim == 3 else None
        named_bias = bool(path) and getattr(path[-1], "key", getattr(path[-1], "name", None)) == "bias"
        return matrix if leaf.ndim == 2 and not named_bias else None

    return rule


def muon_dimension_numbers(params: Any) -> Any:
    """How Muon reads each leaf of ``params``: an ``optax.contrib.MuonDimensionNumbers``, or None
    for a leaf AdamW trains (the module doc's rule), in ``params``' structure.

    It is the form ``optax.contrib.muon(..., muon_weight_dimension_numbers=...)`` takes, so a
    model of your own can start from it and give a leaf of another rank its axes.

    Example:
      >>> import jax.numpy as jnp
      >>> dims = muon_dimension_numbers({"w": jnp.zeros((4, 8)), "b": jnp.zeros(8)})
      >>> dims["w"], dims["b"]
      (MuonDimensionNumbers(reduction_axis=0, output_axis=1), None)
    """
    return jax.tree_util.tree_map_with_path(_leaf_dimension_numbers(_is_built_in(params)), params)


def muon_labels(params: Any) -> Any:
    """``"muon"`` for each leaf :func:`muon_dimension_numbers` gives axes, ``"adamw"`` for the rest:
    the labels of ``optax.partition``."""
    rule = _leaf_dimension_numbers(_is_built_in(params))
    return jax.tree_util.tree_map_with_path(lambda path, leaf: "adamw" if rule(path, leaf) is None else "muon", params)


def check_optimizer_name(name: Any) -> None:
    """Raises ValueError, naming ``--optimizer``, for a name not in :data:`OPTIMIZERS`, or ``muon``
    with an optax that has no Muon over stacked matrices (``optax.contrib.MuonDimensionNumbers``)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    if name == "muon" and not hasattr(optax.contrib, "MuonDimensionNumbers"):
        raise ValueError(
            f"--optimizer muon needs optax.contrib.MuonDimensionNumbers, which optax {optax.__version__} lacks "
            "(0.2.8 has it): pip install -U optax"
        )


def run_optimizer(
    name: str, schedule: Schedule, *, lr: float, weight_decay: float, total: int
) -> optax.GradientTransformation:
    """The optimizer ``name`` (:data:`OPTIMIZERS`) under ``schedule`` (its length ``total`` in the state).

    ``adamw``'s state is the one leanstep runs have always saved (Adam's, the decay's, the
    schedule's), so their checkpoints restore.

    Raises:
      ValueError: ``name`` is not one of :data:`OPTIMIZERS`.
    """
    check_optimizer_name(name)
    scheduled = scale_by_run_schedule(schedule, total=total)
    adam, decay = optax.scale_by_adam(b1=0.9, b2=0.95), optax.add_decayed_weights(weight_decay)
    if name == "adamw":
        return optax.chain(adam, decay, scheduled)
    muon = optax.chain(
        # Muon's partition sees the whole tree, AdamW's leaves masked out: each matrix gets its axes
        optax.contrib.scale_by_muon(beta=0.95, weight_dimension_numbers=muon_dimension_numbers),
        decay,
        optax.scale(MUON_LEARNING_RATE / lr),
    )
    return optax.chain(optax.partition({"muon": muon, "adamw": optax.chain(adam, decay)}, muon_labels), scheduled)
