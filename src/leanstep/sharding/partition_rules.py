r"""Partition rules: which mesh axis splits which dimension of each parameter.

A rule maps a parameter *path* (``"blocks/qkv_w"``: the pytree keys joined by ``/``) to one
entry per dimension, each a **role** rather than a mesh axis name, so one set of rules serves
every mesh:

* ``"fsdp"``: the dimension is split over the mesh's FSDP axis (ZeRO-3: gathered just
  before use, the gradient reduce-scattered back);
* ``"tensor"``: split over the tensor axis (column- or row-parallel matmuls, kept split in
  the computation);
* ``None``: whole; a tuple of roles splits one dimension over several axes.

A role whose axis the mesh does not have (or of size 1) means ``None``. The first rule whose
pattern matches (``re.search``) decides; a parameter no rule matches is split over the FSDP
axis along its largest dimension divisible by the axis size (the fallback: replicated where
none divides), like MaxText's logical-axis rules with a default. A rule that names a
dimension the parameter does not have, or whose axis size does not divide it, is an error
naming both: a rule is honoured or refused, never silently dropped.

.. code-block:: python

    rules = (("embed", ("fsdp", None)),                   # (vocab, d): vocab split
             ("blocks/qkv_w", (None, "fsdp", "tensor")),  # (layers, d, 3d): column parallel
             ("blocks/out_w", (None, "tensor", "fsdp")))  # (layers, f, d): row parallel
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

__all__ = ["MeshAxes", "PartitionRules", "check_rules", "fallback_spec", "make_spec", "param_path", "param_specs"]

ROLES = ("fsdp", "tensor")
PartitionRules = tuple[tuple[str, tuple[Any, ...]], ...]


def make_spec(entries: Iterable[Any], keep: Any = None, drop: Any = ()) -> PartitionSpec:
    """A :class:`PartitionSpec` of ``entries`` (an axis name, a tuple of them or None per
    dimension), naming only axes in ``keep`` (None: any) and none in ``drop``, in XLA's
    canonical form: a one-name tuple as the name, no trailing Nones (a spec that differed only
    in those would make the next step's inputs look resharded, and recompile).

    Example:
      >>> make_spec([("data", "fsdp"), "tensor", None], drop={"fsdp"})
      P('data', 'tensor')
    """
    out = []
    for entry in entries:
        names = tuple(
            a
            for a in (entry if isinstance(entry, tuple) else (entry,))
            if a is not None and (keep is None or a in keep) and a not in drop
        )
        out.append(None if not names else names[0] if len(names) == 1 else names)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def param_path(path: Sequence[Any]) -> str:
    """A pytree key path as the rules see it: keys joined by ``/`` (``"blocks/qkv_w"``)."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The roles of a mesh's axes.

    Attributes:
      mesh: the device mesh.
      replica: data-parallel axes: batch rows split, parameters replicated.
      fsdp: the axis parameters are split over (batch rows too), or None.
      tensor: the tensor-parallel axis (batch rows whole), or None.
    """

    mesh: Mesh
    replica: tuple[str, ...]
    fsdp: str | None
    tensor: str | None

    @property
    def batch(self) -> tuple[str, ...]:
        """Every axis the batch rows are split over, in mesh order."""
        return tuple(a for a in self.mesh.axis_names if a in self.replica or a == self.fsdp)

    def rows(self, dim: int = 0) -> PartitionSpec:
        """Dimension ``dim`` (the rows) split over the batch axes, every other dimension whole."""
        return make_spec([None] * dim + [self.batch])

    def size(self, axes: Sequence[str]) -> int:
        """The number of devices along ``axes`` together."""
        return math.prod(int(self.mesh.shape[a]) for a in axes)

    def axis_of(self, role: str) -> str | None:
        """The mesh axis playing ``role`` ("fsdp" or "tensor"), None if absent or of size 1."""
        axis = {"fsdp": self.fsdp, "tensor": self.tensor}[role]
        return axis if axis is not None and int(self.mesh.shape[axis]) > 1 else None


def check_rules(rules: Any) -> PartitionRules:
    """Validates ``rules``: a sequence of ``(pattern, roles)`` pairs; returns them as a tuple.

    Raises:
      TypeError: not a sequence of pairs, a pattern not a string, roles not a sequence.
      ValueError: a pattern that is not a regular expression, or a role other than
        "fsdp", "tensor", None or a tuple of those.
    """
    if rules is None:
        return ()
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise TypeError(f"rules must be a sequence of (pattern, roles) pairs, got {type(rules).__name__}")
    checked = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, Sequence) and len(rule) == 2 and isinstance(rule[0], str)):
            raise TypeError(f"rules[{i}] must be a (pattern: str, roles: tuple) pair, got {rule!r}")
        pattern, roles = rule
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"rules[{i}] pattern {pattern!r} is not a regular expression: {error}") from None
        if isinstance(roles, (str, bytes)) or not isinstance(roles, Sequence):
            raise TypeError(f"rules[{i}] roles must be a tuple with one entry per dimension, got {roles!r}")
        for role in roles:
            for r in role if isinstance(role, tuple) else (role,):
                if r is not None and r not in ROLES:
                    raise ValueError(
                        f"rules[{i}] ({pattern!r}) has role {r!r}; roles are 'fsdp', 'tensor', None or a tuple of them"
                    )
        checked.append((pattern, tuple(roles)))
    return tuple(checked)


def fallback_spec(shape: tuple[int, ...], axis: str | None, size: int) -> tuple[Any, ...]:
    """The spec entries of the fallback: the largest dimension divisible by ``size`` on ``axis``
    (the earliest on ties); ``()`` (whole) where none divides."""
    candidates = [(n, -d) for d, n in enumerate(shape) if n >= size and n % size == 0]
    if axis is None or size <= 1 or not candidates:
        return ()
    _, neg = max(candidates)
    return (None,) * -neg + (axis,)


def _leaf_spec(path: str, shape: tuple[int, ...], rules: PartitionRules, axes: MeshAxes) -> PartitionSpec:
    fsdp = axes.axis_of("fsdp")
    for pattern, roles in rules:
        if not re.search(pattern, path):
            continue
        if len(roles) > len(shape):
            raise ValueError(
                f"partition rule {pattern!r} names {len(roles)} dimensions but parameter {path!r} has shape {shape}"
            )
        entries = []
        for dim, role in enumerate(roles):
            names = tuple(
                a
                for a in (axes.axis_of(r) for r in (role if isinstance(role, tuple) else (role,)) if r is not None)
                if a is not None
            )
            if names and shape[dim] % axes.size(names):
                raise ValueError(
                    f"partition rule {pattern!r} splits dimension {dim} of parameter {path!r} (size "
                    f"{shape[dim]}) over mesh axes {names} of {axes.size(names)} devices, which does "
                    "not divide it"
                )
            entries.append(names)
        break
    else:
        entries = list(fallback_spec(shape, fsdp, int(axes.mesh.shape[fsdp]) if fsdp else 1))
    return make_spec(entries)


def param_specs(params: Any, axes: MeshAxes, rules: Any = None) -> Any:
    """The :class:`PartitionSpec` of every parameter leaf (concrete or abstract).

    Args:
      params: a pytree of arrays or ``jax.ShapeDtypeStruct``.
      axes: the mesh's roles.
      rules: partition rules (see the module doc); None: the fallback for every leaf.

    Returns:
      A pytree of the structure of ``params`` with one ``PartitionSpec`` per leaf.

    Raises:
      ValueError, TypeError: malformed rules, or a rule that does not fit a parameter.

    Example:
      >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
      >>> axes = MeshAxes(mesh, replica=(), fsdp="fsdp", tensor="tensor")
      >>> param_specs({"w": np.zeros((4, 8))}, axes, rules=(("w", ("fsdp", "tensor")),))
      {'w': P()}
    """
    rules = check_rules(rules)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _leaf_spec(param_path(path), tuple(np.shape(leaf)), rules, axes), params
    )
