"""The plan when the standard step does not fit: the update inside the backward pass (issue 59).

The update inside the backward pass (``StepSpec(update_in_backward=True)``,
:mod:`leanstep.step.layerwise`) never holds the whole model's float32 gradient, one layer's at a
time, at about 1.75 times the standard step's FLOPs (two backward passes). So
:func:`leanstep.planning.plan` tries it only where no standard candidate fits and the loss has
a :class:`leanstep.LayerStack` form (``stack=``); a plain loss function keeps the plain answer,
a :class:`~leanstep.planning.records.BudgetError`.

.. code-block:: text

    standard   = plan(candidates)                        # BudgetError: none fits
    settings   = one per (microbatches, precision)       # remat does not apply: each layer is
                                                         # recomputed in the backward pass
    chosen     = plan(stack, settings, update_in_backward=True).chosen
    notes[0]   = why: both peaks, and the FLOPs against the standard step that came closest
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from leanstep.common.memory_sizes import format_bytes
from leanstep.planning.records import BudgetError, Candidate, Plan, Setting, known

__all__ = ["in_backward_reason", "in_backward_settings", "plan_in_backward"]


def in_backward_settings(settings: Sequence[Setting]) -> tuple[Setting, ...]:
    """``settings`` for the update inside the backward pass: one per microbatch count and precision
    (remat ``"none"``: the step recomputes each layer itself), in the order given.

    Example:
      >>> [s.describe() for s in in_backward_settings([Setting(1, "dots", "float32"), Setting(1, "full", "float32")])]
      ['--microbatches 1 --remat none --update-in-backward on']
    """
    return tuple(dict.fromkeys(s._replace(remat="none", update_in_backward=True) for s in settings))


def in_backward_reason(standard: BudgetError, chosen: Candidate) -> str:
    """The plan's line of why it chose the update inside the backward pass.

    Example:
      >>> smallest = Candidate(Setting(4, "full", "float32"), flops=2e9, peak_bytes=3 * 2**20)
      >>> chosen = Candidate(Setting(1, "none", "float32", update_in_backward=True), flops=3.5e9, peak_bytes=2**20)
      >>> print(in_backward_reason(BudgetError(2 * 2**20, smallest, (smallest,)), chosen))
      the standard step does not fit in 2.0 MiB (its smallest peak 3.0 MiB, with --microbatches 4 --remat full); the update inside the backward pass does (1.0 MiB, with --microbatches 1), at 1.75x that step's FLOPs (two backward passes)
    """
    smallest = standard.smallest
    ratio = known(chosen.flops) / known(smallest.flops)
    return (
        f"the standard step does not fit in {format_bytes(standard.budget_bytes)} (its smallest peak "
        f"{format_bytes(smallest.peak_bytes)}, with {smallest.setting.describe()}); the update inside the backward "
        f"pass does ({format_bytes(chosen.peak_bytes)}, with --microbatches {chosen.setting.num_microbatches}), at "
        f"{ratio:.2f}x that step's FLOPs (two backward passes)"
    )


def plan_in_backward(standard: BudgetError, replan: Callable[[], Plan], seconds: float) -> Plan:
    """The plan of the update inside the backward pass, after the standard step's ``standard`` failed.

    Args:
      standard: the standard candidates' error (none fits).
      replan: plans the same candidates with the update inside the backward pass
        (:func:`in_backward_settings`).
      seconds: the time the standard candidates took.

    Returns:
      ``replan()``'s plan with the standard candidates before its own, the time of both, and
      :func:`in_backward_reason` as its first note.

    Raises:
      BudgetError: neither fits; its smallest peak is the smaller of the two.
    """
    try:
        found = replan()
    except BudgetError as error:
        candidates = standard.candidates + error.candidates
        smallest = min((c for c in candidates if c.compiled), key=lambda c: known(c.peak_bytes))
        raise BudgetError(
            standard.budget_bytes, smallest, candidates, standard.max_microbatches, standard.min_microbatch_rows
        ) from None
    return dataclasses.replace(
        found,
        candidates=standard.candidates + found.candidates,
        seconds=found.seconds + seconds,
        notes=(in_backward_reason(standard, found.chosen), *found.notes),
    )
