r"""Where a compiled step keeps its buffers (device or host memory) and what it moves between them.

Three readings of one step, each from the program, none from a formula:

.. code-block:: text

    entry layout    the compiled program's parameters and results; S(5) marks host memory
                    (device_argument_bytes, host_argument_bytes, ..._output_bytes)
    HLO transfers   instructions of the compiled program whose operand is in host memory and
                    result on the device (to_device), or the reverse (to_host), times the trip
                    counts of the loops around them
    jaxpr transfers the traced program's device_put equations between memory spaces (what the
                    step asks for, whatever the backend does with it), times scan lengths

``memory_analysis()`` adds the temporaries and what the backend itself attributes to host memory
(XLA:TPU and XLA:GPU; XLA:CPU reports 0 there, keeps every buffer in its one memory and moves
nothing: its HLO has no transfers, only the entry layout's S(5)). :func:`check_offload` refuses an
offload that keeps nothing on the host or whose device peak is not lower than the step without it.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import jax

from leanstep.common.jaxprs import weighted_equations
from leanstep.common.memory_sizes import format_bytes
from leanstep.inspection.hlo_text import ITEMSIZE, compiled_text, parse_hlo, trip_counts

__all__ = ["MemorySpaceReport", "Transfers", "check_offload", "entry_layout", "hlo_transfers", "memory_space_report"]

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{([^}]*)\})?")
_HOST = "S(5)"


class Transfers(NamedTuple):
    """Moves in one direction: how many a step runs, their bytes, the largest one's bytes."""

    moves: int = 0
    bytes: int = 0
    largest: int = 0

    def add(self, size: int, times: int) -> Transfers:
        """These and ``times`` more moves of ``size`` bytes."""
        return Transfers(self.moves + times, self.bytes + size * times, max(self.largest, size))


class MemorySpaceReport(NamedTuple):
    """One compiled step's buffers by memory space, and its transfers (see the module doc)."""

    device_argument_bytes: int
    host_argument_bytes: int
    device_output_bytes: int
    host_output_bytes: int
    device_alias_bytes: int
    temp_bytes: int
    reported_host_bytes: int  # memory_analysis' host argument + output + temp bytes (0 on XLA:CPU)
    to_device: Transfers  # in the compiled program
    to_host: Transfers
    asked_to_device: Transfers  # in the traced program
    asked_to_host: Transfers
    platform: str

    @property
    def device_peak_bytes(self) -> int:
        """Device-memory arguments + results - aliased + temporaries."""
        return self.device_argument_bytes + self.device_output_bytes - self.device_alias_bytes + self.temp_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes the program keeps in host memory across the call (its host parameters)."""
        return self.host_argument_bytes

    def __str__(self) -> str:
        mib = format_bytes
        moved = lambda t: f"{t.moves} ({mib(t.bytes)}, largest {mib(t.largest)})"
        return "\n".join(
            [
                f"memory spaces ({self.platform}):",
                (
                    f"  device  arguments {mib(self.device_argument_bytes)}, results {mib(self.device_output_bytes)}, "
                    f"temporaries {mib(self.temp_bytes)}, peak {mib(self.device_peak_bytes)}"
                ),
                (
                    f"  host    arguments {mib(self.host_argument_bytes)}, results {mib(self.host_output_bytes)} "
                    f"(the backend's analysis: {mib(self.reported_host_bytes)})"
                ),
                f"  compiled transfers  to device {moved(self.to_device)}; to host {moved(self.to_host)}",
                f"  traced transfers    to device {moved(self.asked_to_device)}; to host {moved(self.asked_to_host)}",
            ]
        )


def _arrays(text: str) -> list[tuple[int, bool]]:
    """``(bytes, in host memory)`` of each array in an HLO type or layout list."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(text):
        if dtype in ITEMSIZE:
            size = ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d)
            out.append((size, _HOST in (layout or "")))
    return out


def entry_layout(hlo: str) -> tuple[list[tuple[int, bool]], list[tuple[int, bool]], dict[int, int]]:
    """The entry's parameters and results as ``(bytes, in host memory)``, and the results aliased to
    parameters (``result index -> parameter number``), from a compiled program's HLO text."""
    header = hlo.split("\n", 1)[0]
    start = header.find("entry_computation_layout={")
    if start < 0:
        raise ValueError("the compiled program's text has no entry_computation_layout")
    depth, end = 0, start + len("entry_computation_layout=")
    for position in range(end, len(header)):  # to the brace that closes the layout
        depth += {"{": 1, "}": -1}.get(header[position], 0)
        end = position
        if depth == 0:
            break
    layout = header[start + len("entry_computation_layout={") : end]
    arguments, results = layout.split(")->", 1)
    aliases = {
        int(o): int(p) for o, p in re.findall(r"\{(\d+)\}: \((\d+),", header.split("input_output_alias=", 1)[-1])
    }
    if "input_output_alias=" not in header:
        aliases = {}
    return _arrays(arguments), _arrays(results), aliases


