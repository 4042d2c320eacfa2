"""Interleaved wall-clock timing and XLA's compiled memory and cost analysis."""

from __future__ import annotations

import collections
import re
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["compiled_stats", "hlo_op_counts", "summarize_times", "time_interleaved"]

_HLO_OP = re.compile(r"=\s*\S+\s+([a-z][\w-]*)\(")


def compiled_stats(compiled: Any) -> dict[str, Any]:
    """Memory (bytes) and cost (GFLOP) of a ``jax.stages.Compiled``, from XLA's own analysis.

    ``temp_bytes`` is the scratch XLA allocates for the program (activations, saved
    residuals, gradient buffers); arguments and outputs are reported apart, and
    ``alias_bytes`` counts outputs that reuse donated arguments. ``xla_gflop`` is XLA's
    cost analysis, which counts the body of a loop (``lax.scan`` over layers or
    microbatches) once, not once per iteration; it is kept for reference only.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> compiled = jax.jit(lambda a: a @ a).lower(jnp.ones((64, 64))).compile()
      >>> stats = compiled_stats(compiled)
      >>> stats["argument_bytes"], stats["output_bytes"], round(stats["xla_gflop"], 6)
      (16384, 16384, 0.000524)
    """
    memory = compiled.memory_analysis()
    try:
        cost = compiled.cost_analysis()
        if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
            cost = cost[0] if cost else {}
        flops = cost.get("flops") if cost else None
    except Exception:  # noqa: BLE001 - cost analysis is optional and backend-specific
        flops = None
    return {
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
        "xla_gflop": None if flops is None else float(flops) / 1e9,
    }


def hlo_op_counts(compiled: Any) -> dict[str, int]:
    """How often each HLO opcode appears in the optimized program (fusion bodies included).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> compiled = jax.jit(lambda a: a @ a).lower(jnp.ones((4, 4))).compile()
      >>> hlo_op_counts(compiled)["dot"]
      1
    """
    return dict(collections.Counter(_HLO_OP.findall(compiled.as_text())))


def time_interleaved(
    contenders: Mapping[str, Callable[[], Any]],
    *,
    repeats: int | Mapping[str, int],
    warmup: int = 1,
    on_round: Callable[[int, int], None] | None = None,
) -> dict[str, list[float]]:
    """Times every contender round-robin (A B C A B C ...), returning seconds per call.

    Each call must finish its work before returning (block on the result). Round-robin
    order makes slow drift in the machine's speed (other processes, thermal state) hit
    every contender alike instead of whichever happened to run last. A contender with
    fewer repeats than the longest (a very slow one) runs in rounds spread evenly over
    the whole run, so it still sees the same drift.

    Args:
      contenders: name -> a zero-argument callable running one step to completion.
      repeats: timed calls per contender (>= 1), one number for all or a mapping.
      warmup: untimed calls per contender first, also interleaved.
      on_round: called with ``(round, rounds)`` after each round (progress).

    Returns:
      name -> the list of per-call wall times.

    Example:
      >>> calls = []
      >>> times = time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
      ...                          repeats={"a": 4, "b": 2}, warmup=0)
      >>> "".join(calls), len(times["a"]), len(times["b"])
      ('abaaba', 4, 2)
    """
    counts = {name: repeats if isinstance(repeats, int) else repeats[name] for name in contenders}
    rounds = max(counts.values(), default=0)
    for _ in range(warmup):
        for run in contenders.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for index in range(rounds):
        for name, run in contenders.items():
            # Round `index` runs a contender with k repeats iff k * index / rounds crosses an
            # integer there (k of the `rounds` rounds, evenly spaced, the first one included).
            k = counts[name]
            if (index * k + rounds - 1) // rounds == ((index + 1) * k + rounds - 1) // rounds:
                continue
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
        if on_round is not None:
            on_round(index, rounds)
    return times


def summarize_times(seconds: list[float]) -> dict[str, float]:
    """``step_ms_median``, ``step_ms_min`` and ``step_ms_max`` of a list of times in seconds.

    Example:
      >>> summarize_times([0.003, 0.001, 0.002])
      {'step_ms_median': 2.0, 'step_ms_min': 1.0, 'step_ms_max': 3.0}
    """
    return {
        "step_ms_median": statistics.median(seconds) * 1e3,
        "step_ms_min": min(seconds) * 1e3,
        "step_ms_max": max(seconds) * 1e3,
    }
