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

The chosen setting fits the budget and is predicted fastest::

    fitting  = [c for c in candidates if c.peak_bytes <= budget]
    close    = [c for c in fitting if c.flops <= (1 + flops_rtol) * min(f.flops for f in fitting)]
    chosen   = min(close, key=(num_microbatches, flops))

FLOPs within ``flops_rtol`` count as equal because accumulation adds a few FLOPs per
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
than ``flops_rtol`` are never compiled. ``exhaustive=True`` compiles every candidate.
"""

from __future__ import annotations

import dataclasses
import decimal
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from leanstep.audit import count_flops
from leanstep.loss_scale import LossScale, get_loss_scale
from leanstep.precision import Precision, get_precision
from leanstep.remat import REMAT_POLICIES, get_remat_policy
from leanstep.step import TrainState, make_train_step

__all__ = ["BudgetError", "Candidate", "Plan", "Setting", "format_bytes", "parse_bytes", "plan",
           "plan_for_run", "settings_grid", "time_candidates", "validate_plan"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# LLVM's optimization level only: buffer assignment (every memory number) comes before it.
_FAST_CPU_OPTIONS = {"xla_backend_optimization_level": 0}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """Parses a memory size: ``"512MiB"``, ``"2GiB"``, ``"1.5GB"``, ``"1000000"`` (bytes).

    KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000; case is ignored.

    Raises:
      ValueError: not a size, an unknown unit, not a whole number of bytes, or not positive.

    Example:
      >>> parse_bytes("512MiB"), parse_bytes("1.5GB"), parse_bytes("1000000")
      (536870912, 1500000000, 1000000)
    """
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        value = decimal.Decimal(int(text))
    elif isinstance(text, str) and (m := _SIZE.fullmatch(text)) and m[2].lower() in _UNITS:
        value = decimal.Decimal(m[1]) * _UNITS[m[2].lower()]
    else:
        raise ValueError(f"memory size {text!r} is not a size; expected e.g. 512MiB, 2GiB, 1.5GB or a "
                         f"number of bytes (units: {', '.join(u for u in _UNITS if u)}; KiB = 1024 B)")
    if value != value.to_integral_value():
        raise ValueError(f"memory size {text!r} is {value} bytes, not a whole number of bytes")
    if value <= 0:
        raise ValueError(f"memory size {text!r} must be positive")
    return int(value)


def format_bytes(n: float | None) -> str:
    """``1536 -> '1.5 KiB'``; None -> ``'-'``."""
    if n is None:
        return "-"
    value, unit = float(n), "B"
    for larger in ("KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


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

    def to_json(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "seconds": self.seconds,
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
                     f"microbatches, remat {self.chosen.setting.remat}; planned in {self.seconds:.1f} s")
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


def settings_grid(
    batch_size: int,
    *,
    remat_policies: Iterable[str] = REMAT_POLICIES,
    precisions: Iterable[str] = ("float32",),
    microbatches: Iterable[int] | None = None,
) -> tuple[Setting, ...]:
    """Every combination of microbatch count (default: the divisors of ``batch_size``), policy and precision.

    Example:
      >>> [tuple(s) for s in settings_grid(4, remat_policies=("none", "dots"))][:3]
      [(1, 'none', 'float32'), (1, 'dots', 'float32'), (2, 'none', 'float32')]
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    counts = [m for m in range(1, batch_size + 1) if batch_size % m == 0] if microbatches is None else list(microbatches)
    return tuple(Setting(int(m), r, p) for m in counts for r in remat_policies for p in precisions)


def _check_setting(setting: Any, batch_size: int) -> Setting:
    try:
        setting = Setting(*setting)
    except TypeError:
        raise TypeError(f"candidates must hold (num_microbatches, remat, precision) triples, got {setting!r}") from None
    m = setting.num_microbatches
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1 or batch_size % m:
        raise ValueError(f"candidate {tuple(setting)}: num_microbatches={m!r} must be a positive divisor of "
                         f"the batch size {batch_size}")
    get_remat_policy(setting.remat)
    get_precision(setting.precision)
    return Setting(int(m), setting.remat, setting.precision)


