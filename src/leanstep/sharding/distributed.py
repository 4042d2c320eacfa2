"""Devices and processes for a run, set up before JAX starts its backend.

Two settings must be made before anything touches a JAX device (``jax.devices()``, the first
array, the first jitted call): the number of simulated CPU devices
(``jax_num_cpu_devices``) and, for a multi-process run, ``jax.distributed.initialize``.
:func:`configure_devices` does both, so the CLI calls it first; :func:`device_mesh` then
builds the one-dimensional data mesh over the devices it asked for.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
from jax.sharding import Mesh

from leanstep.common.checks import is_int

__all__ = ["configure_devices", "device_mesh", "parse_mesh", "run_on_simulated_cpus"]

#: Mesh axis names ``parse_mesh`` accepts (roles by name: see ``leanstep.sharding.mesh_axes``).
MESH_AXES = ("data", "fsdp", "tensor")


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,fsdp=2,tensor=2"`` as ``{"data": 2, "fsdp": 2, "tensor": 2}`` (axes in the order given).

    The first axis varies slowest over the devices, which are ordered by process: put the
    data axis first to keep FSDP and tensor traffic inside a host (hybrid sharding).

    Raises:
      ValueError: not ``name=size`` pairs of the axes data, fsdp, tensor, each at most once,
        with positive sizes.

    Example:
      >>> parse_mesh("data=2,fsdp=4")
      {'data': 2, 'fsdp': 4}
    """
    shape: dict[str, int] = {}
    for part in str(text).split(","):
        name, _, size = part.strip().partition("=")
        if name not in MESH_AXES or name in shape or not size.isdigit() or int(size) < 1 or int(size) > 2**20:
            raise ValueError(
                f"--mesh must be name=size pairs of the axes {', '.join(MESH_AXES)} (each once, sizes "
                f"1..2**20), e.g. data=2,fsdp=2,tensor=2; got {text!r}"
            )
        shape[name] = int(size)
    return shape


def run_on_simulated_cpus(code: str, *, xla_flags: str = "") -> subprocess.CompletedProcess[str]:
    """Runs Python ``code`` in a child process on the CPU platform, its output captured.

    The child is where simulated devices are made (it calls :func:`configure_devices`
    itself, before JAX starts): JAX counts them on the CPU platform only, so the child runs
    with ``JAX_PLATFORMS=cpu`` and never takes a GPU or TPU the parent may be using, nor
    plans for one device where it was asked for N. ``xla_flags`` are added to its ``XLA_FLAGS``.
    """
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env)


_ADDRESS = re.compile(r"^(?P<host>[^\s:]+|\[[0-9a-fA-F:]+\]):(?P<port>[0-9]{1,5})$")


#: Threads XLA:CPU's device pool gets per simulated device (``PJRT_NPROC``). Its default is
#: max(cores, devices): each device blocks a pool thread in a collective until every device
#: joins it, and XLA runs a device's independent collectives concurrently, so every thread can
#: be waiting while a device whose part is still queued has none: a deadlock XLA ends by
#: aborting after 40 s ("only 3 of them arrived on time"). On 2 cores, 4 devices (fsdp=2,
#: tensor=2), 4 runs at once: 1 abort in 12 runs at the default pool (in it, and in a CI run's,
#: all 4 pool threads were waiting), 0 in 16 at 4 threads a device. A waiting thread sleeps.
_POOL_THREADS_PER_DEVICE = 4


