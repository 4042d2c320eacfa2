r"""What a traced step really does: scans, remat regions, matmuls, residuals, host syncs.

:func:`audit` traces a function (``jax.make_jaxpr``; nothing runs) and walks the
program and every sub-program in it (``jit``, ``scan``, ``while``, ``cond``,
``remat2``, custom derivatives):

.. code-block:: text

    scans           every lax.scan: its length, direction, carry, matmuls in its body
    remat regions   every jax.checkpoint (primitive remat2): its policy, mapped back to a
                    leanstep name ("dots", "full", ...), and the primitives it recomputes
    matmuls         every dot_general and convolution: operand dtypes, accumulation dtype, scans,
                    its FLOPs times the trip counts of the scans around it
    host syncs      pure_callback / io_callback / debug_callback / debug_print / infeed / outfeed
    residuals       leanstep.inspection.saved_residuals_report of the loss, when one is given
    flops           leanstep.inspection.flops.count_flops of the program (loop bodies x trip count)

and returns them as an :class:`AuditReport` of the records in :mod:`leanstep.inspection.audit_records`,
which checks them against the gradient-accumulation rules and a remat policy, or the rules of the
update inside the backward pass.

Size: the walk and the report's rule checks read the same records; the records are audit_records.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from leanstep.blocks.rematerialization import (
    check_saved_names,
)
from leanstep.common.checks import check_callable
from leanstep.common.jaxprs import MATMUL_PRIMITIVES
from leanstep.inspection.audit_records import HostSync, Matmul, RematRegion, ScanInfo
from leanstep.inspection.audit_walk import Findings, policy_name, walk_jaxpr
from leanstep.inspection.flops import ELEMENTWISE_PRIMITIVES, count_flops
from leanstep.inspection.residuals import ResidualReport, saved_residuals_report, short_dtype_name

__all__ = ["AuditReport", "audit", "audit_jaxpr", "policy_name"]


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """What a traced program does; ``str(report)`` is a readable summary.

    Attributes:
      scans: every ``lax.scan``, outer ones first.
      remat_regions: every ``jax.checkpoint`` region.
      matmuls: every ``dot_general`` and ``conv_general_dilated`` (see :attr:`Matmul.kind`).
      host_syncs: every host callback, infeed or outfeed.
      residuals: what the loss saves for its backward pass, when a loss was given.
      flops: see :func:`leanstep.inspection.flops.count_flops`.
      equations: the number of equations, sub-programs included.
    """

    scans: tuple[ScanInfo, ...]
    remat_regions: tuple[RematRegion, ...]
    matmuls: tuple[Matmul, ...]
    host_syncs: tuple[HostSync, ...]
    residuals: ResidualReport | None
    flops: float
    equations: int

    @property
    def top_level_scans(self) -> tuple[ScanInfo, ...]:
        """The scans not inside another scan."""
        return tuple(s for s in self.scans if s.depth == 0)

    @property
    def loop_candidates(self) -> tuple[ScanInfo, ...]:
        """The top-level scans outside the optimizer's update: the microbatch loop must be one of them.

        The optimizer's own loops (an 8-bit codec's search, a chunked update, Newton-Schulz
        iterations) run on the gradient after the loop; leanstep's step applies the optimizer under
        ``jax.named_scope("leanstep_optimizer_update")``, and a hand-written step can do the same.
        """
        return tuple(s for s in self.top_level_scans if not s.in_update)

    @property
    def matmuls_outside_scans(self) -> tuple[Matmul, ...]:
        """The dot_generals not inside any scan."""
        return tuple(m for m in self.matmuls if m.scan_depth == 0)

    @property
    def matmul_dtypes(self) -> dict[tuple[str, str, str], int]:
        """``(lhs dtype, rhs dtype, accumulation dtype) -> number of dot_generals``."""
        return dict(collections.Counter(m.dtypes for m in self.matmuls))

    @property
    def recomputed(self) -> frozenset[str]:
        """Primitives run inside a differentiated remat region: forward work redone in the backward pass."""
        return frozenset(p for r in self.remat_regions if r.differentiated for p in r.primitives)

    def accumulation_violations(self, num_microbatches: int, *, params: Any = None) -> list[str]:
        """The ways the program breaks the gradient-accumulation rules (empty: none).

        .. code-block:: text

            1. exactly one top-level lax.scan, of length num_microbatches, running forward
               (a reversed scan is a transposed one: the gradient was taken through the scan)
            2. value_and_grad in its body: the body has matmuls and the carry holds a
               gradient accumulator (with ``params``: an array shaped like every leaf)
            3. no dot_general outside a scan (no full-batch forward or backward pass)

        The scans and matmuls of the optimizer's update are not the step's: the rules read
        :attr:`loop_candidates`, and matmuls outside the update.

        With ``num_microbatches=1`` the step has no microbatch loop (a one-step scan only
        costs time), so the rules are about the scans the program does have: none of
        them may run in reverse at the top level (a gradient taken through a scan).
        """
        problems = []
        top = self.loop_candidates
        if num_microbatches == 1:
            return [
                f"a top-level lax.scan of length {s.length} runs in reverse: the gradient was taken through "
                "the scan instead of inside its body"
                for s in top
                if s.reverse
            ]
        if len(top) != 1:
            lengths = [s.length for s in top]
            problems.append(
                f"expected exactly one top-level lax.scan over the microbatches, found {len(top)}"
                + (f" (lengths {lengths}, reverse {[s.reverse for s in top]})" if top else "")
            )
        for scan in top[:1] if len(top) == 1 else ():
            if scan.length != num_microbatches:
                problems.append(f"the scan has length {scan.length}; expected num_microbatches={num_microbatches}")
            if scan.reverse:
                problems.append(
                    "the scan runs in reverse: it is a transposed scan, so the gradient was taken "
                    "through the scan instead of inside its body"
                )
            if scan.matmuls == 0:
                problems.append("the scan body has no dot_general: the forward and backward pass are not in it")
            carried = collections.Counter(shape for shape, _ in scan.carry)
            if not any(shape for shape in carried):
                problems.append("the scan carries no gradient accumulator (no non-scalar carry)")
            if params is not None:
                wanted = collections.Counter(tuple(np.shape(leaf)) for leaf in jax.tree.leaves(params))
                missing = wanted - carried
                if missing:
                    problems.append(
                        f"the scan carry has no gradient accumulator for parameter shapes {sorted(missing.elements())}"
                    )
        outside = [m for m in self.matmuls_outside_scans if not m.in_update]
        if outside:
            shapes = ", ".join(f"{m.lhs[0]} x {m.rhs[0]}" for m in outside)
            problems.append(f"{len(outside)} dot_general(s) outside any scan: {shapes}")
        return problems

    def in_backward_violations(self) -> list[str]:
        """The ways a step that updates each layer inside the backward pass
        (``StepSpec.update_in_backward``) breaks its rules (empty: none).

        .. code-block:: text

            1. two top-level scans run in reverse over the same number of layers, each with
               matmuls in its body: the norm pass and the update pass (a gradient taken
               through the whole stack would be one)
            2. no dot_general outside a scan (no full-batch forward or backward pass)
        """
        problems = []
        passes = [s for s in self.loop_candidates if s.reverse]
        if len(passes) != 2 or len({s.length for s in passes}) != 1:
            problems.append(
                "expected two reversed top-level scans over the layers (the norm pass and the update pass), found "
                f"{len(passes)} (lengths {[s.length for s in passes]})"
            )
        problems += [
            f"a reversed scan of length {s.length} has no dot_general in its body" for s in passes if not s.matmuls
        ]
        outside = [m for m in self.matmuls_outside_scans if not m.in_update]
        if outside:
            problems.append(f"{len(outside)} dot_general(s) outside any scan")
        return problems

    def run_rules(self, num_microbatches: int, remat: str, *, in_backward: bool = False) -> tuple[str, list[str]]:
        """``(the rules a run's step keeps, the ways the program breaks them)``: the microbatch loop's
        (and the remat policy's, unless ``"none"``), or with ``in_backward`` the layer passes'."""
        if in_backward:  # each block is recomputed in its backward pass: no remat region to check
            return (
                "two reversed scans over the layers, no matmul outside a scan; remat n/a",
                self.in_backward_violations(),
            )
        problems = self.accumulation_violations(num_microbatches)
        if remat != "none":
            problems += self.remat_violations(remat)
        loop = (
            "one microbatch: no microbatch loop, no gradient through a scan"
            if num_microbatches == 1
            else "one scan over the microbatches, value_and_grad in its body, no matmul outside a scan"
        )
        return loop + (f", remat policy {remat}" if remat != "none" else ""), problems

    def remat_violations(self, policy: str, *, recomputed: Iterable[str] = ()) -> list[str]:
        """The ways the program breaks a remat rule (empty: none).

        .. code-block:: text

            1. at least one remat region, and every one has policy ``policy``
            2. every primitive in ``recomputed`` runs in a differentiated remat region
               (the backward pass recomputes it) and, with residuals, is not saved
        """
        problems = []
        if not self.remat_regions:
            problems.append("no jax.checkpoint (remat2) region in the traced program")
        others = sorted({r.policy for r in self.remat_regions} - {policy})
        if others:
            problems.append(f"remat regions with policy {others}; expected only {policy!r}")
        saved = {e.primitive for e in self.residuals.entries} if self.residuals is not None else set()
        for name in recomputed:
            if name not in self.recomputed:
                problems.append(f"{name} is not recomputed in the backward pass (in no differentiated remat region)")
            if name in saved:
                problems.append(f"the output of {name} is saved for the backward pass")
        return problems

    def __str__(self) -> str:
        lines = [(f"traced program: {self.equations} equations, {self.flops:,.0f} FLOPs (loop bodies x trip count)")]
        lines.append(f"scans: {len(self.scans)}")
        for s in self.scans:
            carry = sum(math.prod(shape) * jax.numpy.dtype(d).itemsize for shape, d in s.carry)
            lines.append(
                f"  {'  ' * s.depth}length {s.length}{' reversed' if s.reverse else ''}, "
                f"{s.matmuls} matmuls in the body, carry {len(s.carry)} values ({carry:,} bytes)  at {s.path}"
                + ("  (the optimizer's)" if s.in_update else "")
            )
        lines.append(f"remat regions: {len(self.remat_regions)}")
        for r in self.remat_regions:
            work = ", ".join(p for p in r.primitives if p in ELEMENTWISE_PRIMITIVES or p in MATMUL_PRIMITIVES)
            lines.append(
                f"  policy {r.policy}, {'backward pass' if r.differentiated else 'forward pass'}, "
                f"runs {work or '-'}  at {r.path}"
            )
        total = sum(m.flops for m in self.matmuls) or 1.0
        convolutions = sum(m.kind == "conv_general_dilated" for m in self.matmuls)
        of_which = f", {convolutions} of them convolutions" if convolutions else ""
        lines.append(f"matmuls: {len(self.matmuls)} ({len(self.matmuls_outside_scans)} outside any scan{of_which})")
        by_dtype: collections.defaultdict[tuple[str, ...], list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for m in self.matmuls:
            key = (m.lhs[1], m.rhs[1], m.preferred, m.scale)
            by_dtype[key][0] += 1
            by_dtype[key][1] += m.flops
        for (lhs, rhs, acc, scale), (count, flops) in sorted(by_dtype.items(), key=lambda kv: -kv[1][1]):
            fp8 = f" (FP8, {scale} scaling)" if scale else ""
            lines.append(
                f"  {short_dtype_name(lhs)} x {short_dtype_name(rhs)} -> {short_dtype_name(acc)}{fp8}: {count} matmuls, "
                f"{100 * flops / total:.1f}% of matmul FLOPs"
            )
        for m in self.matmuls_outside_scans:
            lines.append(
                f"  outside any scan: {short_dtype_name(m.lhs[1])}{list(m.lhs[0])} x {short_dtype_name(m.rhs[1])}{list(m.rhs[0])}"
                f"  at {m.path}"
            )
        lines.append(f"host syncs: {len(self.host_syncs) or 'none'}")
        lines.extend(f"  {h.primitive}{f' ({h.callback})' if h.callback else ''}  at {h.path}" for h in self.host_syncs)
        if self.residuals is not None:
            lines.append("saved residuals (one microbatch's loss):")
            lines.extend("  " + line for line in str(self.residuals).splitlines())
        return "\n".join(lines)


def audit_jaxpr(closed_jaxpr: Any, *, residuals: ResidualReport | None = None) -> AuditReport:
    """Builds an :class:`AuditReport` from an already traced program (``jax.make_jaxpr`` output).

    Args:
      closed_jaxpr: a ``ClosedJaxpr`` or ``Jaxpr``, e.g. ``jax.jit(f).trace(*args).jaxpr``.
      residuals: a :func:`leanstep.inspection.saved_residuals_report` to include, or None.

    Returns:
      The report.

    Raises:
      TypeError: ``closed_jaxpr`` is not a jaxpr.
      ValueError: a ``"save:NAME"`` remat policy in the program names a ``checkpoint_name``
        tag the program never sets (it would save nothing; see
        :func:`leanstep.blocks.rematerialization.check_saved_names`).
    """
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    if not hasattr(jaxpr, "eqns"):
        raise TypeError(f"closed_jaxpr must be a jaxpr (from jax.make_jaxpr), got {type(closed_jaxpr).__name__}")
    check_saved_names(jaxpr, "the audited program")
    out = Findings()
    walk_jaxpr(jaxpr, (), 0, 1.0, [], out)
    return AuditReport(
        tuple(out.scans),
        tuple(out.remats),
        tuple(out.matmuls),
        tuple(out.host_syncs),
        residuals,
        count_flops(jaxpr),
        out.equations,
    )


def audit(
    step_or_fn: Callable[..., Any],
    *args: Any,
    loss_fn: Callable[..., Any] | None = None,
    loss_args: tuple[Any, ...] = (),
    **kwargs: Any,
) -> AuditReport:
    """Traces ``step_or_fn(*args, **kwargs)`` (nothing runs) and reports what the program does.

    .. code-block:: text

        jaxpr  = jax.make_jaxpr(step_or_fn)(*args, **kwargs)     # arrays or ShapeDtypeStructs
        report = walk(jaxpr)                                    # scans, remat, matmuls, syncs, FLOPs
        report.residuals = saved_residuals_report(loss_fn, *loss_args)   # if loss_fn is given

    Args:
      step_or_fn: any function of arrays, jitted or not (a :func:`leanstep.make_train_step`
        step included; donation does not matter, nothing runs).
      *args: its arguments: arrays, or ``jax.ShapeDtypeStruct`` stand-ins.
      loss_fn: the loss whose backward-pass residuals to report (un-jitted; see
        :func:`leanstep.inspection.saved_residuals_report`), or None.
      loss_args: the arguments of ``loss_fn``.
      **kwargs: keyword arguments of ``step_or_fn`` (static ones bound by ``make_jaxpr``).

    Returns:
      An :class:`AuditReport`.

    Raises:
      TypeError: ``step_or_fn`` or ``loss_fn`` is not callable.
      ValueError: tracing raises it (a :func:`leanstep.make_train_step` step refuses what it
        would silently ignore), or a ``"save:NAME"`` remat policy names a tag the program never
        sets (see :func:`audit_jaxpr`).

    Example:
      >>> import functools
      >>> import jax.numpy as jnp
      >>> from leanstep.tasks import accumulate_gradients
      >>> p = {"w1": jnp.ones((3, 5)), "b1": jnp.ones(5), "w2": jnp.ones((5, 2)), "b2": jnp.ones(2)}
      >>> x, y = jnp.ones((8, 3)), jnp.ones((8, 2))
      >>> report = audit(functools.partial(accumulate_gradients, num_microbatches=4), p, x, y)
      >>> [(s.length, s.matmuls) for s in report.scans], len(report.matmuls_outside_scans)
      ([(4, 5)], 0)
      >>> report.accumulation_violations(4, params=p)
      []
    """
    check_callable("step_or_fn", step_or_fn)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
    closed = jax.make_jaxpr(lambda *a: step_or_fn(*a, **kwargs))(*args)
    residuals = saved_residuals_report(loss_fn, *loss_args) if loss_fn is not None else None
    return audit_jaxpr(closed, residuals=residuals)
