r"""How long a compiled step would take on an accelerator it was not compiled for: a stated cost model.

A step's predicted time on one device of an ``N``-device cluster, from what the compiled
executable does per device (its matrix-multiply FLOPs, :func:`leanstep.inspection.hlo_text.dot_flops`,
and its collectives, :func:`leanstep.inspection.collectives_report`):

.. code-block:: text

    compute    = dot FLOPs / (peak FLOP/s of the compute dtype * efficiency)
                 (the FP8 matmuls' share of them at the FP8 rate, where the accelerator has one)
    collective = trips * (latency + sent / (bandwidth * link_efficiency))
                 sent: ring algorithms over a group of n devices and a buffer of B bytes
                   all-reduce 2 (n-1)/n B;  all-gather, reduce-scatter, all-to-all (n-1)/n B;
                   collective-permute B
                 bandwidth: within a node when every device of the group is in one node
                   (devices fill nodes in mesh order, the last axis fastest), else across nodes
    predicted  = compute + sum of collectives          (no overlap of the two: an upper bound
                                                         of the model; XLA overlaps some)

Assumptions, each a field of :class:`Accelerator` a user can change: peak dense FLOP/s from
the vendor's datasheet (float32 matmuls at TF32 rate on NVIDIA, at bf16 rate on TPU, which is
what XLA's default precision does there), half of it reached (``efficiency=0.5``, an assumption: leanstep has not measured
it on these devices); 80% of the interconnect's nominal one-way bandwidth per
device; 10 microseconds a collective. Only matmuls count as compute: elementwise work, memory
traffic and kernel launches are not modelled, so a small model's predicted time is too short.

XLA:CPU, where leanstep plans, runs bf16 collectives in float32. For a bf16 compute dtype the
model counts each collective that is not a gradient reduction (all-gathers of parameters,
tensor-parallel activations) at 2 bytes an element, as an accelerator would send it; gradient
reductions are float32 by design (the accumulator is float32).

Presets (:data:`ACCELERATORS`; sources: NVIDIA H100, H200 and A100 datasheets, DGX H100/A100
user guides for the per-GPU network, Google Cloud TPU v4 and v5e system architecture pages):

=========  ==========  ============================  =========  ==============  ==============
name       memory      dense bf16 / f32 / fp8 TFLOP  node size  in node (GB/s)  across (GB/s)
=========  ==========  ============================  =========  ==============  ==============
h100       80 GB       989 / 495 (TF32) / 1979       8          450 (NVLink)    50 (400 Gb/s IB)
h200       141 GB      989 / 495 (TF32) / 1979       8          450 (NVLink)    50 (400 Gb/s IB)
a100       80 GB       312 / 156 (TF32) / none       8          300 (NVLink)    25 (200 Gb/s IB)
tpu-v4     32 GiB      275 / 275 / none              4096 (pod) 268.6 (ICI)     none modelled
tpu-v5e    16 GB       197 / 197 / none              256 (pod)  200 (ICI)       3.125 (DCN)
=========  ==========  ============================  =========  ==============  ==============

An accelerator without an FP8 rate runs FP8 matmuls at its compute dtype's rate.

TPU in-pod bandwidth is the pod's all-reduce bandwidth divided by its chips (v4: 1.1 PB/s over
4096; v5e: 51.2 TB/s over 256); v5e's data-center network is 2 x 100 Gb/s per host of 8 chips.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from leanstep.common.checks import is_real
from leanstep.common.memory_sizes import parse_bytes

__all__ = ["ACCELERATORS", "Accelerator", "StepCost", "collective_seconds", "get_accelerator", "step_cost"]


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """What the cost model assumes of one device and its links (see the module doc).

    Attributes:
      name: a label.
      memory_bytes: memory per device (the default budget).
      flops: peak dense FLOP/s per device by compute dtype name (``"bfloat16"``, ``"float32"``, ...).
      node_size: devices joined by the fast interconnect (a node, a TPU pod).
      bandwidth: one-way bytes/s per device within a node.
      inter_bandwidth: one-way bytes/s per device between nodes (None: a plan may not span nodes).
      latency: seconds per collective execution.
      efficiency: the fraction of peak FLOP/s reached.
      link_efficiency: the fraction of nominal bandwidth reached.
    """

    name: str
    memory_bytes: int
    flops: dict[str, float]
    node_size: int
    bandwidth: float
    inter_bandwidth: float | None
    latency: float = 10e-6
    efficiency: float = 0.5
    link_efficiency: float = 0.8

    def __post_init__(self) -> None:
        for field in ("bandwidth", "latency", "efficiency", "link_efficiency"):
            value = getattr(self, field)
            if not (is_real(value) and math.isfinite(value) and value >= 0 and (value > 0 or field == "latency")):
                raise ValueError(f"Accelerator.{field} must be a positive finite number, got {value!r}")
        if not all(is_real(v) and math.isfinite(v) and v > 0 for v in self.flops.values()) or not self.flops:
            raise ValueError(f"Accelerator.flops must map dtype names to positive FLOP/s, got {self.flops!r}")
        if self.inter_bandwidth is not None and not (is_real(self.inter_bandwidth) and self.inter_bandwidth > 0):
            raise ValueError(
                f"Accelerator.inter_bandwidth must be a positive number or None, got {self.inter_bandwidth!r}"
            )
        if not (isinstance(self.node_size, int) and self.node_size >= 1):
            raise ValueError(f"Accelerator.node_size must be an int >= 1, got {self.node_size!r}")

    def peak_flops(self, dtype: Any) -> float:
        """Peak FLOP/s for matmuls in ``dtype`` (its name; float16 counts as bfloat16)."""
        name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
        name = {"float16": "bfloat16"}.get(name, name)
        if name not in self.flops:
            raise ValueError(
                f"accelerator {self.name!r} has no FLOP/s for compute dtype {name}; it knows {', '.join(self.flops)}"
            )
        return self.flops[name]

    def replace(self, **changes: Any) -> Accelerator:
        """A copy with ``changes`` (``flops`` may be one number: every dtype at that rate)."""
        if "flops" in changes and is_real(changes["flops"]):
            changes["flops"] = dict.fromkeys(self.flops, float(changes["flops"]))
        return dataclasses.replace(self, **changes)


_GB = 10**9
#: Named presets (see the module doc for the numbers and their sources).
ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator(
        "h100", 80 * _GB, {"bfloat16": 989e12, "float32": 495e12, "float8": 1979e12}, 8, 450 * _GB, 50 * _GB
    ),
    "h200": Accelerator(
        "h200", 141 * _GB, {"bfloat16": 989e12, "float32": 495e12, "float8": 1979e12}, 8, 450 * _GB, 50 * _GB
    ),
    "a100": Accelerator("a100", 80 * _GB, {"bfloat16": 312e12, "float32": 156e12}, 8, 300 * _GB, 25 * _GB),
    "tpu-v4": Accelerator("tpu-v4", 32 * 2**30, {"bfloat16": 275e12, "float32": 275e12}, 4096, 1.1e15 / 4096, None),
    "tpu-v5e": Accelerator(
        "tpu-v5e", 16 * _GB, {"bfloat16": 197e12, "float32": 197e12}, 256, 51.2e12 / 256, 2 * 100e9 / 8 / 8
    ),
}


def get_accelerator(accelerator: str | Accelerator, **overrides: Any) -> Accelerator:
    """A preset by name (or an :class:`Accelerator` as is), with ``overrides`` of its fields.

    Example:
      >>> get_accelerator("h100").node_size, get_accelerator("a100", efficiency=0.4).efficiency
      (8, 0.4)
    """
    if isinstance(accelerator, Accelerator):
        found = accelerator
    elif isinstance(accelerator, str) and accelerator.lower() in ACCELERATORS:
        found = ACCELERATORS[accelerator.lower()]
    else:
        raise ValueError(f"accelerator must be one of {', '.join(ACCELERATORS)} or an Accelerator, got {accelerator!r}")
    overrides = {k: (parse_bytes(v) if k == "memory_bytes" else v) for k, v in overrides.items() if v is not None}
    return found.replace(**overrides) if overrides else found


def _group_in_node(axes: Sequence[str], mesh_shape: dict[str, int], node_size: int) -> bool:
    """Whether a group spanning ``axes`` (all others fixed) lies in one node of ``node_size`` devices."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
    last = sum((sizes[i] - 1) * strides[i] for i, n in enumerate(names) if n in axes)
    return last < node_size


