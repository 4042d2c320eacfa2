"""The audit's walk of a jaxpr: every scan, remat region, matmul and host sync, with its path.

:func:`walk_jaxpr` visits a program and its sub-programs (scan bodies counted times their trip
counts) and records what it finds into :class:`Findings`, which :mod:`leanstep.inspection.auditing`
turns into an :class:`leanstep.inspection.AuditReport`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from leanstep.blocks.fp8_dot import fp8_scope
from leanstep.blocks.rematerialization import REMAT_POLICIES, get_remat_policy
from leanstep.common.jaxprs import (
    MATMUL_PRIMITIVES,
    OPTIMIZER_UPDATE_SCOPE,
    is_remat_primitive,
    scan_operands,
    sub_jaxprs,
)
from leanstep.inspection.audit_records import HostSync, Matmul, RematRegion, ScanInfo
from leanstep.inspection.flops import equation_flops

__all__ = ["HOST_SYNC_PRIMITIVES", "Findings", "policy_name", "walk_jaxpr"]

HOST_SYNC_PRIMITIVES: frozenset[str] = frozenset(
    {"pure_callback", "io_callback", "debug_callback", "debug_print", "callback", "infeed", "outfeed"}
)


def _aval(var: Any) -> tuple[tuple[int, ...], str]:
    aval = var.aval
    return tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", type(aval).__name__))


def policy_name(policy: Any) -> str:
    """The leanstep name of a ``jax.checkpoint`` policy (``"dots"``, ``"save:a,b"``), else its repr.

    Example:
      >>> import jax
      >>> policy_name(jax.checkpoint_policies.dots_saveable)
      'dots'
      >>> policy_name(jax.checkpoint_policies.save_only_these_names("b", "a"))
      'save:a,b'
    """
    for name in REMAT_POLICIES:
        resolved = get_remat_policy(name)
        if resolved is not None and (resolved is policy or resolved == policy):
            return name
    names = getattr(policy, "saveable_names", None)
    if names is not None:
        return "save:" + ",".join(sorted(names))
    return getattr(policy, "__name__", repr(policy))


@dataclasses.dataclass
class Findings:
    scans: list[ScanInfo] = dataclasses.field(default_factory=list)
    remats: list[RematRegion] = dataclasses.field(default_factory=list)
    matmuls: list[Matmul] = dataclasses.field(default_factory=list)
    host_syncs: list[HostSync] = dataclasses.field(default_factory=list)
    equations: int = 0


def _segment(eqn: Any) -> str:
    name, params = eqn.primitive.name, eqn.params
    if name in ("jit", "pjit") and "name" in params:
        return f"{name}({params['name']})"
    if name == "scan":
        return f"scan({params['length']})"
    if is_remat_primitive(name):
        return f"{name}({policy_name(params.get('policy'))})"
    return name


def _in_update(eqn: Any, outer: str) -> bool:
    """Whether ``eqn`` runs in the optimizer's update: under leanstep's optimizer scope, wherever
    that is in the name stacks of the equations around it (``outer``) and its own."""
    return OPTIMIZER_UPDATE_SCOPE in outer + str(eqn.source_info.name_stack)


def _matmul(eqn: Any, scan_depth: int, where: str, multiplier: float, outer: str) -> Matmul:
    """The record of a matmul equation; an FP8 one's scaling from its name scope (``outer``: the
    name stacks of the equations around it)."""
    preferred = eqn.params.get("preferred_element_type") or eqn.outvars[0].aval.dtype
    lhs, rhs = _aval(eqn.invars[0]), _aval(eqn.invars[1])
    scope = fp8_scope(outer + str(eqn.source_info.name_stack))  # the operands are FP8 arrays: their own dtypes
    flops = equation_flops(eqn) * multiplier
    kind, scale = eqn.primitive.name, "" if scope is None else scope.scaling
    out = _aval(eqn.outvars[0])[1]
    return Matmul(
        lhs, rhs, str(np.dtype(preferred)), out, scan_depth, where, flops, kind, scale, _in_update(eqn, outer)
    )


def walk_jaxpr(
    jaxpr: Any,
    path: tuple[str, ...],
    scan_depth: int,
    multiplier: float,
    names: list[set[str]],
    out: Findings,
    outer: str = "",
) -> int:
    """Visits ``jaxpr``, recording into ``out``; returns its matmul and convolution count, sub-programs included.

    ``multiplier`` is the product of the trip counts of the scans around ``jaxpr``; ``names``
    holds the primitive-name sets of the remat regions around it, each of which gets every
    primitive visited here; ``outer`` the name stacks of the equations around it.
    """
    matmuls = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        out.equations += 1
        for region in names:
            region.add(name)
        where = "/".join(path) or "top"
        if name in MATMUL_PRIMITIVES:
            matmuls += 1
            out.matmuls.append(_matmul(eqn, scan_depth, where, multiplier, outer))
        if name in HOST_SYNC_PRIMITIVES:
            callback = eqn.params.get("callback")
            func = getattr(callback, "callback_func", callback)
            out.host_syncs.append(HostSync(name, where, getattr(func, "__name__", None)))
        inner_path = (*path, _segment(eqn))
        inner = f"{outer}{eqn.source_info.name_stack}/"
        subs = list(sub_jaxprs(eqn))
        if name == "scan":
            length, before = eqn.params["length"], len(out.scans)
            body_matmuls = walk_jaxpr(subs[0][1], inner_path, scan_depth + 1, multiplier * length, names, out, inner)
            carry = tuple(_aval(v) for v in scan_operands(eqn)[1])
            reverse, in_update = bool(eqn.params["reverse"]), _in_update(eqn, outer)
            out.scans.insert(before, ScanInfo(length, reverse, scan_depth, where, carry, body_matmuls, in_update))
            matmuls += body_matmuls
        elif is_remat_primitive(name):
            remat_region: set[str] = set()
            before = len(out.remats)
            matmuls += walk_jaxpr(subs[0][1], inner_path, scan_depth, multiplier, [*names, remat_region], out, inner)
            out.remats.insert(
                before,
                RematRegion(
                    policy_name(eqn.params.get("policy")),
                    bool(eqn.params.get("differentiated", False)),
                    bool(eqn.params.get("prevent_cse", True)),
                    where,
                    tuple(sorted(remat_region)),
                ),
            )
        else:  # cond branches, while's cond and body, call bodies: each one walked
            for _, sub in subs:
                matmuls += walk_jaxpr(sub, inner_path, scan_depth, multiplier, names, out, inner)
    return matmuls