def _abstract(tree: Any) -> Any:
    def leaf(x: Any) -> jax.ShapeDtypeStruct:
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(dtype))

    return jax.tree.map(leaf, tree)


def _compile(candidate: Candidate, traced: Any, budget: int, options: dict[str, Any] | None) -> Candidate:
    start = time.perf_counter()
    executable = traced.lower().compile(options) if options else traced.lower().compile()
    memory, cost = executable.memory_analysis(), executable.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    arguments, outputs = memory.argument_size_in_bytes, memory.output_size_in_bytes
    alias, temp = memory.alias_size_in_bytes, memory.temp_size_in_bytes
    peak = arguments + outputs - alias + temp
    return dataclasses.replace(
        candidate, argument_bytes=arguments, output_bytes=outputs, alias_bytes=alias, temp_bytes=temp,
        peak_bytes=peak, xla_flops=(cost or {}).get("flops"), xla_peak_bytes=getattr(memory, "peak_memory_in_bytes", None),
        fits=peak <= budget, compile_seconds=time.perf_counter() - start, executable=executable)


def plan(
    make_loss_fn: Callable[[str], Callable[..., Any]],
    params: Any,
    batch: Any,
    optimizer: optax.GradientTransformation,
    *,
    budget_bytes: int | str,
    candidates: Sequence[tuple[int, str, str]] | None = None,
    precision: str | Precision = "float32",
    max_grad_norm: float | None = None,
    loss_scale: str | LossScale = "none",
    flops_rtol: float = 0.02,
    exhaustive: bool = False,
    compiler_options: dict[str, Any] | str | None = "auto",
    **step_kwargs: Any,
) -> Plan:
    """Compiles (never runs) the train step for each candidate and picks the fastest that fits.

    See the module doc for the peak formula and the choice. Steps are built with
    :func:`leanstep.make_train_step` (jitted, state donated) exactly as a run builds them.

    Args:
      make_loss_fn: ``make_loss_fn(remat_policy) -> loss_fn(params, batch)``.
      params: the parameters, as arrays or ``jax.ShapeDtypeStruct`` (only shapes are used).
      batch: one full batch, arrays or ``ShapeDtypeStruct``; leaves share the leading batch axis.
      optimizer: the ``optax.GradientTransformation`` of the run.
      budget_bytes: bytes, or a size string such as ``"512MiB"`` (see :func:`parse_bytes`).
      candidates: ``(num_microbatches, remat, precision)`` settings; default
        :func:`settings_grid` over the batch size's divisors, :data:`REMAT_POLICIES`
        and ``precision``.
      precision: the precision of the default candidates.
      max_grad_norm, loss_scale: as in the run (they change the state and the step a little).
      flops_rtol: FLOPs within this relative distance of the fewest count as equal.
      exhaustive: compile every candidate, not only those that could be chosen.
      compiler_options: passed to ``compile()``; ``"auto"``: on CPU, LLVM optimization level 0
        (``xla_backend_optimization_level=0``), which compiles about 3x faster and leaves
        XLA's buffer assignment, hence every memory number, unchanged (it only changes
        code generation, after buffer assignment); elsewhere XLA's defaults. Executables
        planned with it run slower: recompile the chosen setting to train.
      **step_kwargs: further :func:`make_train_step` arguments (``has_aux``, ``token_weighted``, ...).

    Returns:
      A :class:`Plan`.

    Raises:
      BudgetError: no candidate fits (the message names the smallest peak and its setting).
      ValueError, TypeError: a bad budget, candidate or option.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> def make_loss_fn(policy):
      ...     def loss_fn(p, b):
      ...         return jnp.mean(jnp.tanh(b["x"] @ p["w"]) ** 2)
      ...     return loss_fn
      >>> params, batch = {"w": jnp.ones((8, 8))}, {"x": jnp.ones((4, 8))}
      >>> p = plan(make_loss_fn, params, batch, optax.sgd(0.1), budget_bytes="1MiB",
      ...          candidates=[(1, "none", "float32"), (2, "none", "float32")])
      >>> p.chosen.setting, p.chosen.fits
      (Setting(num_microbatches=1, remat='none', precision='float32'), True)
    """
    start = time.perf_counter()
    budget = parse_bytes(budget_bytes)
    if not callable(make_loss_fn):
        raise TypeError(f"make_loss_fn must be callable, got {type(make_loss_fn).__name__}")
    if not (isinstance(flops_rtol, (int, float)) and 0 <= flops_rtol < 1):
        raise ValueError(f"flops_rtol must be a number in [0, 1), got {flops_rtol!r}")
    batch_sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree.leaves(batch)}
    if len(batch_sizes) != 1 or None in batch_sizes:
        raise ValueError(f"batch leaves must share one leading batch axis, got leading sizes {sorted(map(str, batch_sizes))}")
    (batch_size,) = batch_sizes
    precision_name = precision if isinstance(precision, str) else str(precision)
    settings = settings_grid(batch_size, precisions=(precision_name,)) if candidates is None else candidates
    settings = [_check_setting(s, batch_size) for s in settings]
    if not settings:
        raise ValueError("candidates is empty; give at least one (num_microbatches, remat, precision)")
    if compiler_options == "auto":
        compiler_options = _FAST_CPU_OPTIONS if jax.default_backend() == "cpu" else None
    elif compiler_options is not None and not isinstance(compiler_options, dict):
        raise TypeError(f"compiler_options must be a dict, 'auto' or None, got {compiler_options!r}")
    scale = get_loss_scale(loss_scale)
    state = jax.eval_shape(lambda p: TrainState.create(p, optimizer, loss_scale=scale), _abstract(params))
    batch = _abstract(batch)

    loss_fns: dict[str, Callable[..., Any]] = {}
    traced: dict[Setting, Any] = {}

    def trace(candidate: Candidate) -> Candidate:
        s, t0 = candidate.setting, time.perf_counter()
        if s.remat not in loss_fns:
            loss_fns[s.remat] = make_loss_fn(s.remat)
        step = make_train_step(loss_fns[s.remat], optimizer, precision=s.precision,
                               num_microbatches=s.num_microbatches, max_grad_norm=max_grad_norm, **step_kwargs)
        traced[s] = step.trace(state, batch)
        return dataclasses.replace(candidate, flops=count_flops(traced[s].jaxpr),
                                   trace_seconds=time.perf_counter() - t0)

    def compile_at(i: int, candidate: Candidate) -> Candidate:
        candidate = candidate if candidate.setting in traced else trace(candidate)
        return _compile(candidate, traced[candidate.setting], budget, compiler_options)

    initial = [Candidate(s) for s in dict.fromkeys(settings)]  # duplicates dropped
    # A family's FLOPs are its fewest-microbatch member's (more microbatches add <0.1%):
    # the others are traced only when compiled.
    first: dict[tuple[str, str], int] = {}
    for i, c in enumerate(initial):
        j = first.setdefault(c.setting[1:], i)
        first[c.setting[1:]] = i if c.setting.num_microbatches < initial[j].setting.num_microbatches else j
    for i in first.values():
        initial[i] = trace(initial[i])
    final = _search(initial, compile_at, flops_rtol, exhaustive)
    chosen = _choose(final, flops_rtol)
    if chosen is None:
        raise BudgetError(budget, min((c for c in final if c.compiled), key=lambda c: c.peak_bytes), final)
    return Plan(budget, final, chosen, time.perf_counter() - start)


