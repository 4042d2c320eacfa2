"""Whether a run's state fits in the memory the process may use, asked before it is made.

A state too big for the host does not fail cleanly: XLA's allocation fails on one of its
threads and the process sleeps, or the kernel kills it. So :func:`train` compares the state's
size (from shapes alone) with the host's memory and the process's address-space limit
(``ulimit -v``) first, and refuses a model that cannot fit, naming the flags that size it.
"""

from __future__ import annotations

import os
import resource
from typing import Any

import jax

from leanstep.training.loop_state import RunStopped

__all__ = ["check_state_fits", "host_memory_bytes"]

# The state (params, optimizer moments) plus the gradients and one more params-sized buffer
# the step holds beside it, as a lower bound of what a step needs.
_PARAMS_COPIES = 2


def _mapped_bytes() -> int:
    """The address space this process already maps (VmSize), 0 where /proc does not say."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def host_memory_bytes() -> int | None:
    """What this process may still allocate on the host: the smaller of physical memory and what
    ``RLIMIT_AS`` leaves beyond the address space already mapped; None if neither is known."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(max(0, soft - _mapped_bytes()))
    return min(limits) if limits else None


def _tree_bytes(tree: Any) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def check_state_fits(run: Any) -> None:
    """Refuses (RunStopped, exit 1) a run whose state cannot fit in host memory.

    Only on the CPU backend, where the state lives in host memory; an accelerator's own limit
    is XLA's to report (a RESOURCE_EXHAUSTED error, one line from the CLI).
    """
    if jax.default_backend() != "cpu":
        return
    available = host_memory_bytes()
    if available is None:
        return
    shapes = run.abstract_state()
    needed = _tree_bytes(shapes) + _PARAMS_COPIES * _tree_bytes(shapes.params)
    if needed > available:
        params = sum(int(x.size) for x in jax.tree.leaves(shapes.params))
        raise RunStopped(
            f"the model's {params:,} parameters need at least {needed / 2**30:,.1f} GiB for the "
            f"training state, more than the {available / 2**30:,.1f} GiB of host memory this process "
            "may use (physical memory, ulimit -v); choose a smaller --d-model, --d-ff or --layers",
            1,
        )
