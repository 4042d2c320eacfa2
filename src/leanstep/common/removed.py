"""The keywords leanstep removed, in one list, and the one line a caller of an old spelling gets.

A spelling deprecated with the release it goes in is removed then (0.12 removed those announced for
0.9). A caller upgrading gets leanstep's own ``TypeError`` naming the new spelling, not Python's
generic "unexpected keyword argument":

.. code-block:: text

    make_train_step(fsdp=) was removed in leanstep 0.12 (deprecated in 0.8): pass mesh=leanstep.ShardingLayer(mesh, fsdp=...)

:func:`refuses_removed_keywords` wraps a function so that its removed keywords get that line; the
function itself no longer takes them (its signature, and a type checker, say so).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["REMOVED_KEYWORDS", "refuses_removed_keywords", "removed_keyword_error"]

_F = TypeVar("_F", bound=Callable[..., Any])

_ACCUMULATION = {
    name: f"accumulation=leanstep.Accumulation({name}=...)" for name in ("num_microbatches", "split", "unroll")
}
_LOSS = {
    name: f"loss=leanstep.LossContract({name}=...)" for name in ("has_aux", "token_weighted", "uses_rng", "has_state")
}
_SPACE = ("remat_policies", "microbatches", "meshes", "reductions", "max_microbatches", "min_microbatch_rows")
_SEARCH = {name: f"search=leanstep.SearchOptions({name}=...)" for name in ("rtol", "exhaustive", "compiler_options")}
_SEARCH |= {name: f"search=leanstep.SearchOptions({name}=...)" for name in ("keep_executables", "progress")}
_SEARCH["flops_rtol"] = "search=leanstep.SearchOptions(rtol=...)"

#: function -> {removed keyword: its new spelling}, each deprecated in 0.8 and removed in 0.12.
REMOVED_KEYWORDS: dict[str, dict[str, str]] = {
    "make_train_step": {
        name: f"mesh=leanstep.ShardingLayer(mesh, {name}=...)" for name in ("data_axis", "fsdp", "rules", "reduce")
    },
    "gradient_stage": {**_ACCUMULATION, **_LOSS},
    "plan": {**{name: f"candidates=leanstep.SearchSpace({name}=...)" for name in _SPACE}, **_SEARCH},
    "plan_cluster": {**{name: f"space=leanstep.SearchSpace({name}=...)" for name in _SPACE}, **_SEARCH},
}


def removed_keyword_error(where: str, given: Iterable[str]) -> TypeError | None:
    """The TypeError for the removed keywords of ``where`` among ``given``, or None if there are none.

    Example:
      >>> removed_keyword_error("gradient_stage", ["num_microbatches", "precision"])
      TypeError('gradient_stage(num_microbatches=) was removed in leanstep 0.12 (deprecated in 0.8): pass accumulation=leanstep.Accumulation(num_microbatches=...)')
      >>> removed_keyword_error("gradient_stage", ["precision"]) is None
      True
    """
    removed = REMOVED_KEYWORDS[where]
    old = sorted(name for name in given if name in removed)
    if not old:
        return None
    new = " and ".join(dict.fromkeys(removed[name] for name in old))
    return TypeError(
        f"{where}({', '.join(f'{name}=' for name in old)}) was removed in leanstep 0.12 (deprecated in 0.8): pass {new}"
    )


def refuses_removed_keywords(where: str) -> Callable[[_F], _F]:
    """Wraps a function so that a removed keyword of ``where`` (:data:`REMOVED_KEYWORDS`) gets its TypeError."""
    removed = REMOVED_KEYWORDS[where]

    def wrap(function: _F) -> _F:
        @functools.wraps(function)
        def refusing(*args: Any, **kwargs: Any) -> Any:
            error = None if removed.keys().isdisjoint(kwargs) else removed_keyword_error(where, kwargs)
            if error is not None:
                raise error
            return function(*args, **kwargs)

        return refusing  # type: ignore[return-value]  # the same signature: functools.wraps

    return wrap
