r"""Each mesh layout against one device: the same step, the same batch, the same result.

A layout (``"data=4"``, ``"fsdp=4"``, ``"data=2,tensor=2"``) changes where rows and parameters
live and adds cross-device sums, nothing else: its gradient is the one device's, summed in
another order (the float32-sum tolerance of the accumulation check,
:data:`~leanstep.verification.gradient_checks.SUM_TOLERANCE`, relative to the gradient's norm),
its model state (batch statistics averaged over devices) the same within that tolerance. A batch
statistic computed over each device's own rows is the bug this finds: the result then depends on
the device count.

The FP8 state is the maximum of values each device computes for its own rows, so a layout without
a tensor axis gives one device's bit for bit, **where XLA rounds every bf16 result as the program
writes it** (:data:`EXACT_ROUNDING`). By default it need not (``--xla_allow_excess_precision``):
XLA:CPU keeps a bf16 value in float32 where a fusion lets it, and a sharded program fuses
otherwise, so the built-in transformer's amaxes on ``data=2,fsdp=2`` were up to 1.2% off one
device's, more than a device's own maximum in place of the batch's (no ``pmax``) may be. So with
:data:`EXACT_ROUNDING` in ``XLA_FLAGS`` (``leanstep verify`` runs its layouts so) the FP8 state of
a layout without a tensor axis must be bit for bit; without it, or with a tensor axis (whose
contractions are summed in another order), each entry within the layout's tolerance
(:func:`leanstep.blocks.fp8_agreement.fp8_state_agreement`).

Layouts need that many devices in this process; on CPU, ``leanstep verify --devices N`` runs
them in a subprocess with ``N`` simulated devices (a process cannot add devices once JAX has
started).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from leanstep.blocks.fp8_agreement import fp8_state_agreement
from leanstep.sharding.distributed import parse_mesh
from leanstep.verification.bounds import LAMBDA, unit_roundoff
from leanstep.verification.gradient_checks import SUM_TOLERANCE, relative_error
from leanstep.verification.report import CheckResult
from leanstep.verification.runs import Runs
from leanstep.verification.trees import to_float64

__all__ = ["EXACT_ROUNDING", "check_meshes", "exact_rounding", "layout_meshes", "layouts_for", "make_layout"]

#: The XLA flag that has every bf16 result rounded as the program writes it (see the module doc).
EXACT_ROUNDING = "--xla_allow_excess_precision=false"


def exact_rounding(flags: str | None = None) -> bool:
    """Whether ``flags`` (default: this process's ``XLA_FLAGS``) turn XLA's excess precision off,
    by their last setting of it.

    Example:
      >>> exact_rounding("--xla_allow_excess_precision=true --xla_allow_excess_precision=false")
      True
      >>> exact_rounding("--xla_cpu_max_isa=AVX")
      False
    """
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    settings = [f for f in flags.split() if f.startswith("--xla_allow_excess_precision")]
    return bool(settings) and settings[-1].partition("=")[2].lower() in ("false", "0")


def make_layout(layout: str | Mesh) -> Mesh:
    """A mesh of this process's first devices for ``"data=2,fsdp=2"`` (a Mesh is returned as is).

    Raises:
      ValueError: a malformed layout, or one needing more devices than the process has.
    """
    if isinstance(layout, Mesh):
        return layout
    shape = parse_mesh(layout)
    size = math.prod(shape.values())
    devices = jax.devices()
    if size > len(devices):
        raise ValueError(
            f"meshes: {layout!r} needs {size} devices, this process has {len(devices)} (on CPU, `leanstep verify "
            f"--devices {size}` simulates them, or XLA_FLAGS=--xla_force_host_platform_device_count={size})"
        )
    grid = np.array(devices[:size]).reshape(tuple(shape.values()))
    return Mesh(grid, tuple(shape), axis_types=(AxisType.Auto,) * len(shape))


def layout_meshes(runs: Runs) -> list[Mesh]:
    """The meshes of ``runs.layouts``, each made once for these runs (its steps compile once a mesh).

    Raises:
      ValueError: as :func:`make_layout`.
    """
    for layout in runs.layouts:
        if layout not in runs.meshes:
            runs.meshes[layout] = make_layout(layout)
    return [runs.meshes[layout] for layout in runs.layouts]


def _describe(mesh: Mesh) -> str:
    return ",".join(f"{name}={size}" for name, size in mesh.shape.items())


def check_meshes(runs: Runs, num_microbatches: int) -> CheckResult:
    """The step on each of ``runs.layouts`` against one device (see the module doc)."""
    started = time.perf_counter()
    layouts: Sequence[str | Mesh] = runs.layouts
    names = [layout if isinstance(layout, str) else _describe(layout) for layout in layouts]
    compared = f"{'; '.join(names) or 'no layout'} vs one device"
    dtype = runs.rounding_dtype
    if not layouts:
        return CheckResult("meshes", "n/a", compared, 0.0, 0.0, "-", detail="no mesh layout given (--devices N)")
    try:
        meshes = layout_meshes(runs)
    except ValueError as refused:
        return CheckResult("meshes", "n/a", compared, 0.0, 0.0, "-", detail=str(refused))
    one = runs.step("batch", num_microbatches)
    devices = max(mesh.size for mesh in meshes)
    u = unit_roundoff(dtype)
    # an 8-bit format (FP8 quantized by each device's current amax) rounds each operand once: u itself
    allowed = u if np.dtype(dtype).itemsize == 1 else max(SUM_TOLERANCE, LAMBDA * math.sqrt(devices + 1) * u)
    exact = exact_rounding()
    fp8_rule = (
        "FP8 state bit for bit without a tensor axis (XLA's excess precision off), else within it"
        if exact
        else f"FP8 state within it (XLA may keep {np.dtype(dtype).name} results in float32: {EXACT_ROUNDING} holds it "
        "bit for bit)"
    )
    tolerance = (
        f"normwise max(2^-14, lambda sqrt(N + 1) u) = {allowed:.2g} of the gradient's norm (N devices' partial gradients "
        f"and one device's, each rounded to {np.dtype(dtype).name}, summed in float32 in another order); model state "
        f"alike; {fp8_rule}"
    )
    largest, failure = 0.0, None
    for name, mesh in zip(names, meshes, strict=True):
        got = runs.step("batch", num_microbatches, mesh=mesh)
        magnitude = {leaf: np.abs(v) for leaf, v in one.gradient.items()}
        error, leaf_errors = relative_error(got.gradient, one.gradient, magnitude)
        state_error, state_leaves = 0.0, dict[str, float]()
        model_state = to_float64(one.after.get("model_state"))
        if model_state:
            mesh_state = to_float64(got.after.get("model_state"))
            scale = {leaf: np.abs(v) for leaf, v in model_state.items()}
            state_error, state_leaves = relative_error(mesh_state, model_state, scale)
        largest = max(largest, error, state_error)
        if failure is None and max(error, state_error) > allowed:
            part, leaves = ("gradient", leaf_errors) if error >= state_error else ("model_state", state_leaves)
            leaf = max(leaves, key=leaves.__getitem__)
            failure = (f"{name}: {part}/{leaf} (relative error {leaves[leaf]:.2g})", max(error, state_error))
        if failure is None and one.after.get("fp8") is not None:
            # entry by entry, each against its own value: a leaf's norm would hide a small entry
            bound = 0.0 if exact and mesh.shape.get("tensor", 1) == 1 else allowed
            agreement = fp8_state_agreement(one.after["fp8"], got.after["fp8"], bound)
            largest = max(largest, agreement.largest)
            if not agreement.within:
                failure = (f"{name}: fp8/{agreement.leaf} (relative error {agreement.largest:.2g})", agreement.largest)
    elapsed = time.perf_counter() - started
    if failure is None:
        return CheckResult("meshes", "pass", compared, largest, allowed, tolerance, seconds=elapsed)
    where, _ = failure
    if "fp8/" in where:
        diagnosis = "the FP8 state depends on the device count: not reduced by max over the devices (pmax)"
    else:
        diagnosis = (
            "the result depends on the device count: a statistic computed over each device's own rows (a batch "
            "norm's mean, a loss normalised per device) where the whole batch's was meant"
        )
        if getattr(runs.setup, "int8", None) is not None:
            diagnosis += "; or an int8 scale taken over each device's own shard, not max-reduced (int8_meshes)"
    return CheckResult("meshes", "fail", compared, largest, allowed, tolerance, where, diagnosis, seconds=elapsed)


def layouts_for(num_devices: int, *, tensor: bool = True) -> list[str]:
    """The layouts ``leanstep verify --devices N`` checks: all data, all fsdp, and (even N) data x tensor.

    Example:
      >>> layouts_for(4)
      ['data=4', 'fsdp=4', 'data=2,tensor=2']
    """
    if num_devices < 2:
        return []
    out = [f"data={num_devices}", f"fsdp={num_devices}"]
    if tensor and num_devices % 2 == 0:
        out.append(f"data={num_devices // 2},tensor=2")
    return out