_SENT = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "ragged-all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
    "collective-broadcast": lambda n: (n - 1) / n,
}


def collective_seconds(
    kind: str,
    nbytes: float,
    group_size: int,
    axes: Sequence[str],
    mesh_shape: dict[str, int],
    accelerator: Accelerator,
    *,
    trips: int = 1,
) -> float:
    """Seconds for ``trips`` executions of one collective (see the module doc).

    Example:
      >>> h100 = get_accelerator("h100", latency=0.0, link_efficiency=1.0)
      >>> collective_seconds("all-reduce", 450e9, 8, ("data",), {"data": 8}, h100)  # 2 * 7/8 s in one node
      1.75
    """
    if group_size < 2:
        return 0.0
    within = _group_in_node(axes, mesh_shape, accelerator.node_size)
    bandwidth = accelerator.bandwidth if within else accelerator.inter_bandwidth
    if bandwidth is None:
        raise ValueError(
            f"a {kind} over {','.join(axes)} spans more than one {accelerator.name} node of "
            f"{accelerator.node_size} devices, and the preset models no link between nodes"
        )
    sent = _SENT.get(kind, lambda n: 1.0)(group_size) * nbytes
    return trips * (accelerator.latency + sent / (bandwidth * accelerator.link_efficiency))


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The cost model's account of one step on one device (see the module doc).

    Attributes:
      flops: matrix-multiply FLOPs per device.
      bytes: bytes per step of every collective as the accelerator would send them (buffer
        sizes, not the ring's traffic).
      collectives: collective executions per step.
      compute_seconds, communication_seconds: the two terms; ``seconds`` is their sum.
      by_axes: communication seconds by the mesh axes a collective spans.
    """

    flops: float
    bytes: int
    collectives: int
    compute_seconds: float
    communication_seconds: float
    by_axes: dict[tuple[str, ...], float] = dataclasses.field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.communication_seconds


def step_cost(
    flops: float,
    report: Any,
    mesh_shape: dict[str, int],
    accelerator: Accelerator,
    compute_dtype: Any,
    *,
    promoted_to_float32: bool = False,
    fp8_fraction: float = 0.0,
) -> StepCost:
    """Prices a compiled step: its per-device dot FLOPs and its :class:`leanstep.inspection.CollectivesReport`.

    Args:
      flops: dot FLOPs per device (:func:`leanstep.inspection.hlo_text.dot_flops`).
      report: the step's collectives.
      mesh_shape: ``{axis: size}`` of its mesh, in mesh order.
      accelerator: the :class:`Accelerator`.
      compute_dtype: the step's compute dtype (picks the FLOP rate).
      promoted_to_float32: the compiler ran bf16 collectives in float32 (XLA:CPU); count the
        ones that are not gradient reductions at 2 bytes an element.
      fp8_fraction: the share of ``flops`` in FP8 matmuls (:func:`leanstep.blocks.fp8_dot_general`),
        priced at the accelerator's ``"float8"`` rate where it has one.
    """
    rate = accelerator.peak_flops(compute_dtype) * accelerator.efficiency
    fp8_rate = accelerator.flops.get("float8", accelerator.peak_flops(compute_dtype)) * accelerator.efficiency
    compute_seconds = flops * (1.0 - fp8_fraction) / rate + flops * fp8_fraction / fp8_rate
    narrow = promoted_to_float32 and np.dtype(compute_dtype).itemsize == 2
    seconds, total, executions = 0.0, 0, 0
    by_axes: dict[tuple[str, ...], float] = {}
    for c in report.collectives:
        gradient_reduction = c.kind in ("all-reduce", "reduce-scatter") and c.payload == "parameters"
        size = c.bytes
        if narrow and not gradient_reduction and all(dtype == "f32" for dtype, _ in c.shapes):
            size //= 2
        total += size * c.trips
        executions += c.trips
        spent = collective_seconds(c.kind, size, c.group_size, c.axes, mesh_shape, accelerator, trips=c.trips)
        by_axes[c.axes] = by_axes.get(c.axes, 0.0) + spent
        seconds += spent
    return StepCost(flops, total, executions, compute_seconds, seconds, by_axes)
