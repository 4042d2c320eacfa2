"""The plan's note when a state fits only if it is made in one program (issue 59).

Made eagerly, ``params = init(key)`` and then ``TrainState.create(params, ...)``, the parameters
stay alive in the caller's variable through the first step, beside the state the step was
planned for: the run's peak is the step's plus the parameters' bytes. A plan whose chosen
step fits the budget but not with them says so, and names the way that fits,
:meth:`leanstep.TrainState.create_from`, whose one program leaves the state alone (``leanstep
train`` makes its state so).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from leanstep.common.memory_sizes import format_bytes

__all__ = ["eager_state_notes"]


def eager_state_notes(params: Any, peak_bytes: int | None, budget: int) -> tuple[str, ...]:
    """The note when ``peak_bytes`` fits ``budget`` but ``peak_bytes`` plus the bytes of ``params`` does not.

    Args:
      params: the parameters the plan was given (arrays or ``jax.ShapeDtypeStruct``), as the caller
        holds them when it makes the state eagerly.
      peak_bytes: the chosen step's compiled peak (None: not compiled, no note).
      budget: the plan's budget, in bytes.

    Example:
      >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), np.float32)}
      >>> print(eager_state_notes(params, 10 * 2**20, 12 * 2**20)[0])
      the step fits with the state made in one program (TrainState.create_from(init, ...), as leanstep train makes it); made eagerly (params = init(key), then TrainState.create(params, ...)), the 4.0 MiB of parameters held beside the state take the step to 14.0 MiB, over the budget of 12.0 MiB
      >>> eager_state_notes(params, 6 * 2**20, 12 * 2**20)
      ()
    """
    if peak_bytes is None or peak_bytes > budget:
        return ()
    held = sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
    if peak_bytes + held <= budget:
        return ()
    note = (
        "the step fits with the state made in one program (TrainState.create_from(init, ...), as leanstep train "
        f"makes it); made eagerly (params = init(key), then TrainState.create(params, ...)), the {format_bytes(held)} "
        f"of parameters held beside the state take the step to {format_bytes(peak_bytes + held)}, over the budget of "
        f"{format_bytes(budget)}"
    )
    return (note,)