def hlo_transfers(hlo: str) -> tuple[Transfers, Transfers]:
    """``(to device, to host)`` moves of a compiled program's HLO text (see the module doc); an
    asynchronous pair counts once, at its ``-done``, with the operands of its ``-start``."""
    computations, entry = parse_hlo(hlo)
    trips = trip_counts(computations, entry)
    types = {i.name: i for instructions in computations.values() for i in instructions}
    to_device, to_host = Transfers(), Transfers()
    for name, instructions in computations.items():
        for instruction in instructions:
            if instruction.op.endswith("-start") or instruction.op in ("parameter", "get-tuple-element", "tuple"):
                continue
            operands = instruction.operands
            if instruction.op.endswith("-done") and operands and operands[0] in types:
                operands = types[operands[0]].operands  # the -start's operands: what is moved
            result = _arrays(instruction.type_text)
            inputs = [a for o in operands if o in types for a in _arrays(types[o].type_text)]
            times = trips.get(name, 1)
            if result and all(host for _, host in result) and any(not host and size > 4 for size, host in inputs):
                to_host = to_host.add(sum(size for size, host in inputs if not host and size > 4), times)
            elif result and not any(host for _, host in result) and any(host for _, host in inputs):
                to_device = to_device.add(sum(size for size, _ in result), times)
    return to_device, to_host


def _traced_transfers(jaxpr: Any) -> tuple[Transfers, Transfers]:
    to_device, to_host = Transfers(), Transfers()
    for eqn, times in weighted_equations(jaxpr):
        if eqn.primitive.name != "device_put":
            continue
        down = up = 0  # one equation moves a tree (a chunk's state) at once
        for var, target in zip(eqn.invars, eqn.params.get("devices", ())):
            source = getattr(var.aval, "memory_space", None)
            size = var.aval.size * var.aval.dtype.itemsize
            down += size if target == jax.memory.Space.Device and source == jax.memory.Space.Host else 0
            up += size if target == jax.memory.Space.Host and source != jax.memory.Space.Host else 0
        to_device = to_device.add(down, int(times)) if down else to_device
        to_host = to_host.add(up, int(times)) if up else to_host
    return to_device, to_host


def memory_space_report(step: Any, *args: Any) -> MemorySpaceReport:
    """The memory spaces of ``step(*args)`` (a jitted function, e.g. :func:`leanstep.make_train_step`'s),
    traced and compiled for the default backend (``args`` may be ``jax.ShapeDtypeStruct`` s; nothing runs).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> report = memory_space_report(jax.jit(lambda x: x * 2), jnp.ones((256, 256)))
      >>> report.device_argument_bytes, report.host_argument_bytes, report.to_device.moves
      (262144, 0, 0)
    """
    traced = step.trace(*args)
    compiled = traced.lower().compile()
    hlo = compiled_text(compiled)
    params, results, aliases = entry_layout(hlo)
    memory = compiled.memory_analysis()
    host_reported = sum(
        int(getattr(memory, f"host_{what}_size_in_bytes", 0) or 0) for what in ("argument", "output", "temp")
    )
    to_device, to_host = hlo_transfers(hlo)
    asked_device, asked_host = _traced_transfers(traced.jaxpr)
    return MemorySpaceReport(
        device_argument_bytes=sum(size for size, host in params if not host),
        host_argument_bytes=sum(size for size, host in params if host),
        device_output_bytes=sum(size for size, host in results if not host),
        host_output_bytes=sum(size for size, host in results if host),
        device_alias_bytes=sum(
            results[o][0] for o, p in aliases.items() if o < len(results) and p < len(params) and not params[p][1]
        ),
        temp_bytes=int(memory.temp_size_in_bytes),
        reported_host_bytes=host_reported,
        to_device=to_device,
        to_host=to_host,
        asked_to_device=asked_device,
        asked_to_host=asked_host,
        platform=jax.devices()[0].platform,
    )


def check_offload(offloaded: MemorySpaceReport, plain: MemorySpaceReport) -> None:
    """Raises unless the offloaded step keeps bytes in host memory and its device peak is below ``plain``'s.

    Raises:
      ValueError: the offload moves nothing (no host bytes: e.g. a state never placed in host
        memory, or XLA kept an offloaded loop carry on the device, openxla/xla#17541), or its
        compiled device peak is not lower than the step's without it (the figures named).
    """
    if offloaded.host_bytes == 0 and offloaded.to_host.bytes == 0 and offloaded.asked_to_host.bytes == 0:
        raise ValueError(
            "the offload policy moves nothing: the compiled step keeps no bytes in host memory and moves none "
            "there; place the state with leanstep.step.offload_opt_state(state) (or do not offload)"
        )
    if offloaded.device_peak_bytes >= plain.device_peak_bytes:
        raise ValueError(
            f"the offload policy does not lower the step's device peak: {offloaded.device_peak_bytes:,} bytes "
            f"offloaded against {plain.device_peak_bytes:,} without it ({offloaded.platform}); keep the state "
            "on the device"
        )
