r"""What each kernel of a compiled program takes inside it, measured: :func:`trace_kernels`.

XLA:CPU's runtime records one profiler event per kernel (thunk) it runs, named after the HLO
instruction (``ynn_fusion.5``, ``multiply_tanh_fusion``, ``dot.57``, ``copy.86``).
:func:`trace_kernels` runs a call under ``jax.profiler`` and adds those events up, per
instruction and per group, where a group is the phase and the JAX primitive that the
instruction's metadata names:

.. code-block:: text

    phase     backward     op_name has transpose(jvp(...))
              forward      op_name has jvp(...)
              loop         inside a while loop, outside the loss (microbatch slicing, accumulation)
              update       everything else with an op_name (optimizer, clipping, loss scale)
              xla          no op_name: copies and layout changes XLA added
    primitive matmul for a dot, a convolution or a fusion holding one; else the last name
              of op_name (mul, select_n, reduce_sum, dynamic_update_slice, ...)

Loops and calls are left out (their kernels are counted). The trace costs a few microseconds
per kernel, so a traced call is slower than an untraced one; both are reported.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import jax

from leanstep.inspection.hlo_text import Instruction, parse_hlo

__all__ = ["format_trace", "kernel_group", "trace_kernels"]

_CONTAINERS = frozenset({"while", "call", "conditional"})
_MARKER = "leanstep.trace_kernels call "  # names the profiler's annotation of each traced call


def kernel_group(inst: Instruction, matmul: bool) -> tuple[str, str]:
    """``(phase, primitive)`` of one instruction (see the module doc).

    Example:
      >>> from leanstep.inspection.hlo_text import parse_hlo
      >>> hlo = '''ENTRY %main (a: f32[4]) -> f32[4] {
      ...   %a = f32[4]{0} parameter(0)
      ...   ROOT %m = f32[4]{0} multiply(%a, %a), metadata={op_name="jit(step)/while/body/transpose(jvp())/mul"}
      ... }'''
      >>> kernel_group(parse_hlo(hlo)[0]["main"][1], matmul=False)
      ('backward', 'mul')
    """
    match = re.search(r'op_name="([^"]*)"', inst.rest)
    if match is None:
        return "xla", "matmul" if matmul else inst.op
    name = match.group(1)
    phase = (
        "backward"
        if "transpose(jvp" in name
        else "forward"
        if "jvp(" in name
        else "loop"
        if "/while" in name
        else "update"
    )
    last = name.split(";")[0].rsplit("/", 1)[-1]
    while (wrapped := re.fullmatch(r"\w+\((.*)\)", last)) is not None:  # jit(_where) -> _where
        last = wrapped.group(1)
    return phase, "matmul" if matmul else (last or inst.op)


def _union_ns(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def trace_kernels(call: Callable[[], Any], hlo: str, *, calls: int = 3, top: int = 15) -> dict[str, Any]:
    r"""Runs ``call`` ``calls`` times under the profiler and sums the kernel events of the fastest call.

    .. math:: \mathrm{overlap} = \frac{\sum_k t_k}{|\bigcup_k [s_k, s_k + t_k]|}

    (above 1 when kernels ran at the same time on different threads).

    Args:
      call: runs the program whose optimized HLO text is ``hlo`` to completion (after one
        untimed warm-up call).
      hlo: its ``compiled.as_text()``.
      calls: traced calls.
      top: how many of the slowest instructions to list.

    Returns:
      Of the fastest call: ``wall_s`` (traced; ``wall_s_median`` of all calls), ``kernel_s``
      (all its kernel events), ``busy_s`` (their union),
      ``matmul_s`` and ``other_s`` (events of matmul kernels and of the rest), ``kernels``
      and ``matmul_kernels`` (counts); ``overlap``; ``groups`` (``{"phase", "primitive",
      "seconds", "kernels"}``, slowest first) and ``top`` (``{"name", "op", "phase",
      "primitive", "seconds", "kernels"}``); ``lines``: each profiler line's events over all
      traced calls (``{"events", "seconds", "top"}``).

    Example:
      >>> import jax.numpy as jnp
      >>> f = jax.jit(lambda a: jax.lax.fori_loop(0, 5, lambda i, c: jnp.tanh(c) @ c, a))
      >>> a = jnp.ones((64, 64)) / 64
      >>> trace = trace_kernels(lambda: f(a).block_until_ready(), f.lower(a).compile().as_text())
      >>> trace["matmul_kernels"], [g["primitive"] for g in trace["groups"]].count("matmul")
      (5, 1)
    """
    computations, _ = parse_hlo(hlo)
    module = re.search(r"^HloModule (\S+?),?\s", hlo, re.MULTILINE)
    instructions = {inst.name: inst for insts in computations.values() for inst in insts}
    with_matmul = {name for name, insts in computations.items() if any(i.op in ("dot", "convolution") for i in insts)}

    def is_matmul(inst: Instruction) -> bool:
        called = re.findall(r"%([^\s,{}]+)", inst.attribute("calls") or "")
        return inst.op in ("dot", "convolution") or (inst.op == "fusion" and bool(with_matmul.intersection(called)))

    windows, events, lines = _kernel_events(call, calls, instructions, module.group(1) if module else None)
    # The fastest call is the one least disturbed (by other processes, by the profiler's buffers).
    first, last = min(windows, key=lambda window: window[1] - window[0])
    chosen = [event for event in events if first <= event[0] <= last]
    groups, rows = _kernel_rows(chosen, instructions, is_matmul)
    kernel_s = sum(row["seconds"] for row in rows)
    matmul_s = sum(row["seconds"] for row in rows if row["primitive"] == "matmul")
    busy_s = _union_ns([event[:2] for event in chosen]) / 1e9
    walls = sorted((end - start) / 1e9 for start, end in windows)
    return {
        "calls": calls,
        "wall_s": walls[0],
        "wall_s_median": walls[len(walls) // 2],
        "kernel_s": kernel_s,
        "busy_s": busy_s,
        "matmul_s": matmul_s,
        "other_s": kernel_s - matmul_s,
        "kernels": sum(row["kernels"] for row in rows),
        "matmul_kernels": sum(row["kernels"] for row in rows if row["primitive"] == "matmul"),
        "overlap": kernel_s / busy_s if busy_s else 1.0,
        "groups": sorted(
            (
                {"phase": phase, "primitive": primitive, "seconds": spent, "kernels": int(n)}
                for (phase, primitive), (spent, n) in groups.items()
            ),
            key=lambda g: -g["seconds"],
        ),
        "top": sorted(rows, key=lambda row: -row["seconds"])[:top],
        "lines": lines,
    }


def _kernel_events(
    call: Callable[[], Any], calls: int, instructions: dict[str, Instruction], module: str | None
) -> tuple[list[tuple[int, int]], list[tuple[int, int, str]], dict[str, dict[str, Any]]]:
    """``(windows, events, lines)``: ``(start_ns, end_ns)`` of each of ``calls`` traced calls (after one untraced
    warm-up call), ``(start_ns, end_ns, name)`` of every kernel event of an instruction of ``module``
    (loops and calls left out), and each profiler line's events (``_line_summary``)."""
    call()
    with tempfile.TemporaryDirectory() as directory:
        jax.profiler.start_trace(directory)
        try:
            for index in range(calls):
                with jax.profiler.TraceAnnotation(f"{_MARKER}{index}"):
                    call()
        finally:
            jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
        with open(path, "rb") as file:
            data = jax.profiler.ProfileData.from_serialized_xspace(file.read())
    windows: list[tuple[int, int]] = []
    events: list[tuple[int, int, str]] = []
    with warnings.catch_warnings():
        # JAX 0.11's event stats warn (DeprecationWarning, "builtin type event_stats has no
        # __module__") from inside C++: a warning turned into an error there aborts the process.
        warnings.simplefilter("ignore", DeprecationWarning)
        _collect(data, instructions, module, windows, events)
        lines = _line_summary(data)
    return windows, events, lines


