"""The settings a one-device plan tries: a :class:`SearchSpace`'s grid, or the candidates given, checked.

.. code-block:: text

    counts   = divisors of the batch (or SearchSpace.microbatches)
             that are <= max_microbatches and leave >= min(min_microbatch_rows, batch) rows each
    settings = counts x remat policies x precision
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from leanstep.blocks.precision import get_precision
from leanstep.blocks.rematerialization import REMAT_POLICIES, get_remat_policy
from leanstep.common.checks import is_int
from leanstep.planning.records import Setting
from leanstep.planning.search_options import SearchSpace

__all__ = ["checked_settings", "settings_grid"]


def settings_grid(
    batch_size: int,
    *,
    remat_policies: Iterable[str] = REMAT_POLICIES,
    precisions: Iterable[str] = ("float32",),
    microbatches: Iterable[int] | None = None,
    max_microbatches: int | None = None,
    min_microbatch_rows: int = 1,
) -> tuple[Setting, ...]:
    """Every combination of microbatch count (default: the divisors of ``batch_size``; at most
    ``max_microbatches``, each leaving at least ``min_microbatch_rows`` rows a microbatch, or the
    whole batch if smaller), policy and precision.

    Raises:
      ValueError: a bad ``batch_size``; no count within ``max_microbatches`` or ``min_microbatch_rows``.

    Example:
      >>> [s[:3] for s in settings_grid(4, remat_policies=("none", "dots"))][:3]
      [(1, 'none', 'float32'), (1, 'dots', 'float32'), (2, 'none', 'float32')]
    """
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    counts = (
        [m for m in range(1, batch_size + 1) if batch_size % m == 0] if microbatches is None else list(microbatches)
    )
    bounded = [m for m in counts if max_microbatches is None or m <= max_microbatches]
    if counts and not bounded:
        raise ValueError(
            f"no microbatch count of the batch of {batch_size} ({counts}) is within "
            f"SearchSpace.max_microbatches={max_microbatches}; raise the bound"
        )
    rows = min(min_microbatch_rows, batch_size)
    if bounded and not [m for m in bounded if batch_size // m >= rows]:
        raise ValueError(
            f"no microbatch count of the batch of {batch_size} ({bounded}) leaves at least {rows} rows a "
            f"microbatch (SearchSpace.min_microbatch_rows={min_microbatch_rows}, 16 by default for a model "
            "with batch statistics); lower it or give fewer microbatches"
        )
    bounded = [m for m in bounded if batch_size // m >= rows]
    return tuple(Setting(int(m), r, p) for m in bounded for r in remat_policies for p in precisions)


def _check_setting(setting: Any, batch_size: int) -> Setting:
    try:
        setting = Setting(*setting)
    except TypeError:
        raise TypeError(f"candidates must hold (num_microbatches, remat, precision) triples, got {setting!r}") from None
    m = setting.num_microbatches
    if not is_int(m) or m < 1 or batch_size % m:
        raise ValueError(
            f"candidate {tuple(setting)}: num_microbatches={m!r} must be a positive divisor of "
            f"the batch size {batch_size}"
        )
    get_remat_policy(setting.remat)
    get_precision(setting.precision)
    return Setting(int(m), setting.remat, setting.precision)


def checked_settings(candidates: Any, batch_size: int, precision: str, min_rows: int | None) -> list[Setting]:
    """The checked settings to plan: ``candidates`` as given, or a :class:`SearchSpace`'s grid
    (its microbatches of at least ``min_rows`` rows)."""
    if isinstance(candidates, SearchSpace):
        space = candidates
        if space.cluster_only:
            raise ValueError(f"{' and '.join(space.cluster_only)} plan a cluster; give num_devices= too")
        candidates = settings_grid(
            batch_size,
            remat_policies=space.remat_policies,
            precisions=(precision,),
            microbatches=space.microbatches,
            max_microbatches=space.max_microbatches,
            min_microbatch_rows=min_rows or 1,
        )
    settings = [_check_setting(s, batch_size) for s in candidates]
    if not settings:
        raise ValueError("candidates is empty; give at least one (num_microbatches, remat, precision)")
    return settings
