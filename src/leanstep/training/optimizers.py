"""The run's optimizer, ``--optimizer``: AdamW, or Muon for the layers' matrices with AdamW for the rest.

``adamw``: optax's Adam direction (b1 0.9, b2 0.95) plus decoupled weight decay, times the
scheduled learning rate (``--lr``), for every parameter.

``muon``: for each stacked layer matrix (a 3-D leaf, ``(layers, inputs, outputs)``: the blocks'
projections), optax's Muon direction (``optax.contrib.scale_by_muon``: Nesterov momentum 0.95,
orthogonalized by five Newton-Schulz iterations, each layer's matrix on its own) plus decoupled
weight decay, times :data:`MUON_LEARNING_RATE` in place of ``--lr``; for the rest (embeddings,
biases, norms, a head), AdamW as above. Both follow the one schedule's shape: Muon's rate is
``--lr``'s times ``MUON_LEARNING_RATE / lr``.

How it composes with leanstep's step: the optimizer sees the gradient after accumulation,
unscaling and clipping by the global norm, so the clip bounds what enters Muon's momentum, not its
orthogonalized update (whose scale Muon sets); a step whose gradient is not finite is skipped: the
update it computed is dropped, and Muon's momentum, like every part of the state, stays bit for bit.

Example:
  >>> import jax.numpy as jnp
  >>> labels = muon_labels({"blocks": {"w": jnp.zeros((2, 4, 4)), "b": jnp.zeros((2, 4))}, "embed": jnp.zeros((8, 4))})
  >>> labels["blocks"]["w"], labels["blocks"]["b"], labels["embed"]
  ('muon', 'adamw', 'adamw')
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from leanstep.training.schedule import Schedule, scale_by_run_schedule

__all__ = ["MUON_LEARNING_RATE", "OPTIMIZERS", "check_optimizer_name", "muon_labels", "run_optimizer"]

#: ``--optimizer``'s choices.
OPTIMIZERS = ("adamw", "muon")

#: Muon's peak learning rate for the layers' matrices (their orthogonalized updates have singular
#: values near 1, so the rate is about their step's size, not a multiple of the gradient's).
MUON_LEARNING_RATE = 0.02


def muon_labels(params: Any) -> Any:
    """``"muon"`` for each stacked layer matrix (a 3-D leaf), ``"adamw"`` for every other leaf."""
    return jax.tree.map(lambda leaf: "muon" if leaf.ndim == 3 else "adamw", params)


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


def _layer_matrices(params: Any) -> Any:
    # Each layer's (inputs, outputs) matrix is orthogonalized on its own; axis 0 is the layer.
    return jax.tree.map(lambda _: optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2), params)


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
        optax.contrib.scale_by_muon(beta=0.95, weight_dimension_numbers=_layer_matrices),
        decay,
        optax.scale(MUON_LEARNING_RATE / lr),
    )
    return optax.chain(optax.partition({"muon": muon, "adamw": optax.chain(adam, decay)}, muon_labels), scheduled)
