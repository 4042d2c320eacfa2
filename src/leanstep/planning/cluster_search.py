r"""The cluster plan's search as a state and small pure functions (the rules: :mod:`leanstep.planning.cluster`).

.. code-block:: text

    state = start(candidates, families, flops_by_policy)     # groups: one mesh and reduction each
    while state.pending:
        group, state = next_group(state)                      # the group estimated fastest
        for family in group:                                  # least recompute first
            pruned = prune(state, family, limits)             # members that could still win, or why none
            if pruned.note: state = skip(state, family, pruned.note)
            else: state = record(state, family, pruned.members, *compile_family(...))
    rows = [final_row(c, chosen, rtol) for c in state.candidates]

Only :func:`compile_family` compiles (through the function it is given); the others read and
return values, so each can be checked on hand-made candidates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from leanstep.common.memory_sizes import format_bytes
from leanstep.planning.candidates import first_fit
from leanstep.planning.cluster_grid import Family, dominates, format_seconds, mesh_text
from leanstep.planning.records import Candidate, known

__all__ = [
    "Compiled",
    "Limits",
    "Pruned",
    "SearchState",
    "compile_family",
    "final_row",
    "next_group",
    "prune",
    "rank",
    "record",
    "run_search",
    "skip",
    "start",
    "strip",
    "tensor_part",
]


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the search holds fixed: the per-device budget, the margin ``rtol``, and ``exhaustive``."""

    budget: int
    rtol: float = 0.02
    exhaustive: bool = False


@dataclasses.dataclass(frozen=True)
class SearchState:
    """Where the search stands (every field is replaced, never changed in place).

    Attributes:
      candidates: every candidate, compiled or not; families index into it.
      pending: the groups (families of one mesh and reduction, least recompute first) not searched yet.
      best: the index of the fitting candidate predicted fastest so far, or None.
      failed: families that did not fit even at their most microbatches.
      tensor_seen: by tensor-axis size, the least tensor-axis seconds a compiled candidate had
        (activations: the same for every mesh of that tensor size, so part of their bound).
      fewest: the fewest microbatches a policy of the current group fits with (None: none yet).
      fitted_policy: that policy.
    """

    candidates: tuple[Candidate, ...]
    pending: tuple[tuple[Family, ...], ...]
    best: int | None = None
    failed: tuple[Family, ...] = ()
    tensor_seen: Mapping[int, float] = dataclasses.field(default_factory=dict)
    fewest: int | None = None
    fitted_policy: str = ""

    @property
    def best_seconds(self) -> float | None:
        """The best candidate's predicted seconds, or None."""
        return None if self.best is None else known(self.candidates[self.best].predicted_seconds)


class Pruned(NamedTuple):
    """What :func:`prune` leaves of a family: the members worth compiling, or why it is skipped."""

    members: tuple[int, ...]
    note: str


class Compiled(NamedTuple):
    """One compiled candidate and its communication over the tensor axis alone (seconds)."""

    candidate: Candidate
    tensor_seconds: float


def start(candidates: Iterable[Candidate], families: Iterable[Family], flops: Mapping[str, float]) -> SearchState:
    """The state before any compile: families grouped by mesh and reduction, each group in
    order of its policies' FLOPs (``flops``: by policy), the least recompute first."""
    groups: dict[tuple[str, str], list[Family]] = {}
    for family in families:
        groups.setdefault((mesh_text(family.shape), family.reduce), []).append(family)
    pending = tuple(tuple(sorted(group, key=lambda f: flops[f.remat])) for group in groups.values())
    return SearchState(tuple(candidates), pending)


def tensor_part(state: SearchState, family: Family) -> float:
    """The tensor-axis seconds seen so far on a mesh of ``family``'s tensor size (0 without a tensor axis)."""
    t = family.shape.get("tensor", 1)
    return state.tensor_seen.get(t, 0.0) if t > 1 else 0.0


def next_group(state: SearchState) -> tuple[tuple[Family, ...], SearchState]:
    """The pending group whose first family is estimated fastest with what is known now, and
    the state without it (its ``fewest`` reset for the new group)."""
    group = min(state.pending, key=lambda g: g[0].estimate + tensor_part(state, g[0]))
    pending = tuple(g for g in state.pending if g is not group)
    return group, dataclasses.replace(state, pending=pending, fewest=None, fitted_policy="")


def prune(state: SearchState, family: Family, limits: Limits) -> Pruned:
    """The members of ``family`` that could still win, and a note if the whole family is ruled out.

    A member stays if it has fewer microbatches than a cheaper policy of the group fitted with
    and its bound (plus the tensor part) is more than ``rtol`` below the best predicted time.
    The family is skipped when its state and batch alone exceed the budget, or (unless
    ``exhaustive``) no member stays, or a family with the same rows and a larger fsdp axis did not fit.
    """
    tensor, best = tensor_part(state, family), state.best_seconds
    members = tuple(
        i
        for i in family.members
        if (state.fewest is None or state.candidates[i].setting.num_microbatches < state.fewest)
        and (best is None or (known(state.candidates[i].bound_seconds) + tensor) * (1 + limits.rtol) < best)
    )
    note = ""
    if family.argument_bytes > limits.budget:
        note = f"state and batch alone take {format_bytes(family.argument_bytes)} a device"
    elif not limits.exhaustive and not members and state.fewest is not None:
        note = f"more recompute than remat {state.fitted_policy} at no fewer microbatches"
    elif not limits.exhaustive and any(dominates(g, family) for g in state.failed):
        note = "does not fit: the same rows with a larger fsdp axis did not"
    elif not limits.exhaustive and not members:
        note = f"bound {format_seconds(family.bound + tensor)} is not below the best found"
    return Pruned(members, note)


