r"""What :func:`leanstep.verification.verify_step` asks of a training step: :class:`VerifiableStep`, and the probe.

A step is verified by running it, not by reading it. Every check drives the step through one
small protocol, the same for leanstep's own steps (:class:`leanstep.verification.LeanstepStep`)
and for a step written by hand with optax:

.. code-block:: text

    state = init(optimizer, max_grad_norm=c, seed=s, randomness=True, mesh=None)
    state, metrics = step(state, batch, num_microbatches)      # one step, M microbatches
    parts(state) -> {"params": ..., "opt_state": ..., "model_state": ..., "fp8": ...}

``optimizer`` is the one thing verify swaps in: the **probe** (:func:`probe_optimizer`), an
``optax`` transformation that applies plain SGD and keeps in its state the update it was given,
that is, the gradient after everything the step does before its optimizer (accumulation,
unscaling, clipping). Reading that gradient back is what lets a check compare two steps'
gradients to float64 references without knowing how the step computes them.

Example:
  >>> import jax.numpy as jnp
  >>> probe = probe_optimizer()
  >>> params = {"w": jnp.ones(2)}
  >>> updates, state = probe.update({"w": jnp.array([0.5, -2.0])}, probe.init(params), params)
  >>> seen_gradient(state)["w"], updates["w"]
  (Array([ 0.5, -2. ], dtype=float32), Array([-0.0005,  0.002 ], dtype=float32))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import optax

__all__ = ["PARTS", "ProbeState", "VerifiableStep", "find_probe", "probe_optimizer", "seen_gradient"]

#: The parts of a state the checks compare, in the order a report names them.
PARTS = ("params", "opt_state", "model_state", "fp8")

#: The probe's learning rate: small, so that parameters move (a skipped step can be told from an
#: applied one) without the second step of a check leaving the region the first one measured.
PROBE_LEARNING_RATE = 1e-3


class ProbeState(NamedTuple):
    """The probe's state: the last gradient it was given (float32) and how many updates it made."""

    seen: Any
    updates: jax.Array


def probe_optimizer(learning_rate: float = PROBE_LEARNING_RATE) -> optax.GradientTransformation:
    r"""SGD that records its input: :math:`u = -\eta\,g`, and ``state.seen = g`` in float32.

    The recorded gradient is the one the step hands its optimizer, so a check reads what the
    step computed, after accumulation, unscaling and clipping, and nothing the optimizer did.
    """

    def init(params: Any) -> ProbeState:
        return ProbeState(
            jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params), jnp.zeros((), jnp.int32)
        )

    def update(updates: Any, state: ProbeState, params: Any = None) -> tuple[Any, ProbeState]:
        del params
        seen = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), updates)
        moved = jax.tree.map(
            lambda g: (-learning_rate * jnp.asarray(g, jnp.float32)).astype(jnp.result_type(g)), updates
        )
        return moved, ProbeState(seen, state.updates + 1)

    return optax.GradientTransformation(init, update)


def find_probe(opt_state: Any) -> ProbeState | None:
    """The :class:`ProbeState` inside an optimizer state (wrapped by chains or masks), or None."""
    found: list[ProbeState] = []

    def visit(node: Any) -> Any:
        if isinstance(node, ProbeState):
            found.append(node)
        return node

    jax.tree.map(visit, opt_state, is_leaf=lambda node: isinstance(node, ProbeState))
    return found[0] if found else None


def seen_gradient(opt_state: Any) -> Any:
    """The gradient the probe in ``opt_state`` was last given.

    Raises:
      ValueError: ``opt_state`` holds no probe (the step did not build its optimizer state from
        the optimizer :meth:`VerifiableStep.init` was given).
    """
    probe = find_probe(opt_state)
    if probe is None:
        raise ValueError(
            "opt_state: no probe optimizer state found; VerifiableStep.init(optimizer, ...) must build the "
            "optimizer state with the optimizer it is given (chained with the step's own transformations is fine)"
        )
    return probe.seen


@runtime_checkable
class VerifiableStep(Protocol):
    """A training step as :func:`leanstep.verification.verify_step` drives it (see the module doc).

    ``parts(state)`` names the state's parts ``"params"``, ``"opt_state"``, ``"model_state"`` and
    ``"fp8"`` (see :meth:`parts`). A step may also offer ``reference_loss(params, parts, batch)``:
    its unscaled loss, which the ``reference`` check differentiates without the step.

    Attributes:
      batch: one global batch, a pytree of arrays whose leaves share the leading (row) axis.
      split: how the step cuts rows into microbatches: ``"contiguous"`` (microbatch ``j`` is rows
        ``j*B/M ... (j+1)*B/M - 1``) or ``"strided"`` (rows ``j, j+M, j+2M, ...``).
      compute_dtype: the dtype the step's matmuls should run in (the compute-dtype check), or None.
      mask: the name of the batch's token-weight leaf (ones and zeros, rows first), for the
        token-weighting check; None: the loss is not token-weighted.
    """

    batch: Any
    split: str
    compute_dtype: Any
    mask: str | None

    def init(
        self,
        optimizer: optax.GradientTransformation,
        *,
        max_grad_norm: float | None,
        seed: int,
        randomness: bool,
        mesh: Any,
    ) -> Any:
        """The state at step 0, its optimizer state built from ``optimizer``.

        ``max_grad_norm``: the global-norm clip (None: none); ``seed``: the seed of every random
        draw; ``randomness=False``: draw no random numbers (dropout off, or the same key every
        microbatch), so that the gradient checks can compare microbatches one by one;
        ``mesh``: a ``jax.sharding.Mesh`` to run on, or None for one device.
        """
        ...

    def step(self, state: Any, batch: Any, num_microbatches: int) -> tuple[Any, Mapping[str, Any]]:
        """One training step over ``batch`` in ``num_microbatches`` microbatches.

        ``metrics`` may hold ``"grad_norm"`` (the norm before clipping), ``"loss"`` and
        ``"skipped"``; the checks read those it has. ``state`` must stay usable after the call
        (no donated buffers).
        """
        ...

    def parts(self, state: Any) -> Mapping[str, Any]:
        """The state's parts, by the names of :data:`PARTS` (``"params"`` and ``"opt_state"`` at least):

        ``"params"``: the trainable parameters (the gradient's tree); ``"opt_state"``: the optimizer
        state (the probe's inside); ``"model_state"``: what the model carries besides (batch
        statistics, counters; None or absent: none), which a skipped step must keep, the meshes
        check compares and the gradient checks chain through microbatches; ``"fp8"``: the FP8
        scaling state (amax histories), None or absent without FP8.
        """
        ...

    # Optional: ``reference_loss(params, parts, batch) -> (loss, model_state)``, the user's unscaled
    # loss of ``batch`` (a token-weighted loss: its mean over the tokens), no random numbers, at
    # float32 ``params`` and the other ``parts``; the ``reference`` check differentiates it.
    # Optional: ``int8``, the recipe of the model's int8 matmuls (a leanstep.blocks.int8.Int8Recipe;
    # None: none), with ``variant(int8=..., compute_dtype=...)``: the same step with another recipe
    # (None: no int8 matmuls) or computing in another dtype; the int8 checks compare the step with them.

    def poison(self, batch: Any, row: int) -> Any:
        """``batch`` with row ``row``'s loss made non-finite (e.g. NaN in a floating input of that row)."""
        ...
