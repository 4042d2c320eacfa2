"""Memory sizes as people write them (``"512MiB"``, ``"1.5GB"``) and as tables show them."""

from __future__ import annotations

import decimal
import re

import numpy as np

__all__ = ["format_bytes", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """Parses a memory size: ``"512MiB"``, ``"2GiB"``, ``"1.5GB"``, ``"1000000"`` (bytes).

    KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000; case is ignored.

    Raises:
      ValueError: not a size, an unknown unit, not a whole number of bytes, or not positive.

    Example:
      >>> parse_bytes("512MiB"), parse_bytes("1.5GB"), parse_bytes("1000000")
      (536870912, 1500000000, 1000000)
    """
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        value = decimal.Decimal(int(text))
    elif isinstance(text, str) and (m := _SIZE.fullmatch(text)) and m[2].lower() in _UNITS:
        value = decimal.Decimal(m[1]) * _UNITS[m[2].lower()]
    else:
        raise ValueError(
            f"memory size {text!r} is not a size; expected e.g. 512MiB, 2GiB, 1.5GB or a "
            f"number of bytes (units: {', '.join(u for u in _UNITS if u)}; KiB = 1024 B)"
        )
    if value != value.to_integral_value():
        raise ValueError(f"memory size {text!r} is {value} bytes, not a whole number of bytes")
    if value <= 0:
        raise ValueError(f"memory size {text!r} must be positive")
    return int(value)


def format_bytes(n: float | None) -> str:
    """``1536 -> '1.5 KiB'``; None -> ``'-'``."""
    if n is None:
        return "-"
    value, unit = float(n), "B"
    for larger in ("KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
