"""What planning finds: the candidate settings, what each one costs, the plan, and the error when nothing fits.

Plain records, filled in by :func:`leanstep.planning.plan` (:mod:`leanstep.planning.one_device`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeVar

from leanstep.common.memory_sizes import format_bytes

__all__ = ["BudgetError", "Candidate", "Plan", "Setting", "family_rows", "known"]

_T = TypeVar("_T")


class Setting(NamedTuple):
    """One candidate: how many microbatches, which remat policy, which precision; on a cluster
    also the mesh (``"data=8,fsdp=8"``; ``""``: one device) and where gradients reduce; and
    whether each layer is updated inside the backward pass (``StepSpec.update_in_backward``)."""

    num_microbatches: int
    remat: str
    precision: str
    mesh: str = ""
    reduce: str = "auto"
    update_in_backward: bool = False

    def describe(self) -> str:
        """The setting as the flags of ``leanstep train``."""
        mesh = f" --mesh {self.mesh} --reduce {self.reduce}" if self.mesh else ""
        layers = " --update-in-backward on" if self.update_in_backward else ""
        return f"--microbatches {self.num_microbatches} --remat {self.remat}{mesh}{layers}"


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
      bytes_per_step, collectives: bytes and executions of its collectives per step, per
        device (cluster plans; :mod:`leanstep.planning.cost_model`).
      compute_seconds, communication_seconds, predicted_seconds: the cost model's step time.
      bound_seconds: a lower bound of ``predicted_seconds`` known before compiling (cluster plans).
      note: why it was not compiled, or why it lost.
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
    bytes_per_step: int | None = None
    collectives: int | None = None
    compute_seconds: float | None = None
    communication_seconds: float | None = None
    predicted_seconds: float | None = None
    bound_seconds: float | None = None
    note: str = ""
    executable: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def compiled(self) -> bool:
        """Whether planning compiled this candidate (else it could not be chosen)."""
        return self.peak_bytes is not None

    def to_json(self) -> dict[str, Any]:
        fields = (f.name for f in dataclasses.fields(self) if f.name not in ("setting", "executable"))
        return {**self.setting._asdict(), **{name: getattr(self, name) for name in fields}}


def known(value: _T | None) -> _T:
    """A figure of a :class:`Candidate` that planning has computed by the time it reads it.

    Traced candidates have their ``flops``, compiled ones (``compiled``) their memory and fit,
    cluster candidates their ``bound_seconds`` before and ``predicted_seconds`` after compiling.

    Raises:
      RuntimeError: it is None (planning read it too early).
    """
    if value is None:
        raise RuntimeError("planning read a figure of a candidate before computing it")
    return value


def family_rows(candidates: Sequence[Candidate], chosen: Candidate | None) -> list[Candidate]:
    """One candidate per family (a setting but its microbatch count), the chosen one's first, then
    by predicted time: the chosen candidate, else the fastest fitting member, else the last compiled,
    else the last.

    Example:
      >>> rows = [Candidate(Setting(m, "none", "float32"), predicted_seconds=s, fits=True) for m, s in ((1, 2.0), (2, 1.0))]
      >>> [c.setting.num_microbatches for c in family_rows(rows, None)]
      [2]
    """
    families: dict[tuple[Any, ...], list[Candidate]] = {}
    for c in candidates:
        families.setdefault(tuple(c.setting[1:]), []).append(c)

    def representative(members: list[Candidate]) -> Candidate:
        if chosen is not None and chosen in members:
            return chosen
        fitting = [c for c in members if c.fits]
        compiled = [c for c in members if c.compiled]
        return min(fitting, key=lambda c: known(c.predicted_seconds)) if fitting else (compiled or members)[-1]

    return sorted(
        (representative(m) for m in families.values()),
        key=lambda c: (c is not chosen, c.predicted_seconds is None, c.predicted_seconds or 0.0),
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every candidate (families in FLOPs order, each by microbatch count) and the chosen one.

    Attributes:
      budget_bytes: the memory budget.
      candidates: all candidates; uncompiled ones have no memory numbers.
      chosen: the candidate to run.
      seconds: wall time of planning.
      num_devices, accelerator: a cluster plan's devices and the accelerator it is priced on.
      notes: what the caller should know about the choice, e.g. that microbatching changes a
        model state's batch statistics (:func:`leanstep.planning.plan` with ``model_state=``).
    """

    budget_bytes: int
    candidates: tuple[Candidate, ...]
    chosen: Candidate
    seconds: float
    num_devices: int = 1
    accelerator: Any = None
    notes: tuple[str, ...] = ()

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling."""
        return sum(c.compile_seconds or 0.0 for c in self.candidates)

    @property
    def compiles(self) -> int:
        """How many candidates planning compiled (the others were ruled out without compiling)."""
        return sum(c.compiled for c in self.candidates)

    def to_json(self) -> dict[str, Any]:
        accelerator = None if self.accelerator is None else dataclasses.asdict(self.accelerator)
        return {
            "budget_bytes": self.budget_bytes,
            "seconds": self.seconds,
            "compiles": self.compiles,
            "compile_seconds": self.compile_seconds,
            "num_devices": self.num_devices,
            "accelerator": accelerator,
            "notes": list(self.notes),
            "chosen": self.chosen.to_json(),
            "candidates": [c.to_json() for c in self.candidates],
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Plan:
        """The plan :meth:`to_json` wrote (without executables)."""
        from leanstep.planning.cost_model import Accelerator

        def candidate(c: dict[str, Any]) -> Candidate:
            fields = {f.name for f in dataclasses.fields(Candidate)} - {"setting", "executable"}
            return Candidate(Setting(*(c[k] for k in Setting._fields if k in c)), **{k: c[k] for k in fields if k in c})

        candidates = tuple(candidate(c) for c in value["candidates"])
        chosen = candidate(value["chosen"])
        chosen = next((c for c in candidates if c.setting == chosen.setting), chosen)
        accelerator = value.get("accelerator")
        return cls(
            value["budget_bytes"],
            candidates,
            chosen,
            value["seconds"],
            value.get("num_devices", 1),
            None if accelerator is None else Accelerator(**accelerator),
            tuple(value.get("notes", ())),
        )

    def __str__(self) -> str:
        cluster = self.num_devices > 1
        header: tuple[str, ...] = ("", "microbatches", "remat", "precision", "peak", "temporaries", "GFLOP", "fits")
        if cluster:
            header = (
                "",
                "mesh",
                "reduce",
                "microbatches",
                "remat",
                "peak",
                "GFLOP/device",
                "GB/step",
                "predicted",
                "fits",
                "why not chosen",
            )

        def row(c: Candidate) -> tuple[str, ...]:
            s, gflop = c.setting, "-" if c.flops is None else f"{c.flops / 1e9:.3f}"
            fits = "skipped" if c.fits is None else ("yes" if c.fits else "no")
            if not cluster:
                return (
                    "*" if c is self.chosen else "",
                    str(s.num_microbatches),
                    s.remat,
                    s.precision,
                    format_bytes(c.peak_bytes),
                    format_bytes(c.temp_bytes),
                    gflop,
                    fits,
                )
            sent = "-" if c.bytes_per_step is None else f"{c.bytes_per_step / 1e9:.3f}"
            time = "-" if c.predicted_seconds is None else f"{c.predicted_seconds * 1e3:.1f} ms"
            return (
                "*" if c is self.chosen else "",
                s.mesh,
                s.reduce,
                str(s.num_microbatches),
                s.remat,
                format_bytes(c.peak_bytes),
                gflop,
                sent,
                time,
                fits,
                c.note,
            )

        rows = [header] + [row(c) for c in self.candidates]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(f"{v:<{w}}" for v, w in zip(r, widths)).rstrip() for r in rows]
        where = f"{self.num_devices} devices, " if cluster else ""
        lines.append(
            f"budget {format_bytes(self.budget_bytes)}{' per device' * cluster}; {where}chosen (*): "
            f"{self.chosen.setting.describe()}; planned in {self.seconds:.1f} s, "
            f"{self.compiles} compile{'s' * (self.compiles != 1)}"
        )
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


class BudgetError(ValueError):
    """No candidate fits the budget; ``smallest`` is the candidate with the smallest peak."""

    def __init__(
        self,
        budget_bytes: int,
        smallest: Candidate,
        candidates: tuple[Candidate, ...],
        max_microbatches: int | None = None,
        min_microbatch_rows: int | None = None,
    ) -> None:
        s = smallest.setting
        where = f", mesh={s.mesh!r}, reduce={s.reduce!r}" if s.mesh else ""
        where += ", update_in_backward=True" if s.update_in_backward else ""
        per = " per device" if s.mesh else ""
        bound = "" if max_microbatches is None else f" with at most SearchSpace.max_microbatches={max_microbatches}"
        rows = (
            ""
            if min_microbatch_rows is None
            else f", lower SearchSpace.min_microbatch_rows={min_microbatch_rows} (microbatches of fewer rows were "
            "not planned; 16 by default for a model with batch statistics)"
        )
        super().__init__(
            f"no setting{bound} fits the budget of {format_bytes(budget_bytes)} ({budget_bytes:,} bytes){per}: the smallest "
            f"peak found is {format_bytes(smallest.peak_bytes)} ({smallest.peak_bytes:,} bytes), with "
            f"num_microbatches={s.num_microbatches}, remat={s.remat!r}, precision={s.precision!r}{where}; "
            f"raise the budget{', add devices' if s.mesh else ''}{', raise the bound' if bound else ''}{rows} "
            "or lower the batch size"
        )
        self.budget_bytes, self.smallest, self.candidates = budget_bytes, smallest, candidates
        self.max_microbatches, self.min_microbatch_rows = max_microbatches, min_microbatch_rows
