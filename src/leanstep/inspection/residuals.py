"""What reverse-mode autodiff saves for the backward pass: the residuals, and their bytes.

``jax.vjp`` keeps some forward-pass values alive until the backward pass. Which ones depends
on the function and on its ``jax.checkpoint`` policies (:mod:`leanstep.blocks.rematerialization`);
:func:`saved_residuals_report` lists them, with their kind and size:

.. code-block:: text

    kind          what it is                                   memory
    "argument"    an input of the function                     alive anyway
    "constant"    a closed-over array or literal               alive anyway
    "named"       a value tagged with checkpoint_name          kept by the policy
    "dot_general" a matmul result                              kept by the policy
    "other"       any other computed value (tanh, scan, ...)   kept by the policy

Equal gradients cannot show that anything was recomputed; this report can.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

__all__ = ["RESIDUAL_KINDS", "ResidualEntry", "ResidualReport", "saved_residuals_report"]

#: Residual kinds used by :class:`ResidualEntry` and :meth:`ResidualReport.count`.
RESIDUAL_KINDS: tuple[str, ...] = ("argument", "constant", "named", "dot_general", "other")
_INPUT_KINDS = frozenset({"argument", "constant"})


class ResidualEntry(NamedTuple):
    """One value saved for the backward pass.

    Attributes:
      shape: the array shape.
      dtype: the array dtype.
      nbytes: ``prod(shape) * dtype.itemsize``.
      kind: one of :data:`RESIDUAL_KINDS`: ``"argument"`` (an input of the function),
        ``"constant"`` (a closed-over array or literal), ``"named"`` (a value tagged
        with :func:`leanstep.blocks.checkpoint_name`), ``"dot_general"`` (a matmul result) or
        ``"other"`` (any other computed value, e.g. a ``tanh`` or a ``scan`` output).
      source: JAX's own description, e.g. ``"from the argument x"``,
        ``"output of dot_general from model.py:12:8 (block)"``, ``"named 'h' from ..."``.
      primitive: the producing primitive (``"tanh"``, ``"dot_general"``, ``"jit"``,
        ``"name"``), ``None`` for arguments and constants.
      name: the ``checkpoint_name`` tag for ``"named"`` entries, else ``None``.
    """

    shape: tuple[int, ...]
    dtype: Any
    nbytes: int
    kind: str
    source: str
    primitive: str | None = None
    name: str | None = None

    @property
    def description(self) -> str:
        """``source`` without the file location, e.g. ``"output of tanh"``."""
        if self.kind == "argument":
            return self.source.removeprefix("from the ")
        return self.source.split(" from ", 1)[0] if " from " in self.source else self.source


def short_dtype_name(dtype: Any) -> str:
    """The dtype's name with its kind abbreviated, as in the report tables.

    Example:
      >>> import numpy as np
      >>> short_dtype_name("bfloat16"), short_dtype_name(np.dtype("int32")), short_dtype_name("bool")
      ('bf16', 'i32', 'bool')
    """
    name = str(dtype)
    for long, short in (("bfloat", "bf"), ("float", "f"), ("uint", "u"), ("int", "i"), ("complex", "c")):
        if name.startswith(long):
            return short + name[len(long) :]
    return name


@dataclasses.dataclass(frozen=True)
class ResidualReport:
    """What the autodiff of a function saves for its backward pass.

    Residuals come in two groups, reported separately:

    - **inputs** (kinds ``"argument"`` and ``"constant"``): arrays that exist anyway
      (parameters, the batch); saving them costs no extra memory, whatever the policy;
    - **activations** (all other kinds): values computed in the forward pass and kept
      alive until the backward pass: this is the memory a remat policy chooses to spend.

    .. code-block:: text

        total_bytes      = sum(e.nbytes for e in entries)
        input_bytes      = sum(e.nbytes for e in entries if e.kind in {"argument", "constant"})
        activation_bytes = total_bytes - input_bytes

    Attributes:
      entries: the saved values, in JAX's order (constants, arguments, then computed
        values in program order).
    """

    entries: tuple[ResidualEntry, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes of all saved values."""
        return sum(e.nbytes for e in self.entries)

    @property
    def input_bytes(self) -> int:
        """Bytes of saved arguments and constants (alive anyway)."""
        return sum(e.nbytes for e in self.entries if e.kind in _INPUT_KINDS)

    @property
    def activation_bytes(self) -> int:
        """Bytes of computed values kept alive for the backward pass."""
        return self.total_bytes - self.input_bytes

    def count(self, kind: str) -> int:
        """Number of saved values of ``kind`` (one of :data:`RESIDUAL_KINDS`)."""
        return len(self.of_kind(kind))

    def of_kind(self, kind: str) -> tuple[ResidualEntry, ...]:
        """The saved values of ``kind`` (one of :data:`RESIDUAL_KINDS`).

        Raises:
          ValueError: ``kind`` is not in :data:`RESIDUAL_KINDS`.
        """
        if kind not in RESIDUAL_KINDS:
            raise ValueError(f"unknown kind={kind!r}; expected one of {RESIDUAL_KINDS}")
        return tuple(e for e in self.entries if e.kind == kind)

    def __str__(self) -> str:
        rows = [
            (e.kind, f"{short_dtype_name(e.dtype)}[{','.join(map(str, e.shape))}]", f"{e.nbytes:,}", e.description)
            for e in self.entries
        ]
        header = ("kind", "value", "bytes", "source")
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(3)]

        def line(r: tuple[str, str, str, str]) -> str:
            return f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip()

        n_in = sum(e.kind in _INPUT_KINDS for e in self.entries)
        n_act = len(self.entries) - n_in
        return "\n".join(
            [
                line(header),
                *map(line, rows),
                f"inputs (saved anyway): {n_in} values, {self.input_bytes:,} bytes",
                f"activations (kept by the policy): {n_act} values, {self.activation_bytes:,} bytes",
                f"total: {len(self.entries)} values, {self.total_bytes:,} bytes",
            ]
        )