def _choose(candidates: Sequence[Candidate], rtol: float) -> Candidate | None:
    """The rule of the module doc: fitting, FLOPs within ``rtol`` of the fewest, then fewest microbatches."""
    least, _ = _best(candidates, rtol)
    close = [c for c in candidates if c.fits and c.flops <= (1 + rtol) * least]
    return min(close, key=lambda c: (c.setting.num_microbatches, c.flops)) if close else None


def _search(candidates: list[Candidate], compile_at: Callable[[int, Candidate], Candidate], rtol: float,
            exhaustive: bool) -> tuple[Candidate, ...]:
    """Compiles the candidates the choice depends on (see the module doc); returns all, families in FLOPs order."""
    found = list(candidates)
    families: dict[tuple[str, str], list[int]] = {}
    for i, candidate in enumerate(found):
        families.setdefault(candidate.setting[1:], []).append(i)
    def family_flops(members: list[int]) -> float:
        return min((found[i].flops for i in members if found[i].flops is not None), default=float("inf"))

    # Stable sorts: equal FLOPs keep the order given, equal families sort by microbatch count.
    family_order = sorted(families.values(), key=family_flops)
    for members in family_order:
        members.sort(key=lambda i: found[i].setting.num_microbatches)

    def fits(i: int) -> bool:
        if not found[i].compiled:
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
        _first_fit([i for i in members if found[i].setting.num_microbatches < best_m], fits)
    return tuple(found[i] for members in family_order for i in members)


