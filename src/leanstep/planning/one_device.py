r"""Pick the number of microbatches and the remat policy for a memory budget, before running.

For every candidate setting the train step is traced and compiled ahead of time on
``jax.ShapeDtypeStruct`` stand-ins (nothing is materialized, nothing runs), and XLA's
own accounting of the compiled executable gives its memory:

.. code-block:: text

    peak  = arguments + outputs - aliased + temporaries       (memory_analysis(), bytes)
    flops = count_flops(traced step)                          (loop bodies x trip count)

``aliased`` is the part of the outputs that reuses donated argument buffers (the new
state written over the old one), so it is not new memory. ``temporaries`` is XLA's
buffer assignment for everything live inside the step (activations, residuals,
gradient accumulator, optimizer temporaries), already packed by its liveness analysis.
XLA's ``cost_analysis()`` FLOPs are reported too (``xla_flops``), but they count a
while loop's body once, so they fall as ``1 / num_microbatches``: they cannot rank
microbatch counts.

The chosen setting fits the budget and is predicted fastest (``rtol``: :class:`SearchOptions`)::

    fitting  = [c for c in candidates if c.peak_bytes <= budget]
    close    = [c for c in fitting if c.flops <= (1 + rtol) * min(f.flops for f in fitting)]
    chosen   = min(close, key=(num_microbatches, flops))

FLOPs within ``rtol`` count as equal because accumulation adds a few FLOPs per
microbatch; without the tolerance a 0.01% difference would beat the microbatch count.
Compiling dominates planning time (tracing is ~0.3 s a candidate, compiling several),
so candidates are compiled lazily. Settings that differ only in the microbatch count
form a family, ranked by the FLOPs of its fewest-microbatch member (the only one
traced up front); families go in order of FLOPs, and in each the search tries the fewest
microbatches, then the most (if that does not fit, no count does), then bisects: this
assumes the peak does not grow with the microbatch count, as activations shrink with
the microbatch. Where it fails (a model so small that per-microbatch overhead outweighs
its activations) the choice still fits, since it was compiled, but may use more
microbatches than needed. Families whose FLOPs exceed the best fitting one's by more
than ``rtol`` are never compiled, and nothing more is compiled once the arguments alone
(the state and the batch, the same for every candidate) exceed the budget.
``SearchOptions(exhaustive=True)`` compiles every candidate. Where none fits and the loss has a
:class:`leanstep.LayerStack` form (``stack=``), the same candidates are tried with the update
inside the backward pass (:mod:`leanstep.planning.in_backward`).

Size: plan() and its lazy search (families, bisection, the choice) are one procedure over the
same traced steps; its inputs, notes and fallback are modules of their own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

from leanstep.common.memory_sizes import parse_bytes
from leanstep.common.removed import refuses_removed_keywords
from leanstep.inspection.flops import count_flops
from leanstep.planning.candidates import abstract_tree, compile_candidate, compiler_options_for, first_fit
from leanstep.planning.eager_state import eager_state_notes
from leanstep.planning.fp8_sizes import fp8_notes
from leanstep.planning.in_backward import in_backward_settings, plan_in_backward
from leanstep.planning.one_device_grid import checked_settings, settings_grid
from leanstep.planning.plan_inputs import (
    TreesGiven,
    abstract_state,
    batch_size_of,
    batch_statistics_notes,
    candidate_spec,
    holds_model_state,
    params_for,
    plan_spec,
    state_format_notes,
    trace_refusing_structure_errors,
)
from leanstep.planning.records import BudgetError, Candidate, Plan, Setting, known
from leanstep.planning.search_options import SearchOptions, SearchSpace
from leanstep.step.spec import StepSpec
from leanstep.step.train_step import make_train_step

__all__ = [
    "BudgetError",
    "Candidate",
    "Plan",
    "SearchOptions",
    "SearchSpace",
    "Setting",
    "choose",
    "plan",
    "search_candidates",
    "settings_grid",
]


@refuses_removed_keywords("plan")
def plan(
    make_loss_fn: Callable[[str], Callable[..., Any]],
    params: Any,
    batch: Any,
    optimizer: optax.GradientTransformation,
    spec: StepSpec | None = None,
    *,
    budget_bytes: int | str,
    candidates: Sequence[tuple[Any, ...]] | SearchSpace | None = None,
    search: SearchOptions | None = None,
    model_state: Any = None,
    num_devices: int | None = None,
    accelerator: Any = "h100",
    stack: Any = None,
) -> Plan:
    """Compiles (never runs) the train step for each candidate and picks the fastest that fits.

    With ``num_devices`` it plans a cluster instead: mesh, microbatches, remat and reduction
    per device, priced on ``accelerator`` (:func:`leanstep.planning.cluster.plan_cluster`, to
    which ``candidates``, a :class:`SearchSpace`, goes as its ``space``; a model with partition
    rules calls ``plan_cluster(..., rules=...)`` itself).

    See the module doc for the peak formula and the choice. Steps are built with
    :func:`leanstep.make_train_step` from ``spec`` (jitted, state donated) exactly as a run builds them.
    0.8.0's flat search keywords (``flops_rtol=``, ``exhaustive=``, ``remat_policies=``, ...) were
    removed in 0.12: a TypeError names their place in ``search=`` or ``candidates=``.

    Args:
      make_loss_fn: ``make_loss_fn(remat_policy) -> loss_fn(params, batch)``.
      params: the parameters, as arrays or ``jax.ShapeDtypeStruct`` (only shapes are used); or a
        params builder, a callable ``policy -> params``, for remat policies that change the params'
        structure (:mod:`leanstep.planning.plan_inputs`). Given one tree, a policy whose loss
        fails on its structure is refused with a ``ValueError`` naming it.
      batch: one full batch, arrays or ``ShapeDtypeStruct``; leaves share the leading batch axis.
      optimizer: the ``optax.GradientTransformation`` of the run.
      spec: the run's :class:`leanstep.StepSpec` (None: ``StepSpec()``): the plan searches its
        microbatch count and remat, and (for the default candidates, at its precision) keeps the
        rest; the state is built from it too (its loss scale, masters, moments, spike guard).
        ``StepSpec.from_keywords(...)`` makes one of :func:`leanstep.make_train_step`'s keywords
        (0.11's ``plan(..., max_grad_norm=...)``: a TypeError names that spelling).
      budget_bytes: bytes, or a size string such as ``"512MiB"`` (see :func:`leanstep.common.memory_sizes.parse_bytes`).
      candidates: what to try: ``(num_microbatches, remat, precision)`` settings, or a
        :class:`SearchSpace` (its policies times its microbatch counts, every divisor of the
        batch size by default, at ``precision``); default ``SearchSpace()``, every policy of
        :data:`REMAT_POLICIES`.
      search: how (:class:`SearchOptions`): ``rtol``, FLOPs within this relative distance of
        the fewest count as equal; ``exhaustive``, compile every candidate, not only those that
        could be chosen; ``compiler_options`` for ``compile()`` (``"auto"``: LLVM -O0 on CPU,
        which leaves every memory number unchanged).
      model_state: the model's state for a stateful loss (arrays or ``ShapeDtypeStruct``; the
        spec's loss contract says ``has_state``), or a builder ``policy -> model state`` (as ``params``: a remat
        that renames the blocks renames their batch statistics too), or None. Each microbatch
        computes its own batch statistics (BatchNorm), so the plan says so in :attr:`Plan.notes`;
        bound the count with ``SearchSpace(max_microbatches=...)``. A :class:`SearchSpace` leaves
        out microbatches of fewer than ``min_microbatch_rows`` rows, 16 by default with a model
        state (a list of ``candidates`` is planned as given).
      num_devices: plan a cluster of this many devices.
      accelerator: the accelerator the cluster's plan is priced on.
      stack: the loss as a :class:`leanstep.LayerStack` (the same model, under the loss contract
        of ``spec``), or None: where no candidate fits, the same candidates with the update inside
        the backward pass (one per microbatch count: remat does not apply), its reason the first note.

    Returns:
      A :class:`Plan`.

    Raises:
      BudgetError: no candidate fits (the message names the smallest peak and its setting, and
        ``SearchSpace.max_microbatches`` where it was bounded).
      ValueError, TypeError: a bad budget, spec, candidate or option; no microbatch count within
        ``SearchSpace.max_microbatches`` and ``min_microbatch_rows``; a remat policy that changes
        the structure of the params or the model state given as one tree.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> def make_loss_fn(policy):
      ...     def loss_fn(p, b):
      ...         return jnp.mean(jnp.tanh(b["x"] @ p["w"]) ** 2)
      ...     return loss_fn
      >>> params, batch = {"w": jnp.ones((8, 8))}, {"x": jnp.ones((4, 8))}
      >>> p = plan(make_loss_fn, params, batch, optax.sgd(0.1), StepSpec(max_grad_norm=1.0), budget_bytes="1MiB",
      ...          candidates=[(1, "none", "float32"), (2, "none", "float32")])
      >>> p.chosen.setting[:3], p.chosen.fits
      ((1, 'none', 'float32'), True)
    """
    search = SearchOptions() if search is None else search
    spec = plan_spec(spec)
    if num_devices is not None:
        from leanstep.planning.cluster import plan_cluster

        if (candidates is not None and not isinstance(candidates, SearchSpace)) or model_state is not None:
            raise ValueError(
                "a list of candidates= and model_state= plan one device; for num_devices= give "
                "candidates=SearchSpace(meshes=..., remat_policies=..., reductions=..., microbatches=...)"
            )
        return plan_cluster(
            make_loss_fn, params, batch, optimizer, spec, num_devices=num_devices, budget_bytes=budget_bytes,
            accelerator=accelerator, space=candidates, search=search,
        )  # fmt: skip
    start = time.perf_counter()
    budget = parse_bytes(budget_bytes)
    if not callable(make_loss_fn):
        raise TypeError(f"make_loss_fn must be callable, got {type(make_loss_fn).__name__}")
    batch_size = batch_size_of(batch)
    space = SearchSpace() if candidates is None else candidates
    # A model state without leaves (an NNX model's without BatchNorm) holds no batch statistics.
    stateful = isinstance(space, SearchSpace) and holds_model_state(model_state, space.remat_policies[0])
    rows = space.min_rows(stateful) if isinstance(space, SearchSpace) else None
    settings = checked_settings(space, batch_size, str(spec.precision), rows)
    if spec.update_in_backward:
        settings = list(in_backward_settings(settings))
    state_for = lambda p: abstract_state(params_for(params, p), optimizer, spec, params_for(model_state, p))
    steps = _Steps(make_loss_fn, state_for, abstract_tree(batch), spec, TreesGiven.of(params, model_state))
    options = compiler_options_for(search.compiler_options, jax.default_backend())
    compile_at = lambda i, c: compile_candidate(steps.trace(c), steps.traced[c.setting], budget, options)
    final = search_candidates(_traced_families(settings, steps), compile_at, search.rtol, search.exhaustive, budget)
    chosen = choose(final, search.rtol)
    bound = space.max_microbatches if isinstance(space, SearchSpace) else None
    if chosen is None:
        smallest = min((c for c in final if c.compiled), key=lambda c: known(c.peak_bytes))
        error = BudgetError(budget, smallest, final, bound, rows if rows != 1 else None)
        if stack is None or spec.update_in_backward:
            raise error
        replan = lambda: plan(lambda _: stack, params, batch, optimizer, spec.replace(update_in_backward=True),
                              budget_bytes=budget, candidates=settings, search=search, model_state=model_state)  # fmt: skip
        return plan_in_backward(error, replan, time.perf_counter() - start)
    remat = chosen.setting.remat
    notes = batch_statistics_notes(
        params_for(model_state, remat), chosen.setting.num_microbatches, batch_size, rows
    ) + fp8_notes(steps.states[remat], steps.traced[chosen.setting].jaxpr)
    notes += state_format_notes(params_for(params, remat), optimizer, spec, params_for(model_state, remat))
    notes += eager_state_notes(params_for(params, remat), chosen.peak_bytes, budget)
    return Plan(budget, final, chosen, time.perf_counter() - start, notes=notes)


class _Steps:
    """Traces a setting's step once (its loss and state made once per policy); keeps the traced steps.

    ``given``: whether the policies share one params tree, one model state: a loss failing on the
    structure of one is refused, naming the builder to pass (:func:`trace_refusing_structure_errors`).
    """

    def __init__(
        self,
        make_loss_fn: Callable[[str], Any],
        state_for: Callable[[str], Any],
        batch: Any,
        spec: StepSpec,
        given: TreesGiven,
    ):
        self.make_loss_fn, self.state_for, self.batch, self.spec = make_loss_fn, state_for, batch, spec
        self.given = given
        self.loss_fns: dict[str, Callable[..., Any]] = {}
        self.states: dict[str, Any] = {}
        self.traced: dict[Setting, Any] = {}

    def trace(self, candidate: Candidate) -> Candidate:
        """``candidate`` with its FLOPs and trace time (as it is, if already traced)."""
        s, t0 = candidate.setting, time.perf_counter()
        if s in self.traced:
            return candidate
        if s.remat not in self.loss_fns:
            self.loss_fns[s.remat] = self.make_loss_fn(s.remat)
            self.states[s.remat] = self.state_for(s.remat)
        step = make_train_step(self.loss_fns[s.remat], candidate_spec(self.spec, s))
        state = self.states[s.remat]
        self.traced[s] = trace_refusing_structure_errors(lambda: step.trace(state, self.batch), s.remat, self.given)
        flops = count_flops(self.traced[s].jaxpr)
        return dataclasses.replace(candidate, flops=flops, trace_seconds=time.perf_counter() - t0)


def _traced_families(settings: Sequence[Setting], steps: _Steps) -> list[Candidate]:
    """A candidate per setting (duplicates dropped), each family's fewest-microbatch member traced.

    A family's FLOPs are that member's (more microbatches add <0.1%): the others are traced
    only when compiled.
    """
    initial = [Candidate(s) for s in dict.fromkeys(settings)]
    first: dict[tuple[Any, ...], int] = {}  # by everything of a setting but its microbatches
    for i, c in enumerate(initial):
        j = first.setdefault(c.setting[1:], i)
        first[c.setting[1:]] = i if c.setting.num_microbatches < initial[j].setting.num_microbatches else j
    for i in first.values():
        initial[i] = steps.trace(initial[i])
    return initial


def choose(candidates: Sequence[Candidate], rtol: float) -> Candidate | None:
    """The rule of the module doc: fitting, FLOPs within ``rtol`` of the fewest, then fewest microbatches."""
    least, _ = _best(candidates, rtol)
    close = [c for c in candidates if c.fits and known(c.flops) <= (1 + rtol) * least]
    return min(close, key=lambda c: (c.setting.num_microbatches, c.flops)) if close else None


def search_candidates(
    candidates: list[Candidate],
    compile_at: Callable[[int, Candidate], Candidate],
    rtol: float,
    exhaustive: bool,
    budget: int | None = None,
) -> tuple[Candidate, ...]:
    """Compiles the candidates the choice depends on (see the module doc); returns all, families in FLOPs order."""
    found = list(candidates)

    def hopeless() -> bool:
        # Every candidate takes the same arguments (the state and the batch): once they alone
        # exceed the budget, nothing fits, and compiling more only says so again.
        return budget is not None and any(c.compiled and known(c.argument_bytes) > budget for c in found)

    families: dict[tuple[Any, ...], list[int]] = {}
    for i, candidate in enumerate(found):
        families.setdefault(candidate.setting[1:], []).append(i)

    def family_flops(members: list[int]) -> float:
        return min((f for f in (found[i].flops for i in members) if f is not None), default=float("inf"))

    # Stable sorts: equal FLOPs keep the order given, equal families sort by microbatch count.
    family_order = sorted(families.values(), key=family_flops)
    for members in family_order:
        members.sort(key=lambda i: found[i].setting.num_microbatches)

    def fits(i: int) -> bool:
        if not found[i].compiled:
            if not exhaustive and hopeless():
                return False
            found[i] = compile_at(i, found[i])
        return bool(found[i].fits)

    for members in family_order:
        if exhaustive:
            for i in members:
                fits(i)
            continue
        least, best_m = _best(found, rtol)
        if family_flops(members) > (1 + rtol) * least:
            break  # families come in FLOPs order: none after this one can be chosen
        first_fit([i for i in members if found[i].setting.num_microbatches < best_m], fits)
    return tuple(found[i] for members in family_order for i in members)


def _best(candidates: Sequence[Candidate], rtol: float) -> tuple[float, float]:
    """``(fewest FLOPs among fitting, fewest microbatches among those close to it)``; inf if none fits."""
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        return float("inf"), float("inf")
    least = min(known(c.flops) for c in fitting)
    return least, min(c.setting.num_microbatches for c in fitting if known(c.flops) <= (1 + rtol) * least)