def _check_count(name: str, value: object, minimum: int) -> int:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def configure_devices(
    num_devices: int | None = None,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    initialization_timeout: int = 120,
) -> None:
    """Sets the device count and joins a multi-process run; call it before JAX touches a device.

    ``num_devices`` sets ``jax_num_cpu_devices``: on CPU each process then has that many
    (simulated) devices, and XLA:CPU's thread pool gets four threads a device
    (``PJRT_NPROC``, unless set) so that devices waiting in collectives cannot starve one
    still working; on GPU/TPU it has no effect here and :func:`device_mesh` takes the
    first ``num_devices`` local accelerators. With ``coordinator`` it calls
    ``jax.distributed.initialize`` with the gloo CPU collectives (ignored off CPU), so
    ``jax.devices()`` lists the devices of every process.

    Args:
      num_devices: devices per process; None: leave JAX's default (1 CPU device).
      coordinator: ``HOST:PORT`` of process 0's coordinator service; None: one process.
      num_processes: processes in the run (with ``coordinator``).
      process_id: this process's index, ``0 <= process_id < num_processes`` (with ``coordinator``).
      initialization_timeout: seconds to wait for every process to join.

    Raises:
      ValueError: a count is not a positive integer, ``coordinator`` is not ``HOST:PORT``,
        ``process_id`` is out of range, or only some of the three multi-process arguments
        are given.
      RuntimeError: JAX's backend is already running (too late to change devices) or the
        processes did not all join in time.

    Example:
      >>> configure_devices()  # one process, JAX's default devices: nothing to do
      >>> configure_devices(coordinator="localhost:1234")
      Traceback (most recent call last):
      ...
      ValueError: coordinator, num_processes and process_id go together; got coordinator='localhost:1234', num_processes=None, process_id=None
    """
    if num_devices is not None:
        num_devices = _check_count("num_devices", num_devices, 1)
    multi = (coordinator, num_processes, process_id)
    if any(v is not None for v in multi) and any(v is None for v in multi):
        raise ValueError(
            "coordinator, num_processes and process_id go together; got "
            f"coordinator={coordinator!r}, num_processes={num_processes!r}, process_id={process_id!r}"
        )
    if coordinator is not None:
        if (
            not isinstance(coordinator, str)
            or not _ADDRESS.match(coordinator)
            or not (0 < int(coordinator.rsplit(":", 1)[1]) < 65536)
        ):
            raise ValueError(f"coordinator must be HOST:PORT with a port in 1..65535, got {coordinator!r}")
        num_processes = _check_count("num_processes", num_processes, 1)
        process_id = _check_count("process_id", process_id, 0)
        if process_id >= num_processes:
            raise ValueError(f"process_id must be < num_processes={num_processes}, got {process_id}")
    initialization_timeout = _check_count("initialization_timeout", initialization_timeout, 1)
    if num_devices is not None:
        try:
            jax.config.update("jax_num_cpu_devices", num_devices)
        except RuntimeError as error:
            raise RuntimeError(
                f"cannot set {num_devices} devices: JAX's backend is already running ({error}); "
                "call configure_devices before any JAX array or computation is made"
            ) from None
        if num_devices > 1:  # read when the CPU backend starts (not yet: above); a value the user set is kept
            os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, _POOL_THREADS_PER_DEVICE * num_devices)))
    if coordinator is not None:
        # gloo is jaxlib 0.10's CPU default; naming it keeps a run from silently getting the
        # "none" implementation (no cross-process CPU collectives) if the default changes.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=initialization_timeout,
        )


def device_mesh(
    num_devices: int | None = None, data_axis: str = "data", *, shape: dict[str, int] | None = None
) -> Mesh:
    """A one-dimensional data mesh over the first ``num_devices`` local devices of every process.

    Args:
      num_devices: devices per process; None: all of them.
      data_axis: the name of the mesh axis.
      shape: ``{axis: size}`` for a mesh of several axes (:func:`parse_mesh`) over the chosen
        devices, in process order (the first axis slowest); its sizes must multiply to their count.

    Returns:
      ``Mesh(devices, (data_axis,))``, devices ordered by process, then id.

    Raises:
      ValueError: ``num_devices`` is not a positive integer or exceeds a process's device count.

    Example:
      >>> dict(device_mesh(1).shape)
      {'data': 1}
    """
    import math

    import numpy as np

    from leanstep.sharding.meshes import data_mesh

    def shaped(mesh: Mesh) -> Mesh:
        if shape is None:
            return mesh
        if math.prod(shape.values()) != mesh.size:
            raise ValueError(
                f"--mesh {','.join(f'{k}={v}' for k, v in shape.items())} needs "
                f"{math.prod(shape.values())} devices; the run has {mesh.size}"
            )
        return Mesh(np.asarray(mesh.devices).reshape(tuple(shape.values())), tuple(shape))

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if num_devices is not None:  # the first num_devices of each process
        num_devices = _check_count("num_devices", num_devices, 1)
        available = jax.local_device_count()
        if num_devices > available:
            raise ValueError(
                f"num_devices={num_devices} but this process has {available} {jax.default_backend()} device(s); "
                "on CPU call configure_devices(num_devices) before JAX starts"
            )
        taken: dict[int, int] = {}  # devices chosen so far, by process
        chosen = []
        for device in devices:
            if taken.get(device.process_index, 0) < num_devices:
                chosen.append(device)
                taken[device.process_index] = taken.get(device.process_index, 0) + 1
        devices = chosen
    return shaped(data_mesh(devices, data_axis))