def skip(state: SearchState, family: Family, note: str) -> SearchState:
    """``family``'s members, not compiled, carry ``note``."""
    candidates = list(state.candidates)
    for i in family.members:
        candidates[i] = dataclasses.replace(candidates[i], note=note)
    return dataclasses.replace(state, candidates=tuple(candidates))


def compile_family(
    state: SearchState,
    family: Family,
    members: tuple[int, ...],
    compile_one: Callable[[Candidate], Compiled],
    exhaustive: bool,
) -> tuple[dict[int, Compiled], int | None]:
    """Compiles what the search needs of a family: every member if ``exhaustive``, else
    :func:`leanstep.planning.candidates.first_fit` over ``members``.

    Returns:
      ``(compiled, found)``: the compiles by candidate index, in compile order, and the first
      member that fits (None: none did).
    """
    compiled: dict[int, Compiled] = {}

    def fits(i: int) -> bool:
        if i not in compiled:
            compiled[i] = compile_one(state.candidates[i])
        return bool(compiled[i].candidate.fits)

    if exhaustive:
        fitting = [i for i in family.members if fits(i)]
        return compiled, fitting[0] if fitting else None
    return compiled, first_fit(list(members), fits)


def record(
    state: SearchState, family: Family, members: tuple[int, ...], compiled: Mapping[int, Compiled], found: int | None
) -> SearchState:
    """The state after ``family``'s compiles: their rows, the least tensor-axis cost of its tensor
    size, and either the failure (nothing fit though no member was pruned) or the group's
    fewest microbatches and the best fitting candidate."""
    candidates = list(state.candidates)
    for i, result in compiled.items():
        candidates[i] = result.candidate
    tensor_seen, t = dict(state.tensor_seen), family.shape.get("tensor", 1)
    if t > 1 and compiled:
        tensor_seen[t] = min(tensor_seen.get(t, math.inf), *(r.tensor_seconds for r in compiled.values()))
    state = dataclasses.replace(state, candidates=tuple(candidates), tensor_seen=tensor_seen)
    if found is None:
        failed = len(members) == len(family.members)  # even the most microbatches do not fit
        return dataclasses.replace(state, failed=state.failed + (family,)) if failed else state
    best = state.best
    for i in family.members:
        c = candidates[i]
        if (
            c.compiled
            and c.fits
            and (best is None or known(c.predicted_seconds) < known(candidates[best].predicted_seconds))
        ):
            best = i
    fewest = candidates[found].setting.num_microbatches
    return dataclasses.replace(state, best=best, fewest=fewest, fitted_policy=family.remat)


def run_search(state: SearchState, limits: Limits, compile_one: Callable[[Candidate], Compiled]) -> SearchState:
    """Drives the search until no group is pending (the loop of the module doc)."""
    while state.pending:
        group, state = next_group(state)
        for family in group:
            pruned = prune(state, family, limits)
            if pruned.note:
                state = skip(state, family, pruned.note)
                continue
            compiled, found = compile_family(state, family, pruned.members, compile_one, limits.exhaustive)
            state = record(state, family, pruned.members, compiled, found)
    return state


def final_row(candidate: Candidate, chosen: Candidate, rtol: float) -> Candidate:
    """The plan's row for a candidate that was not chosen: why (a note it has already stays)."""
    c = candidate
    if c.note:
        return c
    if c.compiled and not c.fits:
        note = f"peak {format_bytes(c.peak_bytes)} over the budget"
    elif c.compiled:
        seconds = known(c.predicted_seconds)
        note = f"predicted {format_seconds(seconds)}, {seconds / known(chosen.predicted_seconds) - 1:+.1%}"
    elif c.bound_seconds is not None and c.bound_seconds * (1 + rtol) >= known(chosen.predicted_seconds):
        note = f"bound {format_seconds(c.bound_seconds)} is not below the best found"
    else:
        note = "fewer microbatches fit"
    return dataclasses.replace(c, note=note)


def rank(candidates: Iterable[Candidate]) -> tuple[Candidate, ...]:
    """Compiled candidates by predicted time, then the others, each in their given order."""
    return tuple(sorted(candidates, key=lambda c: (c.predicted_seconds is None, c.predicted_seconds or 0.0)))


def strip(candidate: Candidate, keep: bool) -> Candidate:
    """``candidate`` without its executable unless ``keep``."""
    return candidate if keep or candidate.executable is None else dataclasses.replace(candidate, executable=None)
