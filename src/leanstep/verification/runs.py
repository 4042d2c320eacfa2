"""The steps verify's checks run, each run once and shared between the checks that read it.

A check asks :class:`Runs` for a step's outcome: ``Runs.step(batch_name, M, max_grad_norm=...,
randomness=..., seed=...)``. Each setting is started once (:meth:`VerifiableStep.init` with the
probe) and **settled**: a step that is skipped (a dynamic loss scale too high for the batch) is
run again from the state it leaves, until one applies, so that every later run of that setting
starts from a state whose loss scale this batch does not overflow. The microbatch references run
from the same settled state as the steps they are compared with.

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> from leanstep import Accumulation, StepSpec
  >>> from leanstep.verification.leanstep_step import LeanstepStep
  >>> batch = {"x": np.arange(8.0, dtype=np.float32).reshape(4, 2), "y": np.zeros((4, 1), np.float32)}
  >>> setup = LeanstepStep(lambda _: lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
  ...                      {"w": jnp.ones((2, 1))}, batch, StepSpec(accumulation=Accumulation(2)))
  >>> runs = Runs(setup)
  >>> runs.register("batch", batch)
  >>> outcome = runs.step("batch", 2)
  >>> outcome.gradient["w"].tolist(), bool(outcome.metrics["skipped"])
  ([[62.0], [76.0]], False)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from leanstep.verification.batches import batch_rows, microbatch_rows, rows_of
from leanstep.verification.protocol import VerifiableStep, probe_optimizer, seen_gradient
from leanstep.verification.trees import first_difference, to_float64

__all__ = ["Outcome", "Runs"]

#: At most this many skipped steps before a setting is taken as settled anyway (a dynamic scale
#: halves each time: 2**32 down to 1 takes 32).
SETTLE_STEPS = 40


class Outcome(NamedTuple):
    """One step's outcome: the state before and after, its parts, the probe's gradient (float64)."""

    before: Mapping[str, Any]
    after: Mapping[str, Any]
    gradient: dict[str, np.ndarray]
    metrics: Mapping[str, Any]


class Runs:
    """The steps of one verification (see the module doc)."""

    def __init__(self, setup: VerifiableStep, *, settle_batch: str = "batch", num_microbatches: int = 1) -> None:
        self.setup = setup
        self.batches: dict[str, Any] = {}
        self.settle_batch = settle_batch
        self.num_microbatches = num_microbatches
        self._states: dict[tuple[Any, ...], Any] = {}
        self._outcomes: dict[tuple[Any, ...], Outcome] = {}
        self.probe = probe_optimizer()
        self.still = probe_optimizer(0.0)  # records the gradient, moves nothing: for chained references
        self._chains: dict[tuple[Any, ...], list[Outcome]] = {}
        self._reads: bool | None = None
        self._has_model_state: bool | None = None
        self.layouts: tuple[Any, ...] = ()  # the mesh layouts the meshes check compares with one device
        self.token_counts: list[float] = []  # each microbatch's token count in the "uneven" batch
        self._weights: dict[tuple[str, int], tuple[list[float], str]] = {}
        self._variants: dict[tuple[tuple[str, Any], ...], Runs] = {}
        self.meshes: dict[Any, Any] = {}  # each layout's mesh, made once (a step compiles once per mesh)

    def register(self, name: str, batch: Any) -> None:
        """Names a batch the checks will run."""
        self.batches[name] = batch

    def variant(self, **changes: Any) -> Runs:
        """The runs of ``setup.variant(**changes)`` (made once), with the batches and layouts registered here."""
        key = tuple(sorted(changes.items()))
        if key not in self._variants:
            setup: Any = self.setup  # variant is an optional part of the protocol
            made = Runs(
                setup.variant(**changes), settle_batch=self.settle_batch, num_microbatches=self.num_microbatches
            )
            made.batches, made.layouts = dict(self.batches), self.layouts
            self._variants[key] = made
        return self._variants[key]

    def state(
        self,
        *,
        max_grad_norm: float | None = None,
        randomness: bool = False,
        seed: int = 0,
        mesh: Any = None,
        still: bool = False,
    ) -> Any:
        """The settled step-0 state of these settings (built and settled once); ``still``: with the
        probe that moves nothing."""
        key = (max_grad_norm, randomness, seed, None if mesh is None else id(mesh), still)
        if key not in self._states:
            probe = self.still if still else self.probe
            state = self.setup.init(probe, max_grad_norm=max_grad_norm, seed=seed, randomness=randomness, mesh=mesh)
            batch = self.batches.get(self.settle_batch)
            for _ in range(SETTLE_STEPS if batch is not None else 0):
                after, metrics = self.call_step(state, batch, self.num_microbatches)
                if not bool(np.asarray(metrics.get("skipped", False))):
                    break
                state = after
            self._states[key] = state
        return self._states[key]

    def step(
        self,
        batch: str,
        num_microbatches: int,
        *,
        max_grad_norm: float | None = None,
        randomness: bool = False,
        seed: int = 0,
        mesh: Any = None,
        again: int = 0,
    ) -> Outcome:
        """The outcome of one step over the named batch (run once; ``again`` > 0 runs it anew)."""
        key = (batch, num_microbatches, max_grad_norm, randomness, seed, None if mesh is None else id(mesh), again)
        if key not in self._outcomes:
            state = self.state(max_grad_norm=max_grad_norm, randomness=randomness, seed=seed, mesh=mesh)
            after, metrics = self.call_step(state, self.batches[batch], num_microbatches)
            for _ in range(SETTLE_STEPS if batch != "poisoned" else 0):
                # a program the settled scale overflows (one microbatch of the whole batch in float16)
                # settles on its own: the scale is a power of two, the unscaled gradient the same
                if not bool(np.asarray(metrics.get("skipped", False))):
                    break
                state = after
                after, metrics = self.call_step(state, self.batches[batch], num_microbatches)
            before_parts = jax.device_get(dict(self.setup.parts(state)))
            after_parts = jax.device_get(dict(self.setup.parts(after)))
            gradient = to_float64(seen_gradient(after_parts["opt_state"]))
            self._outcomes[key] = Outcome(before_parts, after_parts, gradient, jax.device_get(dict(metrics)))
        return self._outcomes[key]

    def run_from(self, state: Any, batch: Any, num_microbatches: int) -> tuple[Any, Outcome]:
        """One step from ``state`` over ``batch`` (not kept): the state after and the outcome."""
        after, metrics = self.call_step(state, batch, num_microbatches)
        before_parts = jax.device_get(dict(self.setup.parts(state)))
        after_parts = jax.device_get(dict(self.setup.parts(after)))
        gradient = to_float64(seen_gradient(after_parts["opt_state"]))
        return after, Outcome(before_parts, after_parts, gradient, jax.device_get(dict(metrics)))

    def call_step(self, state: Any, batch: Any, num_microbatches: int) -> tuple[Any, Mapping[str, Any]]:
        """``setup.step(state, batch, num_microbatches)``, its output checked.

        Raises:
          TypeError: the step did not return ``(state, metrics)`` with ``metrics`` a mapping.
        """
        out = self.setup.step(state, batch, num_microbatches)
        if not (isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[1], Mapping)):
            raise TypeError(
                "step: VerifiableStep.step(state, batch, num_microbatches) must return (state, metrics), metrics a "
                f"dict (it may be empty); got {_describe(out)}"
            )
        return out[0], out[1]

    def weights(self, batch: str, num_microbatches: int) -> list[float]:
        r"""Each microbatch's weight in the named batch's gradient, as the loss contract implies.

        A token-weighted loss weighs microbatch ``j`` by its share of the batch's tokens,
        :math:`c_j / \sum_k c_k` (an empty microbatch weighs 0), the counts summed from the
        token-weight leaf the setup names (``mask``), or read from its ``token_counts(microbatches)``
        where it has one (leanstep's step, from the loss's own counts); a mean loss weighs each
        :math:`1/M`. A batch with no token at all: :math:`1/M`.
        """
        if (batch, num_microbatches) not in self._weights:
            self._weights[batch, num_microbatches] = self._contract_weights(batch, num_microbatches)
        return self._weights[batch, num_microbatches][0]

    def weighing(self, batch: str, num_microbatches: int) -> str:
        """How :meth:`weights` weighs the named batch's microbatches, in words (``"1/M"``, ``"c_j / sum c
        (the loss's own token counts)"``, ...)."""
        self.weights(batch, num_microbatches)
        return self._weights[batch, num_microbatches][1]

    def _contract_weights(self, batch: str, num_microbatches: int) -> tuple[list[float], str]:
        mask = getattr(self.setup, "mask", None)
        counter = getattr(self.setup, "token_counts", None)
        equal = [1.0 / num_microbatches] * num_microbatches
        microbatches = self.microbatches(batch, num_microbatches)
        if mask is not None:
            counts = [float(np.sum(np.asarray(rows[mask], np.float64))) for rows in microbatches]
            source = f"the {mask!r} leaf's token counts"
        elif callable(counter) and (counted := counter(microbatches)) is not None:
            counts = [float(c) for c in counted]
            source = "the loss's own token counts"
        else:
            return equal, "1/M"
        total = math.fsum(counts)
        if not (total > 0 and math.isfinite(total)):
            return equal, f"1/M (no token in the batch by {source})"
        return [c / total for c in counts], f"c_j / sum c ({source})"

    def microbatches(self, batch: str, num_microbatches: int) -> list[Any]:
        """The microbatches of the named batch, each as a batch of its own."""
        source = self.batches[batch]
        return [
            rows_of(source, rows) for rows in microbatch_rows(batch_rows(source), num_microbatches, self.setup.split)
        ]

    def chain(self, batch: str, num_microbatches: int) -> list[Outcome]:
        """Each microbatch alone, one after the other, through the one-microbatch program, from the
        state the previous one left, with the probe that moves nothing: the params stay, the model
        state advances as it does through the microbatches of one step."""
        key = (batch, num_microbatches)
        if key not in self._chains:
            state, outcomes = self.state(still=True), []
            for microbatch in self.microbatches(batch, num_microbatches):
                state, outcome = self.run_from(state, microbatch, 1)
                outcomes.append(outcome)
            self._chains[key] = outcomes
        return self._chains[key]

    def reads_model_state(self) -> bool:
        """Whether the gradient depends on the model state: microbatch 0 of the batch from the state
        it left against from the first state, bit for bit (False without a model state)."""
        if self._reads is None:
            self._reads = False
            if self.has_model_state():  # else no step need run (the settled state's program is another)
                state = self.state(still=True)
                first = self.chain("batch", self.num_microbatches)[0]
                microbatch = self.microbatches("batch", self.num_microbatches)[0]
                after, _ = self.call_step(state, microbatch, 1)
                _, again = self.run_from(after, microbatch, 1)
                self._reads = first_difference(again.gradient, first.gradient) is not None
        return self._reads

    def has_model_state(self) -> bool:
        """Whether the setup's state has a model state (batch statistics, a counter): read from its
        first state, before any step (a settled state would compile the step with the probe that
        moves nothing, a program no check without a model state runs)."""
        if self._has_model_state is None:
            state = self.setup.init(self.still, max_grad_norm=None, seed=0, randomness=False, mesh=None)
            self._has_model_state = bool(jax.tree.leaves(self.setup.parts(state).get("model_state")))
        return self._has_model_state

    @property
    def rounding_dtype(self) -> Any:
        """The setup's ``rounding_dtype`` (the coarsest format two programs may round its gradient to),
        else its ``compute_dtype``, else float32."""
        return getattr(self.setup, "rounding_dtype", None) or getattr(self.setup, "compute_dtype", None) or "float32"

    def metric(self, name: str) -> float | None:
        """A metric of the first step run (the settled state's), as a float, or None if the step has none."""
        outcome = next(iter(self._outcomes.values()), None)
        value = None if outcome is None else outcome.metrics.get(name)
        return None if value is None else float(np.asarray(value))


def _describe(out: Any) -> str:
    if isinstance(out, tuple | list):
        return f"a {type(out).__name__} of {len(out)} items ({', '.join(type(x).__name__ for x in out[:3])})"
    return f"a {type(out).__name__} (its state alone?)"