def _best(candidates: Sequence[Candidate], rtol: float) -> tuple[float, float]:
    """``(fewest FLOPs among fitting, fewest microbatches among those close to it)``; inf if none fits."""
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        return float("inf"), float("inf")
    least = min(c.flops for c in fitting)
    return least, min(c.setting.num_microbatches for c in fitting if c.flops <= (1 + rtol) * least)


def _first_fit(members: list[int], fits: Callable[[int], bool]) -> int | None:
    """The first of ``members`` (by microbatch count) that fits, assuming the peak falls with the count.

    Tries the fewest microbatches (the usual winner), then the most (if that does not fit,
    nothing does), then bisects between them: at most ``2 + log2(len)`` compiles.
    """
    if not members or fits(members[0]):
        return members[0] if members else None
    lo, hi = 0, len(members) - 1
    if not fits(members[hi]):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(members[mid]) else (mid, hi)
    return members[hi]


def _run_parts(config: Any) -> tuple[Any, optax.GradientTransformation, Callable[[str], Callable[..., Any]], LossScale]:
    """The model, optimizer, loss factory and loss scale a :class:`RunConfig` trains with."""
    from leanstep.models import build_model
    from leanstep.trainer import _model_overrides, build_optimizer

    model = build_model(config.model, config.size, **_model_overrides(config))
    optimizer, _ = build_optimizer(config)
    scale = get_loss_scale(config.loss_scale, None if config.loss_scale == "none" else config.initial_loss_scale)

    def make_loss_fn(policy: str) -> Callable[..., Any]:
        return lambda params, batch: model.loss(params, batch, remat_policy=policy)

    return model, optimizer, make_loss_fn, scale


def plan_for_run(config: Any, budget_bytes: int | str, **options: Any) -> Plan:
    """Plans microbatches and remat for a :class:`leanstep.trainer.RunConfig` (its other fields fixed).

    Candidates: every divisor of ``config.batch_size`` times :data:`REMAT_POLICIES`, at
    ``config.precision``; ``options`` go to :func:`plan` (e.g. ``candidates``, ``exhaustive``).
    Use ``dataclasses.replace(config, microbatches=s.num_microbatches, remat=s.remat)``
    with ``s = plan_for_run(config, budget).chosen.setting``.

    Raises:
      BudgetError: nothing fits.
      ValueError: an invalid config or budget, or a multi-device config (``devices``, ``fsdp``).
    """
    dataclasses.replace(config, microbatches=1, remat="none").validate()  # both are planned here
    if getattr(config, "devices", None) is not None or getattr(config, "fsdp", False):
        raise ValueError("a memory budget is planned for a one-device run; drop --devices and --fsdp "
                         f"(got devices={config.devices!r}, fsdp={config.fsdp!r})")
    model, optimizer, make_loss_fn, scale = _run_parts(config)
    params = jax.eval_shape(model.init, jax.random.key(config.seed))
    batch = {"tokens": jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), np.int32)}
    options.setdefault("precision", config.precision)
    return plan(make_loss_fn, params, batch, optimizer, budget_bytes=budget_bytes,
                max_grad_norm=config.max_grad_norm, loss_scale=scale, **options)


