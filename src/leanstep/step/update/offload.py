r"""The optimizer state kept in host memory (``pinned_host``), brought to the device a chunk at a time.

:func:`offload_opt_state` places every array of a state's optimizer state that is not a scalar
(the moments: float32, bfloat16 or 8-bit with their scales) in the host memory of the device
that holds it: the same sharding, memory kind ``pinned_host``. The step then keeps it there: each
leaf's place is part of its type under ``jax.jit`` (``float32<host>[...]``), so the step follows
the state as given and no setting travels beside it.

.. code-block:: text

    chunked update (leanstep.step.update.chunks)      whole-tree update (update_chunk=None)
    for each chunk:                                   state -> device       (all of it)
        its state -> device                           params', state' = optimizer(...)
        params', its state' = optimizer(...)          state' -> host
        its state' -> host                            (as MaxText's optimizer_memory_host_offload)

A leaf cut in blocks of rows (a stack of layers) moves block by block inside the chunk's loop: a
dynamic slice of the host buffer comes to the device, and its update goes back by a dynamic
update slice into the host buffer, so at most one chunk of the state is on the device at once.
The values are those of the state kept on the device, bit for bit: moving a buffer changes no
bit. With ``update_chunk="auto"`` an offloaded state is chunked whenever the optimizer allows it
(a float32 state too: its moments are what is moved).

XLA:TPU and XLA:GPU place and move the buffers; XLA:CPU (JAX 0.10) compiles the same program,
marks the host buffers ``S(5)`` in its entry layout and runs it, but keeps them in the one memory
it has: its ``memory_analysis()`` reports no host bytes (:mod:`leanstep.inspection.memory_spaces`
reads the program's spaces and transfers instead).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

__all__ = [
    "HOST_MEMORY_KIND",
    "back_like",
    "is_offloaded",
    "offload_opt_state",
    "offloaded_rows",
    "on_device",
    "placeholders",
]

#: The memory kind an offloaded state lives in.
HOST_MEMORY_KIND = "pinned_host"


def _on_host(x: Any) -> bool:
    space = getattr(jax.typeof(x), "memory_space", None) if hasattr(x, "dtype") else None
    return space == jax.memory.Space.Host


def is_offloaded(tree: Any) -> bool:
    """Whether any leaf of ``tree`` lives in host memory (an array, a tracer or a ``ShapeDtypeStruct``)."""
    return any(_on_host(x) for x in jax.tree.leaves(tree))


def on_device(tree: Any) -> Any:
    """``tree`` with its host-memory leaves moved to the device, in one transfer; the others as they are."""
    leaves, treedef = jax.tree.flatten(tree)
    moving = [i for i, x in enumerate(leaves) if _on_host(x)]
    return jax.tree.unflatten(treedef, _put(leaves, moving, jax.memory.Space.Device)) if moving else tree


def back_like(new: Any, old: Any) -> Any:
    """``new`` with each leaf moved to host memory where the leaf of ``old`` in its place lives
    there (and is not there yet), in one transfer."""
    leaves, treedef = jax.tree.flatten(new)
    olds = treedef.flatten_up_to(old)  # type: ignore[attr-defined]  # jaxlib's PyTreeDef
    moving = [i for i, (x, o) in enumerate(zip(leaves, olds)) if _on_host(o) and not _on_host(x)]
    return jax.tree.unflatten(treedef, _put(leaves, moving, jax.memory.Space.Host)) if moving else new


def _put(leaves: list[Any], indices: list[int], space: Any) -> list[Any]:
    """``leaves`` with those at ``indices`` moved to memory ``space``, in one transfer."""
    moved = dict(zip(indices, jax.device_put([leaves[i] for i in indices], space)))
    return [moved.get(i, x) for i, x in enumerate(leaves)]


def placeholders(tree: Any) -> Any:
    """``tree`` with each host leaf replaced by zeros on the device: what the chunked update passes
    the optimizer for the leaves a chunk does not own (their results are dead code, removed by
    XLA; host values there would mix memory spaces, which JAX refuses)."""
    return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.result_type(x)) if _on_host(x) else x, tree)


def offloaded_rows(kept: dict[int, Any]) -> dict[int, Any]:
    """A stack's ``index -> (param, state, error)`` as the chunked update's loop moves it: a leaf of
    at most two dimensions (a stack of vectors: norms, biases) comes to the device whole before the
    loop, in one transfer, since XLA:TPU cannot write a block of its rows into host memory (they
    are its tiled sublane axis; its compiler aborts, seen on a v5e); the others stay where they are
    and move block by block."""
    vectors = on_device({i: leaf for i, leaf in kept.items() if jnp.ndim(leaf[0]) <= 2})
    return {i: vectors.get(i, leaf) for i, leaf in kept.items()}


def _host_sharding(x: Any) -> Any:
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        sharding = SingleDeviceSharding(jax.devices()[0])
    device = next(iter(sharding.device_set))
    kinds = [memory.kind for memory in device.addressable_memories()]
    if HOST_MEMORY_KIND not in kinds:
        raise ValueError(
            f"offload_opt_state needs a device with {HOST_MEMORY_KIND!r} memory; {device.platform} device "
            f"{device.id} has {kinds}: keep the state on the device (do not offload it)"
        )
    return sharding.with_memory_kind(HOST_MEMORY_KIND)


def offload_opt_state(state: Any) -> Any:
    """``state`` (a :class:`leanstep.TrainState`) with its optimizer state's arrays, scalars
    excepted, in the host memory (``pinned_host``) of the devices holding them, laid out as before.

    The train step keeps them there and brings a chunk at a time to the device (see the module
    doc). The state must hold arrays: JAX 0.10 traces a ``jax.ShapeDtypeStruct`` whose sharding
    is in host memory as a device array (the compiled layout says host, the program moves
    nothing), so an abstract state is refused.

    Raises:
      TypeError: ``state`` is not a TrainState, or holds ``jax.ShapeDtypeStruct`` s.
      ValueError: the device has no ``pinned_host`` memory; or 8-bit moments on a TPU
        (:func:`_refused_on_platform`).

    Example:
      >>> import jax.numpy as jnp, optax, leanstep
      >>> state = leanstep.TrainState.create({"w": jnp.zeros((4, 2))}, optax.adam(1e-3))
      >>> offloaded = offload_opt_state(state)
      >>> offloaded.opt_state[0].mu["w"].sharding.memory_kind, offloaded.opt_state[0].count.sharding.memory_kind
      ('pinned_host', 'device')
      >>> is_offloaded(offloaded.opt_state), is_offloaded(offloaded.params)
      (True, False)
    """
    if not hasattr(state, "opt_state") or not hasattr(state, "replace"):
        raise TypeError(f"offload_opt_state takes a leanstep.TrainState, got {type(state).__name__}")

    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state.opt_state)):
        raise TypeError(
            "offload_opt_state takes a state of arrays, got jax.ShapeDtypeStructs in state.opt_state: JAX traces "
            "an abstract array in host memory as one on the device; build the state (jax.jit(make)(key) places it "
            "without a copy on the host)"
        )

    refusal = _refused_on_platform(state.opt_state)
    if refusal:
        raise ValueError(refusal)

    def place(x: Any) -> Any:
        return x if jnp.ndim(x) == 0 else jax.device_put(x, _host_sharding(x))

    # Every array committed to where it is, as the step's outputs are: a state of uncommitted
    # device arrays beside committed host ones compiles the step a second time on its second call.
    state = jax.tree.map(lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) else x, state)
    return state.replace(opt_state=jax.tree.map(place, state.opt_state))


def _refused_on_platform(opt_state: Any, platform: str | None = None) -> str:
    """Why an offloaded ``opt_state`` would not compile on ``platform`` (default: that of its
    arrays' devices); ``""`` where nothing is known to stop it.

    8-bit moments (``uint8`` codes) in host memory do not compile on a TPU: XLA:TPU tiles a
    ``uint8`` array ``(32, 128)`` on the device and ``(8, 128)`` in host memory, and its copy
    between them fails ("Source and destination buffers in CopyDone arguments need to be the same
    shape"; a v5e, JAX 0.10.2, 2026-12-06, ``benchmarks/tpu_offload.py``).

    Example:
      >>> import jax.numpy as jnp
      >>> _refused_on_platform({"codes": jnp.zeros((4, 256), jnp.uint8)}, "tpu")[:40]
      'offload_opt_state: 8-bit moments (uint8 '
      >>> _refused_on_platform({"codes": jnp.zeros((4, 256), jnp.uint8)}, "cpu")
      ''
    """
    leaves = [x for x in jax.tree.leaves(opt_state) if jnp.ndim(x) > 0]
    if not any(jnp.result_type(x) == jnp.uint8 for x in leaves):
        return ""
    if platform is None:
        devices: set[Any] = {d for x in leaves if isinstance(x, jax.Array) for d in x.sharding.device_set}
        platforms = {d.platform for d in devices} or {jax.default_backend()}
    else:
        platforms = {platform}
    if "tpu" not in platforms:
        return ""
    return (
        "offload_opt_state: 8-bit moments (uint8 codes) in host memory do not compile on a TPU (XLA:TPU tiles "
        "uint8 differently on the device and in host memory, and its copy between them fails); on a TPU "
        "offload a state with moments='bfloat16' or 'float32', or keep 8-bit moments on the device"
    )
