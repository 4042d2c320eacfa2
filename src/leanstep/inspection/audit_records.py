"""The records an audit is made of: one per scan, remat region, matmul and host sync.

Plain frozen dataclasses that import nothing of the package, so that every module can use them:
:func:`leanstep.inspection.audit` fills them in while it walks a traced program, and
:class:`leanstep.inspection.AuditReport` holds and checks them.
"""

from __future__ import annotations

import dataclasses

__all__ = ["HostSync", "Matmul", "RematRegion", "ScanInfo"]


@dataclasses.dataclass(frozen=True)
class ScanInfo:
    """One ``lax.scan`` in the program.

    Attributes:
      length: the trip count.
      reverse: runs back to front; a transposed (backward-pass) scan does.
      depth: number of scans around this one (0: top level).
      path: the enclosing primitives, e.g. ``"jit(step)/scan"``.
      carry: ``(shape, dtype name)`` of every carried value.
      matmuls: dot_generals in its body, nested ones included (counted once each).
      in_update: it runs in the optimizer's update (under leanstep's optimizer scope), so it is
        the optimizer's own loop (an 8-bit codec's search, a chunked update), not the microbatch loop.
    """

    length: int
    reverse: bool
    depth: int
    path: str
    carry: tuple[tuple[tuple[int, ...], str], ...]
    matmuls: int
    in_update: bool = False


@dataclasses.dataclass(frozen=True)
class RematRegion:
    """One ``jax.checkpoint`` region (primitive ``remat2``).

    Attributes:
      policy: the leanstep name of its policy (``"dots"``, ``"full"``,
        ``"dots_no_batch"``, ``"save:a,b"``), else the policy's repr.
      differentiated: the region belongs to the backward pass; what it computes
        besides the cotangents is recomputed forward work.
      prevent_cse: the ``prevent_cse`` flag.
      path: the enclosing primitives.
      primitives: the primitive names inside, sorted.
    """

    policy: str
    differentiated: bool
    prevent_cse: bool
    path: str
    primitives: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One ``dot_general`` or ``conv_general_dilated`` (a convolution: ``kind``).

    Attributes:
      lhs, rhs: operand ``(shape, dtype name)``.
      preferred: ``preferred_element_type`` (the accumulation dtype), or the output dtype.
      out: the output dtype name.
      scan_depth: number of enclosing scans (0: outside any scan).
      path: the enclosing primitives.
      flops: ``2 * prod(out shape) * prod(contracted sizes)`` (a convolution: its kernel
        window times its input features), times the trip counts around it.
      kind: the primitive, ``"dot_general"`` or ``"conv_general_dilated"``.
      scale: for an FP8 matmul (:func:`leanstep.blocks.fp8_dot_general`), the scaling that quantized
        its operands, ``"delayed"`` or ``"current"`` (their dtypes are then the FP8 formats they
        carry, ``float8_e4m3fn`` and ``float8_e5m2``); else ``""``.
      in_update: it runs in the optimizer's update (Muon's Newton-Schulz iterations), not in a
        forward or backward pass.

    Example:
      >>> m = Matmul(((2, 3), "bfloat16"), ((3, 4), "bfloat16"), "float32", "float32", 0, "top", 48.0)
      >>> m.dtypes
      ('bfloat16', 'bfloat16', 'float32')
    """

    lhs: tuple[tuple[int, ...], str]
    rhs: tuple[tuple[int, ...], str]
    preferred: str
    out: str
    scan_depth: int
    path: str
    flops: float
    kind: str = "dot_general"
    scale: str = ""
    in_update: bool = False

    @property
    def dtypes(self) -> tuple[str, str, str]:
        """``(lhs dtype, rhs dtype, accumulation dtype)``."""
        return (self.lhs[1], self.rhs[1], self.preferred)


@dataclasses.dataclass(frozen=True)
class HostSync:
    """One host callback or infeed/outfeed: the device waits for the host there.

    Attributes:
      primitive: e.g. ``"pure_callback"``.
      path: the enclosing primitives.
      callback: the Python callback's name, when there is one.
    """

    primitive: str
    path: str
    callback: str | None
