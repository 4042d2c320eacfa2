"""Stage 2, the guarded update: unscale once, decide once, clip, apply only if finite.

.. code-block:: text

    guarded.py       guarded_update, guarded_update_transform: the update's order, read top to bottom
    kept.py          the whole tree's update under one conditional: applied in full or kept
    chunks.py        the optimizer applied a chunk of the state at a time
    chunk_plan.py    whether and how a state's update is chunked, on the device or offloaded
    dependence.py    which parameters an optimizer's update reads, from its jaxpr
    offload.py       offload_opt_state: the optimizer state in host memory
    checks.py        the update's input checks
"""

from leanstep.step.update.checks import check_opt_state, spike_window
from leanstep.step.update.chunks import (
    ChunkInputs,
    assemble,
    leaf_parts,
    master_finish,
    prepare_grads,
    row_put,
    row_slice,
    run_chunk,
    splittable_rows,
    state_parts,
)
from leanstep.step.update.guarded import GuardedState, UpdateInfo, guarded_update, guarded_update_transform
from leanstep.step.update.kept import rounding_key
from leanstep.step.update.offload import is_offloaded, offload_opt_state

__all__ = [
    "ChunkInputs",
    "GuardedState",
    "UpdateInfo",
    "assemble",
    "check_opt_state",
    "guarded_update",
    "guarded_update_transform",
    "is_offloaded",
    "leaf_parts",
    "master_finish",
    "offload_opt_state",
    "prepare_grads",
    "rounding_key",
    "row_put",
    "row_slice",
    "run_chunk",
    "spike_window",
    "splittable_rows",
    "state_parts",
]
