"""Shared steps of planning: abstract stand-ins, one compiled candidate's memory, the microbatch bisection.

Used by :mod:`leanstep.planning.one_device` (one device) and :mod:`leanstep.planning.cluster` (a cluster).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from leanstep.planning.records import Candidate

__all__ = ["FAST_CPU_OPTIONS", "abstract_tree", "compile_candidate", "compiler_options_for", "first_fit"]

#: LLVM's optimization level only: buffer assignment (every memory number) comes before it.
FAST_CPU_OPTIONS = {"xla_backend_optimization_level": 0}


def compiler_options_for(options: Any, platform: str) -> dict[str, Any] | None:
    """``"auto"``: :data:`FAST_CPU_OPTIONS` on CPU, XLA's defaults elsewhere; a dict or None as is."""
    if options == "auto":
        return FAST_CPU_OPTIONS if platform == "cpu" else None
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"compiler_options must be a dict, 'auto' or None, got {options!r}")
    return options


def abstract_tree(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct`` stand-ins of a tree of arrays (PRNG keys keep their dtype)."""

    def leaf(x: Any) -> jax.ShapeDtypeStruct:
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        # PRNG keys (a model's own RNG state) keep their extended dtype.
        extended = jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
        return jax.ShapeDtypeStruct(np.shape(x), dtype if extended else jax.dtypes.canonicalize_dtype(dtype))

    return jax.tree.map(leaf, tree)


def compile_candidate(candidate: Candidate, traced: Any, budget: int, options: dict[str, Any] | None) -> Candidate:
    """Compiles a traced step and fills in ``candidate``'s memory (``memory_analysis()``) and fit."""
    start = time.perf_counter()
    executable = traced.lower().compile(options) if options else traced.lower().compile()
    memory, cost = executable.memory_analysis(), executable.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    arguments, outputs = memory.argument_size_in_bytes, memory.output_size_in_bytes
    alias, temp = memory.alias_size_in_bytes, memory.temp_size_in_bytes
    peak = arguments + outputs - alias + temp
    return dataclasses.replace(
        candidate,
        argument_bytes=arguments,
        output_bytes=outputs,
        alias_bytes=alias,
        temp_bytes=temp,
        peak_bytes=peak,
        xla_flops=(cost or {}).get("flops"),
        xla_peak_bytes=getattr(memory, "peak_memory_in_bytes", None),
        fits=peak <= budget,
        compile_seconds=time.perf_counter() - start,
        executable=executable,
    )


def first_fit(members: list[int], fits: Callable[[int], bool]) -> int | None:
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