def _jax_saved_residuals() -> Callable[..., list[tuple[Any, str]]]:
    # The one place that touches JAX internals: public JAX only offers the printing
    # variant, jax.ad_checkpoint.print_saved_residuals.
    try:
        from jax._src.ad_checkpoint import saved_residuals
    except ImportError as err:  # pragma: no cover - depends on the installed JAX
        raise ImportError(
            "saved_residuals_report needs jax._src.ad_checkpoint.saved_residuals, which jax "
            f"{jax.__version__} does not provide; use jax.ad_checkpoint.print_saved_residuals"
        ) from err
    return saved_residuals


_ARGUMENT = re.compile(r"from the argument (?P<arg>.*)")
_NAMED = re.compile(r"named '(?P<name>.*?)' from .*", re.DOTALL)
_JITTED = re.compile(r"output of jitted function '.*' from .*", re.DOTALL)
_OUTPUT = re.compile(r"output of (?P<prim>\S+) from .*", re.DOTALL)


def _classify(source: str) -> tuple[str, str | None, str | None]:
    """Map JAX's description to ``(kind, primitive, name)``."""
    if _ARGUMENT.fullmatch(source):
        return "argument", None, None
    if source in ("from a constant", "from a literal"):
        return "constant", None, None
    if m := _NAMED.fullmatch(source):
        return "named", "name", m["name"]
    if _JITTED.fullmatch(source):
        return "other", "jit", None
    if m := _OUTPUT.fullmatch(source):
        return ("dot_general" if m["prim"] == "dot_general" else "other"), m["prim"], None
    return "other", None, None


def saved_residuals_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> ResidualReport:
    """Report the values that ``jax.vjp(fn, *args, **kwargs)`` saves for the backward pass.

    .. code-block:: text

        for (aval, source) in jax._src.ad_checkpoint.saved_residuals(fn, *args, **kwargs):
            entry = (aval.shape, aval.dtype, prod(aval.shape) * aval.dtype.itemsize,
                     kind(source), source)

    ``fn`` is traced, not run. All arguments are differentiated, so pass arrays (or
    pytrees of arrays); bind static settings with ``functools.partial``. Pass the
    un-jitted function: inside a ``jax.jit`` the residuals are only reported as
    ``"output of jitted function ..."``. Inside a ``lax.scan`` they are stacked over
    the iterations and reported as ``"output of scan"`` (kind ``"other"``).

    Byte counts add up the values as JAX lists them. XLA may let two listed values
    share a buffer (a ``checkpoint_name`` tag is an identity, so without remat both
    ``tanh(z)`` and its tagged copy are listed), so read the totals as an upper bound
    on the memory the residuals occupy, and compare them across policies.

    Args:
      fn: the function, typically :func:`leanstep.blocks.remat` ``(block, policy)`` or ``block`` itself.
      *args: positional arguments for ``fn``.
      **kwargs: keyword arguments for ``fn``.

    Returns:
      A :class:`ResidualReport`; ``str(report)`` is a readable table.

    Raises:
      ImportError: the installed JAX no longer has the private helper this relies on.

    Example:
      >>> import jax.numpy as jnp
      >>> from leanstep.blocks.rematerialization import remat
      >>> def block(p, x):
      ...     h = jnp.tanh(x @ p["w1"] + p["b1"][None, :])
      ...     return x + h @ p["w2"] + p["b2"][None, :]
      >>> p = {"w1": jnp.ones((2, 3)), "b1": jnp.ones(3),
      ...      "w2": jnp.ones((3, 2)), "b2": jnp.ones(2)}
      >>> x = jnp.ones((4, 2))
      >>> print(saved_residuals_report(remat(block, "dots"), p, x))
      kind         value     bytes  source
      argument     f32[3]       12  argument p['b1']
      argument     f32[2,3]     24  argument p['w1']
      argument     f32[3,2]     24  argument p['w2']
      argument     f32[4,2]     32  argument x
      dot_general  f32[4,3]     48  output of dot_general
      inputs (saved anyway): 4 values, 92 bytes
      activations (kept by the policy): 1 values, 48 bytes
      total: 5 values, 140 bytes
      >>> saved_residuals_report(block, p, x).activation_bytes  # tanh and 1 - tanh
      96
    """
    entries = []
    for aval, source in _jax_saved_residuals()(fn, *args, **kwargs):
        shape, dtype = tuple(getattr(aval, "shape", ())), getattr(aval, "dtype", None)
        kind, primitive, name = _classify(source)
        nbytes = math.prod(shape) * getattr(dtype, "itemsize", 0)
        entries.append(ResidualEntry(shape, dtype, nbytes, kind, source, primitive, name))
    return ResidualReport(tuple(entries))
