r"""Rematerialization: named ``jax.checkpoint`` policies and a report of what they save.

Reverse-mode autodiff keeps some forward-pass values alive (the *residuals*) so the
backward pass can use them. ``jax.checkpoint`` trades memory for compute: values its
policy does not save are recomputed from the saved ones during the backward pass.
This module names the common policies and measures what each one really saves.

.. code-block:: text

    policy              saved for the backward pass                  recomputed
    "none"              everything autodiff needs (no checkpoint)    nothing
    "full"              only the inputs of the wrapped function      the whole forward pass
    "dots"              dot_general / conv outputs                   elementwise ops (tanh, ...)
    "dots_no_batch"     dot_generals without batch dimensions        elementwise ops and
                        (x @ W, not einsum('bij,bjk->bik'))          batched matmuls
    "save:NAME1,NAME2"  only values tagged checkpoint_name(v, NAME)  everything else

For a residual MLP block :math:`y = x + \tanh(x W_1 + b_1) W_2 + b_2` with
:math:`t = \tanh(x W_1 + b_1)`:

- ``"none"`` keeps :math:`t` and :math:`1 - t` (``tanh' = (1 - t)(1 + t)``);
- ``"dots"`` keeps :math:`x W_1` and recomputes :math:`t` in the backward pass;
- ``"full"`` keeps only :math:`x, W_1, b_1, W_2` and reruns the block.

Use :func:`saved_residuals_report` to see, per policy, which values are saved and how
many bytes they take. Equal gradients cannot show that anything was recomputed; the
report (and the gradient jaxpr) can.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name

__all__ = [
    "REMAT_POLICIES", "RESIDUAL_KINDS", "ResidualEntry", "ResidualReport",
    "checkpoint_name", "get_remat_policy", "remat", "saved_residuals_report",
]

_POLICIES = jax.checkpoint_policies

#: Policy names accepted by :func:`get_remat_policy` and :func:`remat`, besides the
#: ``"save:NAME1,NAME2"`` form and a raw JAX policy callable.
REMAT_POLICIES: tuple[str, ...] = ("none", "full", "dots", "dots_no_batch")

_SAVE_PREFIX = "save:"

_NAMED_POLICIES: dict[str, Callable[..., Any]] = {
    "full": _POLICIES.nothing_saveable,
    "dots": _POLICIES.dots_saveable,
    "dots_no_batch": _POLICIES.dots_with_no_batch_dims_saveable,
}

# Factories that build a policy: passing one uncalled is always a mistake, and a
# silent one (the factory is callable and its return value is truthy).
_POLICY_FACTORIES = tuple(
    getattr(_POLICIES, name, None)
    for name in ("save_only_these_names", "save_any_names_but_these", "save_anything_except_these_names",
                 "save_from_both_policies", "offload_dot_with_no_batch_dims",
                 "save_and_offload_only_these_names")
)

#: Residual kinds used by :class:`ResidualEntry` and :meth:`ResidualReport.count`.
RESIDUAL_KINDS: tuple[str, ...] = ("argument", "constant", "named", "dot_general", "other")
_INPUT_KINDS = frozenset({"argument", "constant"})


def get_remat_policy(policy: str | Callable[..., Any]) -> Callable[..., Any] | None:
    """Resolve a policy name (or a raw JAX policy) to a ``jax.checkpoint`` policy.

    .. code-block:: text

        "none"          -> None   (meaning: do not wrap in jax.checkpoint at all)
        "full"          -> jax.checkpoint_policies.nothing_saveable
        "dots"          -> jax.checkpoint_policies.dots_saveable
        "dots_no_batch" -> jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        "save:a,b"      -> jax.checkpoint_policies.save_only_these_names("a", "b")
        callable        -> returned unchanged

    ``None`` means *no rematerialization*. Do not pass it on to
    ``jax.checkpoint(policy=None)``, which means the opposite (save nothing);
    :func:`remat` handles this for you.

    Args:
      policy: one of :data:`REMAT_POLICIES`, ``"save:"`` followed by comma-separated
        ``checkpoint_name`` tags (surrounding whitespace is stripped), or a JAX policy
        callable ``(prim, *avals, **params) -> bool``.

    Returns:
      The JAX policy callable, or ``None`` for ``"none"``.

    Raises:
      ValueError: ``policy`` is an unknown name, or ``"save:"`` without names.
      TypeError: ``policy`` is neither a string nor a callable, or is a policy
        factory such as ``save_only_these_names`` that was not called.

    Example:
      >>> get_remat_policy("dots") is jax.checkpoint_policies.dots_saveable
      True
      >>> get_remat_policy("none") is None
      True
      >>> get_remat_policy("save:attn, mlp_hidden")
      SaveOnlyTheseNames(saveable_names=frozenset({...}))
      >>> get_remat_policy("dot")
      Traceback (most recent call last):
      ...
      ValueError: unknown policy='dot'; expected one of 'none', 'full', 'dots', 'dots_no_batch', 'save:NAME1,NAME2' or a JAX policy callable
    """
    if isinstance(policy, str):
        if policy == "none":
            return None
        if policy in _NAMED_POLICIES:
            return _NAMED_POLICIES[policy]
        if policy.startswith(_SAVE_PREFIX):
            names = [name.strip() for name in policy[len(_SAVE_PREFIX):].split(",")]
            if not all(names):
                raise ValueError(f"policy={policy!r} names an empty checkpoint_name tag; "
                                 "expected 'save:NAME1,NAME2' with one or more non-empty names")
            return _POLICIES.save_only_these_names(*names)
        valid = ", ".join(repr(name) for name in (*REMAT_POLICIES, "save:NAME1,NAME2"))
        raise ValueError(f"unknown policy={policy!r}; expected one of {valid} or a JAX policy callable")
    if not callable(policy):
        raise TypeError(
            f"policy must be a policy name (str) or a JAX policy callable, got {policy!r} "
            f"of type {type(policy).__name__}; use 'none' for no remat and 'full' to save nothing"
        )
    if any(policy is factory for factory in _POLICY_FACTORIES):
        raise TypeError(
            f"policy={policy!r} is a policy factory, not a policy; call it first, e.g. "
            "jax.checkpoint_policies.save_only_these_names('name'), or pass 'save:name'"
        )
    return policy


def remat(
    fn: Callable[..., Any],
    policy: str | Callable[..., Any] = "full",
    *,
    prevent_cse: bool = True,
    static_argnums: int | tuple[int, ...] = (),
) -> Callable[..., Any]:
    """Wrap ``fn`` in ``jax.checkpoint`` with a named policy (or return it for ``"none"``).

    .. code-block:: text

        remat(fn, "none")   == fn
        remat(fn, policy)   == jax.checkpoint(fn, policy=get_remat_policy(policy),
                                              prevent_cse=prevent_cse,
                                              static_argnums=static_argnums)

    Values and gradients are those of ``fn``; only what is kept between the forward
    and the backward pass changes (see :func:`saved_residuals_report`). The policy is
    resolved and validated here, at wrap time.

    Use it as a decorator with ``functools.partial(remat, policy="dots")``. For the
    body of a ``lax.scan`` over layers pass ``prevent_cse=False``: the scan already
    keeps XLA from merging the recomputation with the forward pass, and the extra
    optimization barriers of ``prevent_cse=True`` only cost speed there (this is what
    the ``jax.checkpoint`` docs recommend).

    Args:
      fn: the function to rematerialize.
      policy: see :func:`get_remat_policy`. Default ``"full"`` (save only inputs).
      prevent_cse: forwarded to ``jax.checkpoint``; ``False`` inside ``lax.scan``.
      static_argnums: positions of arguments that are static Python values (used in
        Python control flow inside ``fn``); forwarded to ``jax.checkpoint``.

    Returns:
      The wrapped function, or ``fn`` itself for ``policy="none"``.

    Raises:
      ValueError, TypeError: bad ``policy`` (see :func:`get_remat_policy`),
        ``prevent_cse`` not a bool, or ``static_argnums`` not an int or tuple of ints.

    Example:
      >>> import functools
      >>> import jax.numpy as jnp
      >>> @functools.partial(remat, policy="dots")
      ... def block(w, x):
      ...     return x + jnp.tanh(x @ w) @ w
      >>> w, x = jnp.eye(2) * 0.5, jnp.ones((3, 2))
      >>> loss = lambda f: lambda w, x: jnp.sum(f(w, x) ** 2)
      >>> g = jax.grad(loss(block))(w, x)
      >>> g_plain = jax.grad(loss(block.__wrapped__))(w, x)
      >>> bool(jnp.allclose(g, g_plain, rtol=1e-6))
      True
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r} of type {type(fn).__name__}")
    jax_policy = get_remat_policy(policy)
    if not isinstance(prevent_cse, bool):
        raise TypeError(f"prevent_cse must be a bool, got {prevent_cse!r}")
    argnums = (static_argnums,) if isinstance(static_argnums, int) else static_argnums
    if not isinstance(argnums, tuple) or not all(type(i) is int for i in argnums):
        raise TypeError(f"static_argnums must be an int or a tuple of ints, got {static_argnums!r}")
    if jax_policy is None:
        return fn
    return jax.checkpoint(fn, policy=jax_policy, prevent_cse=prevent_cse, static_argnums=argnums)