def _line_summary(data: Any, top: int = 8) -> dict[str, dict[str, Any]]:
    """Per profiler line (``plane / line``, of all traced calls): events, their summed seconds, and
    the ``top`` names by time. On an accelerator the device's lines ("XLA Ops", "XLA Modules")
    are where a step's time is, whatever its event names are."""
    out: dict[str, dict[str, Any]] = {}
    for plane in data.planes:
        for line in plane.lines:
            spent: collections.Counter[str] = collections.Counter()
            for event in line.events:
                spent[event.name] += event.end_ns - event.start_ns
            if spent:
                out[f"{plane.name} / {line.name}"] = {
                    "events": sum(1 for _ in line.events),
                    "seconds": sum(spent.values()) / 1e9,
                    "top": [[name, ns / 1e9] for name, ns in spent.most_common(top)],
                }
    return out


def _instruction_name(event_name: str) -> str:
    """The HLO instruction an event is of: XLA:CPU names it (``fusion.5``); a TPU's "XLA Ops" line
    gives its whole text (``%fusion.5 = bf16[8]{0} fusion(...)``).

    Example:
      >>> _instruction_name("%while.265 = (s32[], f32[8,2048]{1,0:T(8,128)}) while(...)"), _instruction_name("dot.57")
      ('while.265', 'dot.57')
    """
    match = re.match(r"%?([^\s=%]+)\s*=", event_name)
    return match.group(1) if match else event_name


