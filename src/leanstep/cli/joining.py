"""Waiting for the other processes of a multi-process run: said, bounded, and stoppable.

``jax.distributed.initialize`` waits in C++ for every process to join. While it waits, Python's
signal handlers cannot run (a handler runs only when the interpreter next gets control), so in 0.11
``leanstep train --num-processes 2 --process-id 0`` without a second process said nothing, ignored
SIGTERM and Ctrl-C, and after two minutes JAX's own timeout aborted the process with a native stack
dump (exit 134). Here the wait is announced in one line; SIGINT and SIGTERM reach a watcher thread
through Python's signal wakeup fd (the C-level handler writes the signal's number there from
whichever thread the kernel picked, jaxlib's included) and it ends the process at once with one
line; and at the deadline the watcher ends it with one line naming the flags, exit 2, before JAX's
own timeout (set later) could abort it. Nothing has been written yet, so nothing is lost.
"""

from __future__ import annotations

import hashlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["check_same_out", "join_processes"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def join_processes(join: Callable[[], None], *, timeout_s: float, waiting: str, timed_out: str, prefix: str) -> None:
    """Calls ``join()`` (which waits for the other processes) with a line ``waiting`` first; a
    SIGINT or SIGTERM meanwhile ends the process (exit 130 or 143), and so does ``timeout_s``
    without a return (the line ``timed_out``, exit 2). Each line starts with ``prefix``."""
    say = lambda line: os.write(2, f"{prefix}: {line}\n".encode())
    say(waiting)
    if threading.current_thread() is not threading.main_thread():
        join()  # the signals are not ours to handle
        return
    # Whichever thread the kernel gives a signal to (jaxlib's threads included), Python's C-level
    # handler writes its number to the wakeup fd: the watcher reads it there.
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    pending: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: pending.append(signum)) for sig in _SIGNALS}
    previous_fd = signal.set_wakeup_fd(write_end)
    done = threading.Event()
    watcher = threading.Thread(
        target=_watch, args=(done, read_end, time.monotonic() + timeout_s, timed_out, say), daemon=True
    )
    watcher.start()
    try:
        join()
    finally:
        done.set()
        watcher.join()
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.close(read_end)
        os.close(write_end)
    for signum in pending:  # came as the join returned: to the handlers the process has
        os.kill(os.getpid(), signum)


def _watch(done: threading.Event, read_end: int, deadline: float, timed_out: str, say: Callable[[str], object]) -> None:
    while not done.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            say(timed_out)
            os._exit(2)
        ready, _, _ = select.select([read_end], [], [], min(left, 0.2))
        if not ready or done.is_set():
            continue
        signum = os.read(read_end, 1)[0]
        if signum not in _SIGNALS:
            continue
        name = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
        say(f"{name} while waiting for the other processes; nothing was written")
        os._exit(128 + signum)


def check_same_out(out: str | os.PathLike[str], process_id: int, num_processes: int) -> None:
    """Raises unless every process of the run names the same run folder (process 0 writes the
    checkpoints there, and every process waits for it: with folders of their own, 0.11 waited ten
    minutes for orbax's timeout). One gather of a 32-byte digest of the absolute path."""
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    from leanstep.cli.jsontree import InputError

    path = str(Path(out).expanduser().absolute())
    digest = np.frombuffer(hashlib.sha256(path.encode()).digest(), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(jnp.asarray(digest)))
    differ = sorted({i for i in range(num_processes) if not np.array_equal(every[i], every[0])})
    if differ:
        raise InputError(
            f"--out must name the same folder in every process (process 0 writes the checkpoints there): "
            f"process {process_id} has {path!r}, and process(es) {differ} name another than process 0's"
        )
