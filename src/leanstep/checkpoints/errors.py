"""What a failed checkpoint says: :class:`CheckpointError`, and one line for a failed orbax write."""

from __future__ import annotations

import os
import re

__all__ = ["CheckpointError", "write_failure"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or no checkpoint could be restored."""


def write_failure(error: Exception) -> str:
    """One line for a failed orbax write: the OS error first, where tensorstore buried it."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    code = re.search(r"os_error_code='?(\d+)", text)
    if code is None:
        return text if len(text) <= 400 else text[:400] + "…"
    number = int(code.group(1))
    return f"[Errno {number}] {os.strerror(number)} ({text[:200]}…)"
