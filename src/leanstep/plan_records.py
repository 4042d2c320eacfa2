"""What planning finds: the candidate settings, what each one costs, the plan, and the error when nothing fits.

Plain records, filled in by :func:`leanstep.plan` (:mod:`leanstep.planning`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from leanstep.memory_sizes import format_bytes

__all__ = ["BudgetError", "Candidate", "Plan", "Setting"]


class Setting(NamedTuple):
    """One candidate: how many microbatches, which remat policy, which precision."""

    num_microbatches: int
    remat: str
    precision: str


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A setting and what planning found out about it (None: not traced, or not compiled).

    Attributes:
      setting: the :class:`Setting`.
      flops: FLOPs of the traced step, loop bodies times their trip counts.
      argument_bytes, output_bytes, alias_bytes, temp_bytes: ``memory_analysis()``.
      peak_bytes: ``argument + output - alias + temp`` (see the module doc).
      xla_flops: ``cost_analysis()["flops"]`` (loop bodies counted once).
      xla_peak_bytes: ``memory_analysis().peak_memory_in_bytes`` where the backend reports it
        (on CPU it is about the argument size, whatever the temporaries: not a peak).
      fits: ``peak_bytes <= budget``.
      trace_seconds, compile_seconds: time spent on this candidate.
      executable: the compiled step (``jax.stages.Compiled``), callable as ``step(state, batch)``.
    """

    setting: Setting
    flops: float | None = None
    trace_seconds: float | None = None
    argument_bytes: int | None = None
    output_bytes: int | None = None
    alias_bytes: int | None = None
    temp_bytes: int | None = None
    peak_bytes: int | None = None
    xla_flops: float | None = None
    xla_peak_bytes: int | None = None
    fits: bool | None = None
    compile_seconds: float | None = None
    executable: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def compiled(self) -> bool:
        """Whether planning compiled this candidate (else it could not be chosen)."""
        return self.peak_bytes is not None

    def to_json(self) -> dict[str, Any]:
        fields = (f.name for f in dataclasses.fields(self) if f.name not in ("setting", "executable"))
        return {**self.setting._asdict(), **{name: getattr(self, name) for name in fields}}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every candidate (families in FLOPs order, each by microbatch count) and the chosen one.

    Attributes:
      budget_bytes: the memory budget.
      candidates: all candidates; uncompiled ones have no memory numbers.
      chosen: the candidate to run.
      seconds: wall time of planning.
    """

    budget_bytes: int
    candidates: tuple[Candidate, ...]
    chosen: Candidate
    seconds: float

    @property
    def compiles(self) -> int:
        """How many candidates planning compiled (the others were ruled out without compiling)."""
        return sum(c.compiled for c in self.candidates)

    def to_json(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "seconds": self.seconds, "compiles": self.compiles,
                "chosen": self.chosen.to_json(), "candidates": [c.to_json() for c in self.candidates]}

    def __str__(self) -> str:
        header = ("", "microbatches", "remat", "precision", "peak", "temporaries", "GFLOP", "fits")
        rows = [header] + [(
            "*" if c is self.chosen else "", str(c.setting.num_microbatches), c.setting.remat, c.setting.precision,
            format_bytes(c.peak_bytes), format_bytes(c.temp_bytes), "-" if c.flops is None else f"{c.flops / 1e9:.3f}",
            "skipped" if c.fits is None else ("yes" if c.fits else "no"),
        ) for c in self.candidates]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(f"{v:<{w}}" for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.append(f"budget {format_bytes(self.budget_bytes)}; chosen (*): {self.chosen.setting.num_microbatches} "
                     f"microbatches, remat {self.chosen.setting.remat}; planned in {self.seconds:.1f} s, "
                     f"{self.compiles} compile{'s' * (self.compiles != 1)}")
        return "\n".join(lines)


class BudgetError(ValueError):
    """No candidate fits the budget; ``smallest`` is the candidate with the smallest peak."""

    def __init__(self, budget_bytes: int, smallest: Candidate, candidates: tuple[Candidate, ...]) -> None:
        s = smallest.setting
        super().__init__(
            f"no setting fits the budget of {format_bytes(budget_bytes)} ({budget_bytes:,} bytes): the smallest "
            f"peak found is {format_bytes(smallest.peak_bytes)} ({smallest.peak_bytes:,} bytes), with "
            f"num_microbatches={s.num_microbatches}, remat={s.remat!r}, precision={s.precision!r}; "
            f"raise the budget or lower the batch size"
        )
        self.budget_bytes, self.smallest, self.candidates = budget_bytes, smallest, candidates