# --- validation against reality (benchmarks, not tests) ------------------------------------------

def _run_inputs(config: Any) -> tuple[Callable[..., Any], Any, Any]:
    """The jitted step, a materialized state and a device batch for ``config`` (as a run builds them)."""
    model, optimizer, make_loss_fn, scale = _run_parts(config)
    state = TrainState.create(model.init(jax.random.key(config.seed)), optimizer, loss_scale=scale, seed=config.seed)
    tokens = np.random.default_rng(config.seed).integers(0, 256, (config.batch_size, config.seq_len + 1))
    batch = {"tokens": jax.device_put(tokens.astype(np.int32))}
    step = make_train_step(make_loss_fn(config.remat), optimizer, precision=config.precision,
                           num_microbatches=config.microbatches, max_grad_norm=config.max_grad_norm)
    return step, state, batch


def _peak_rss_bytes() -> int:
    """The process's peak RSS: VmHWM on Linux, else ``ru_maxrss``.

    Not ``ru_maxrss`` on Linux: it also holds the peak of the process image that exec'd
    this one, and Python's subprocess execs from a vfork of the parent, so a child
    started from a big parent reports the parent's peak, whatever it does itself.
    """
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # KiB on Linux


def _reset_peak_rss() -> bool:
    """Sets the process's RSS high-water mark (ru_maxrss) to its current RSS (Linux >= 4.0)."""
    import ctypes
    import gc

    gc.collect()
    try:  # hand freed heap pages back, so that reusing them later shows up as growth
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _measure_in_child(spec_path: str) -> None:
    """Runs one step of a planned setting and prints its memory as JSON (see :func:`validate_plan`)."""
    import json

    from leanstep.trainer import RunConfig

    spec = json.loads(open(spec_path).read())
    step, state, batch = _run_inputs(RunConfig(**spec["config"]))
    options = spec["compiler_options"]
    executable = step.lower(state, batch).compile(options) if options else step.lower(state, batch).compile()
    memory = executable.memory_analysis()
    state, metrics = executable(state, batch)  # warm-up: thread pools and other one-time allocations
    jax.block_until_ready((state, metrics))
    reset = _reset_peak_rss()
    before = _peak_rss_bytes()
    state, metrics = executable(state, batch)
    jax.block_until_ready((state, metrics))
    rise = _peak_rss_bytes() - before
    print(json.dumps({
        "compiled_peak_bytes": memory.argument_size_in_bytes + memory.output_size_in_bytes
        - memory.alias_size_in_bytes + memory.temp_size_in_bytes,
        "xla_peak_bytes": getattr(memory, "peak_memory_in_bytes", None),
        "argument_bytes": memory.argument_size_in_bytes, "rss_rise_bytes": rise,
        "measured_peak_bytes": rise + memory.argument_size_in_bytes, "peak_reset": reset,
        "loss": float(metrics.loss),
    }))