class ResidualEntry(NamedTuple):
    """One value saved for the backward pass.

    Attributes:
      shape: the array shape.
      dtype: the array dtype.
      nbytes: ``prod(shape) * dtype.itemsize``.
      kind: one of :data:`RESIDUAL_KINDS`: ``"argument"`` (an input of the function),
        ``"constant"`` (a closed-over array or literal), ``"named"`` (a value tagged
        with :func:`checkpoint_name`), ``"dot_general"`` (a matmul result) or
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


def _short_dtype(dtype: Any) -> str:
    name = str(dtype)
    for long, short in (("bfloat", "bf"), ("float", "f"), ("uint", "u"), ("int", "i"), ("complex", "c")):
        if name.startswith(long):
            return short + name[len(long):]
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
            (e.kind, f"{_short_dtype(e.dtype)}[{','.join(map(str, e.shape))}]", f"{e.nbytes:,}", e.description)
            for e in self.entries
        ]
        header = ("kind", "value", "bytes", "source")
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(3)]

        def line(r: tuple[str, str, str, str]) -> str:
            return f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip()

        n_in = sum(e.kind in _INPUT_KINDS for e in self.entries)
        n_act = len(self.entries) - n_in
        return "\n".join([
            line(header),
            *map(line, rows),
            f"inputs (saved anyway): {n_in} values, {self.input_bytes:,} bytes",
            f"activations (kept by the policy): {n_act} values, {self.activation_bytes:,} bytes",
            f"total: {len(self.entries)} values, {self.total_bytes:,} bytes",
        ])


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
      fn: the function, typically ``remat(block, policy)`` or ``block`` itself.
      *args: positional arguments for ``fn``.
      **kwargs: keyword arguments for ``fn``.

    Returns:
      A :class:`ResidualReport`; ``str(report)`` is a readable table.

    Raises:
      ImportError: the installed JAX no longer has the private helper this relies on.

    Example:
      >>> import jax.numpy as jnp
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
