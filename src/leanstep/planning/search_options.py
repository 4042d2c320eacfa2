"""What a plan tries and how it searches: the two settings values of :func:`leanstep.planning.plan`.

.. code-block:: text

    SearchSpace    the settings to try: remat policies x microbatch counts (x meshes x reductions
                   on a cluster); one device may name its settings instead (``candidates=``)
    SearchOptions  how to search them: the margin within which two predictions count as equal,
                   whether to compile everything, XLA's options, what to keep and report

Both are frozen and checked when made, so a bad grid fails before anything is traced.
:func:`split_options` sorts flat keywords (``exhaustive=True``, ``meshes=[...]``: the form of
:func:`leanstep.training.analysis.plan_run`) into the two; the planners themselves take only the
values (their flat keywords of 0.8 were removed in 0.12: :mod:`leanstep.common.removed`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from leanstep.blocks.rematerialization import REMAT_POLICIES, get_remat_policy
from leanstep.common.checks import is_int, is_real
from leanstep.step.sharding_layer import REDUCTIONS

__all__ = [
    "BATCH_STATISTICS_ROWS",
    "SEARCH_FIELDS",
    "SPACE_FIELDS",
    "SearchOptions",
    "SearchSpace",
    "split_options",
]

#: The fewest rows a microbatch of a model with batch statistics (a model state) is planned with by
#: default: BatchNorm's statistics over fewer rows are noisy, over one image degenerate (Wu & He,
#: "Group Normalization", 2018: ResNet-50's ImageNet error with BatchNorm is 23.6% at 32 images a
#: device, 23.7% at 16, 24.8% at 8, 27.3% at 4, 34.7% at 2).
BATCH_STATISTICS_ROWS = 16


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """The settings a plan tries: every combination of the axes below.

    Attributes:
      remat_policies: the remat policies (:data:`leanstep.blocks.REMAT_POLICIES` by default).
      microbatches: the microbatch counts; None: every count that divides the rows per device.
      meshes: a cluster's mesh shapes (``{"data": 2, "fsdp": 4}``); None: every mesh of the
        devices, the tensor axis at most one node (:func:`leanstep.planning.cluster_grid.mesh_shapes`).
      reductions: a cluster's gradient reductions (:class:`leanstep.step.ShardingLayer`); None:
        ``("auto", "step")``.
      max_microbatches: the most microbatches to try (counts above it are left out); None: no
        bound. Bound it for a model with batch statistics (BatchNorm): each microbatch
        normalises over its own rows, so more microbatches change what the model computes.
      min_microbatch_rows: the fewest rows a microbatch may have (rows per device on a cluster):
        counts that leave fewer are left out. None: :data:`BATCH_STATISTICS_ROWS` (16) for a
        model with a model state (batch statistics), 1 for one without; never more than the
        batch, so one microbatch is always allowed.

    Raises:
      ValueError: an unknown policy or reduction, a microbatch count, ``max_microbatches`` or
        ``min_microbatch_rows`` that is not a positive int.

    Example:
      >>> SearchSpace(remat_policies=["none", "full"], microbatches=[1, 2]).microbatches
      (1, 2)
      >>> SearchSpace().min_rows(has_model_state=True), SearchSpace(min_microbatch_rows=4).min_rows(True)
      (16, 4)
    """

    remat_policies: tuple[str, ...] = REMAT_POLICIES
    microbatches: tuple[int, ...] | None = None
    meshes: tuple[dict[str, int], ...] | None = None
    reductions: tuple[str, ...] | None = None
    max_microbatches: int | None = None
    min_microbatch_rows: int | None = None

    def __post_init__(self) -> None:
        bound = self.max_microbatches
        for name in ("max_microbatches", "min_microbatch_rows"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"SearchSpace.{name} must be a positive int or None, got {value!r}")
        policies = tuple(self.remat_policies)
        for policy in policies:
            get_remat_policy(policy)
        counts = None if self.microbatches is None else tuple(self.microbatches)
        for m in counts or ():
            if not is_int(m) or m < 1:
                raise ValueError(f"SearchSpace.microbatches must hold positive ints, got {m!r}")
        reductions = None if self.reductions is None else tuple(self.reductions)
        for reduce in reductions or ():
            if reduce not in REDUCTIONS:
                raise ValueError(f"reductions must be among {REDUCTIONS}, got {reduce!r}")
        meshes = None if self.meshes is None else tuple(dict(shape) for shape in self.meshes)
        object.__setattr__(self, "remat_policies", policies)
        object.__setattr__(self, "microbatches", counts)
        object.__setattr__(self, "reductions", reductions)
        object.__setattr__(self, "meshes", meshes)
        object.__setattr__(self, "max_microbatches", None if bound is None else int(bound))
        rows = self.min_microbatch_rows
        object.__setattr__(self, "min_microbatch_rows", None if rows is None else int(rows))

    def min_rows(self, has_model_state: bool) -> int:
        """The fewest rows a microbatch may have: :attr:`min_microbatch_rows`, or its default."""
        if self.min_microbatch_rows is not None:
            return self.min_microbatch_rows
        return BATCH_STATISTICS_ROWS if has_model_state else 1

    def allows(self, num_microbatches: int, rows: int | None = None, has_model_state: bool = False) -> bool:
        """Whether ``num_microbatches`` is within :attr:`max_microbatches` and, of ``rows`` rows,
        leaves at least :meth:`min_rows` a microbatch (or all ``rows``, if fewer)."""
        if self.max_microbatches is not None and num_microbatches > self.max_microbatches:
            return False
        return rows is None or rows // num_microbatches >= min(self.min_rows(has_model_state), rows)

    @property
    def cluster_only(self) -> list[str]:
        """The fields set that only a cluster plan has (``meshes``, ``reductions``)."""
        return [name for name in ("meshes", "reductions") if getattr(self, name) is not None]


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """How a plan searches its :class:`SearchSpace`.

    Attributes:
      rtol: figures within this fraction count as equal: FLOPs on one device, predicted step
        times on a cluster (the pruning margin there).
      exhaustive: compile every candidate, not only those that could be chosen.
      compiler_options: passed to ``compile()``; ``"auto"``: on CPU, LLVM optimization level 0
        (``xla_backend_optimization_level=0``), which compiles about 3x faster and leaves
        XLA's buffer assignment, hence every memory number, unchanged (it only changes
        code generation, after buffer assignment); elsewhere XLA's defaults. Executables
        planned with it run slower: recompile the chosen setting to train.
      keep_executables: a cluster plan keeps every compiled executable, not only the chosen
        one's (a one-device plan keeps them all).
      progress: called with a line after each compile (cluster plans).

    Raises:
      ValueError: ``rtol`` outside ``[0, 1)``.
      TypeError: ``compiler_options`` not a dict, ``"auto"`` or None.

    Example:
      >>> SearchOptions(exhaustive=True).rtol
      0.02
    """

    rtol: float = 0.02
    exhaustive: bool = False
    compiler_options: dict[str, Any] | str | None = "auto"
    keep_executables: bool = False
    progress: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        if not (is_real(self.rtol) and 0 <= self.rtol < 1):
            raise ValueError(f"rtol must be a number in [0, 1), got {self.rtol!r}")
        options = self.compiler_options
        if options != "auto" and options is not None and not isinstance(options, dict):
            raise TypeError(f"compiler_options must be a dict, 'auto' or None, got {options!r}")


#: Flat keyword -> the :class:`SearchSpace` field it sets.
SPACE_FIELDS = {f.name: f.name for f in dataclasses.fields(SearchSpace)}
#: Flat keyword -> the :class:`SearchOptions` field it sets.
SEARCH_FIELDS = {f.name: f.name for f in dataclasses.fields(SearchOptions)}


def split_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Flat keywords sorted into ``(SearchSpace fields, SearchOptions fields, the rest)``.

    Example:
      >>> split_options({"exhaustive": True, "meshes": [{"data": 2}], "max_grad_norm": 1.0})
      ({'meshes': [{'data': 2}]}, {'exhaustive': True}, {'max_grad_norm': 1.0})
    """
    space, search, rest = {}, {}, {}
    for name, value in options.items():
        if name in SPACE_FIELDS:
            space[SPACE_FIELDS[name]] = value
        elif name in SEARCH_FIELDS:
            search[SEARCH_FIELDS[name]] = value
        else:
            rest[name] = value
    return space, search, rest