def validate_plan(config: Any, budget_bytes: int | str, *, compiler_options: dict[str, Any] | None = None,
                  timeout: float = 600.0, **plan_options: Any) -> dict[str, Any]:
    """Plans ``config`` for the budget, runs the chosen setting once in a subprocess, compares memory.

    .. code-block:: text

        predicted = plan's peak (abstract inputs)
        compiled  = the same formula on the executable a run compiles (real arrays, ``compiler_options``)
        measured  = rise of the child's peak RSS (VmHWM) over one step (high-water mark reset
                    just before it, after a warm-up step) + the argument bytes, resident before it

    A benchmark, not a test. ``compiler_options`` apply to the child's compile (default:
    XLA's, as a run compiles); ``plan_options`` go to :func:`plan_for_run`.

    Returns:
      A dict: the setting, the three peaks, ``predicted_over_measured``,
      ``predicted_over_compiled``, ``ran`` (the step returned a finite loss),
      ``within_budget`` (measured <= budget) and the planning time.
    """
    import json
    import os
    import subprocess
    import sys
    import tempfile

    result = plan_for_run(config, budget_bytes, **plan_options)
    chosen = result.chosen.setting
    run = dataclasses.replace(config, microbatches=chosen.num_microbatches, remat=chosen.remat)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"config": run.to_json(), "compiler_options": compiler_options}, f)
    code = f"from leanstep.plan import _measure_in_child; _measure_in_child({f.name!r})"
    # A fixed mmap threshold makes every buffer over 64 KiB a fresh mapping whose pages count in the
    # RSS, instead of heap pages the warm-up step left resident (glibc raises the threshold on free).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    if child.returncode:
        raise RuntimeError(f"the measuring subprocess failed ({child.returncode}):\n{child.stderr[-3000:]}")
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    predicted = result.chosen.peak_bytes
    return {
        "model": config.model, "size": config.size, "batch_size": config.batch_size, "seq_len": config.seq_len,
        "budget_bytes": result.budget_bytes, "setting": chosen._asdict(), "predicted_peak_bytes": predicted,
        **measured, "predicted_over_measured": predicted / max(measured["measured_peak_bytes"], 1),
        "predicted_over_compiled": predicted / measured["compiled_peak_bytes"],
        "ran": bool(np.isfinite(measured["loss"])),
        "within_budget": measured["measured_peak_bytes"] <= result.budget_bytes,
        "planning_seconds": result.seconds,
    }


def time_candidates(config: Any, budget_bytes: int | str, *, steps: int = 5, rounds: int = 3) -> dict[str, Any]:
    """Times every candidate's real step (XLA's default options) and compares with the plan's choice.

    Each candidate is compiled, warmed up, then run ``steps`` times in each of ``rounds``
    interleaved rounds (so a change in machine load hits all alike); its time is the
    fastest step (on a shared machine the noise only ever adds time), the median is
    reported too. A benchmark, not a test.

    Returns:
      ``{"plan": Plan.to_json(), "rows": [...], "chosen_seconds", "fastest_fitting_seconds",
      "chosen_over_fastest"}``; each row has the setting, peak, fits, FLOPs, the median
      step time and the peak of the default-options executable.
    """
    result = plan_for_run(config, budget_bytes, exhaustive=True)
    runs = []
    for candidate in result.candidates:
        s = candidate.setting
        step, state, batch = _run_inputs(dataclasses.replace(config, microbatches=s.num_microbatches, remat=s.remat))
        executable = step.lower(state, batch).compile()
        memory = executable.memory_analysis()
        state, _ = executable(state, batch)
        jax.block_until_ready(state)
        runs.append([candidate, executable, state, batch, [], memory])
    for _ in range(rounds):
        for run in runs:
            for _ in range(steps):
                t0 = time.perf_counter()
                run[2], metrics = run[1](run[2], run[3])
                jax.block_until_ready((run[2], metrics))
                run[4].append(time.perf_counter() - t0)
    rows = [{**c.setting._asdict(), "peak_bytes": c.peak_bytes, "fits": c.fits, "flops": c.flops,
             "chosen": c is result.chosen, "seconds": float(np.min(times)), "median_seconds": float(np.median(times)),
             "default_options_peak_bytes": m.argument_size_in_bytes + m.output_size_in_bytes
             - m.alias_size_in_bytes + m.temp_size_in_bytes}
            for c, _, _, _, times, m in runs]
    chosen = next(r["seconds"] for r in rows if r["chosen"])
    fastest = min(r["seconds"] for r in rows if r["fits"])
    return {"plan": result.to_json(), "rows": rows, "chosen_seconds": chosen,
            "fastest_fitting_seconds": fastest, "chosen_over_fastest": chosen / fastest}