def _collect(
    data: Any,
    instructions: dict[str, Instruction],
    module: str | None,
    windows: list[tuple[int, int]],
    events: list[tuple[int, int, str]],
) -> None:
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name.startswith(_MARKER):
                    windows.append((event.start_ns, event.end_ns))
                inst = instructions.get(_instruction_name(event.name))
                if inst is None or inst.op in _CONTAINERS:
                    continue
                if module and dict(event.stats).get("hlo_module", module) != module:
                    continue
                events.append((event.start_ns, event.end_ns, inst.name))


def _kernel_rows(
    chosen: list[tuple[int, int, str]],
    instructions: dict[str, Instruction],
    is_matmul: Callable[[Instruction], bool],
) -> tuple[dict[tuple[str, str], list[float]], list[dict[str, Any]]]:
    """``(groups, rows)`` of the kernel events ``chosen``: ``[seconds, kernels]`` per ``(phase, primitive)``,
    and one row per instruction (``{"name", "op", "phase", "primitive", "seconds", "kernels"}``)."""
    seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
    counts: collections.Counter[str] = collections.Counter()
    for start, end, name in chosen:
        seconds[name] += (end - start) / 1e9
        counts[name] += 1
    groups: dict[tuple[str, str], list[float]] = {}
    rows: list[dict[str, Any]] = []
    for name, spent in seconds.items():
        inst = instructions[name]
        phase, primitive = kernel_group(inst, is_matmul(inst))
        group = groups.setdefault((phase, primitive), [0.0, 0.0])
        group[0] += spent
        group[1] += counts[name]
        rows.append(
            {
                "name": name,
                "op": inst.op,
                "phase": phase,
                "primitive": primitive,
                "seconds": spent,
                "kernels": counts[name],
            }
        )
    return groups, rows


def format_trace(t: dict[str, Any], matmul_flops: float) -> list[str]:
    """The lines of a :func:`trace_kernels` measurement ``t``, for a table; ``matmul_flops``: the matmuls' FLOPs."""
    phases: dict[str, float] = {}
    for group in t["groups"]:
        phases[group["phase"]] = phases.get(group["phase"], 0.0) + group["seconds"]
    ms = {key: t[key] * 1e3 for key in ("wall_s", "kernel_s", "busy_s", "matmul_s", "other_s")}
    lines = [
        "",
        (
            f"measured inside the step (XLA:CPU profiler; the fastest of {t['calls']} traced steps, "
            f"{ms['wall_s']:.1f} ms)"
        ),
        (
            f"  kernels       {ms['kernel_s']:9.1f} ms   {t['kernels']:.0f} kernels; busy {ms['busy_s']:.1f} ms "
            f"(overlap {t['overlap']:.2f}), idle {ms['wall_s'] - ms['busy_s']:.1f} ms"
        ),
        (
            f"  matmuls       {ms['matmul_s']:9.1f} ms   {t['matmul_kernels']:.0f} kernels, with what XLA fused "
            f"into them: {matmul_flops / max(t['matmul_s'], 1e-12) / 1e9:.1f} GFLOP/s"
        ),
        f"  rest          {ms['other_s']:9.1f} ms   {t['kernels'] - t['matmul_kernels']:.0f} kernels",
        "  by phase      " + ", ".join(f"{name} {spent * 1e3:.1f} ms" for name, spent in phases.items()),
    ]
    return lines + [
        f"  {g['phase']:>9} {g['primitive']:<24} {g['seconds'] * 1e3:8.1f} ms "
        f"{g['seconds'] / max(t['kernel_s'], 1e-12):6.1%} {g['kernels']:6.0f} kernels"
        for g in t["groups"][:12]
    ]
