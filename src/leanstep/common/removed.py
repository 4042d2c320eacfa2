"""What leanstep removed or moved, each in one list, and the one line a caller of an old spelling gets.

A spelling deprecated with the release it goes in is removed then (0.12 removed those announced for
0.9). A caller upgrading gets leanstep's own ``TypeError`` naming the new spelling, not Python's
generic "unexpected keyword argument":

.. code-block:: text

    make_train_step(fsdp=) was removed in leanstep 0.12 (deprecated in 0.8): pass mesh=leanstep.step.ShardingLayer(mesh, fsdp=...)

:func:`refuses_removed_keywords` wraps a function so that its removed keywords get that line; the
function itself no longer takes them (its signature, and a type checker, say so). A keyword 0.12 moved
where it belongs, with no deprecation (:data:`MOVED_KEYWORDS`), gets one line saying what to write
instead: the step settings the planners and ``LeanstepStep`` took as keywords until 0.11 travel in
their ``StepSpec``; the spike guard in the state; the gradient stage's layout in each call.

.. code-block:: text

    plan(max_grad_norm=) takes its step settings in its spec since leanstep 0.12: pass spec=leanstep.StepSpec.from_keywords(max_grad_norm=...)

0.12 moved every top-level name but the step and its value into its sub-package
(:data:`MOVED_NAMES`): ``leanstep.plan`` is ``leanstep.planning.plan``. The old spelling still
works in 0.12, with one ``DeprecationWarning`` naming the new one (:func:`warn_moved`, called by
``leanstep.__getattr__``), and goes in 0.13.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = [
    "MOVED_KEYWORDS",
    "MOVED_NAMES",
    "REMOVED_KEYWORDS",
    "moved_keyword_error",
    "moved_name_message",
    "refuses_removed_keywords",
    "removed_keyword_error",
    "warn_moved",
]

_F = TypeVar("_F", bound=Callable[..., Any])

_ACCUMULATION = {
    name: f"accumulation=leanstep.Accumulation({name}=...)" for name in ("num_microbatches", "split", "unroll")
}
_LOSS = {
    name: f"loss=leanstep.LossContract({name}=...)" for name in ("has_aux", "token_weighted", "uses_rng", "has_state")
}
_SPACE = ("remat_policies", "microbatches", "meshes", "reductions", "max_microbatches", "min_microbatch_rows")
_SEARCH = {
    name: f"search=leanstep.planning.SearchOptions({name}=...)" for name in ("rtol", "exhaustive", "compiler_options")
}
_SEARCH |= {name: f"search=leanstep.planning.SearchOptions({name}=...)" for name in ("keep_executables", "progress")}
_SEARCH["flops_rtol"] = "search=leanstep.planning.SearchOptions(rtol=...)"

#: function -> {removed keyword: its new spelling}, each deprecated in 0.8 and removed in 0.12.
REMOVED_KEYWORDS: dict[str, dict[str, str]] = {
    "make_train_step": {
        name: f"mesh=leanstep.step.ShardingLayer(mesh, {name}=...)" for name in ("data_axis", "fsdp", "rules", "reduce")
    },
    "gradient_stage": {**_ACCUMULATION, **_LOSS},
    "plan": {**{name: f"candidates=leanstep.planning.SearchSpace({name}=...)" for name in _SPACE}, **_SEARCH},
    "plan_cluster": {**{name: f"space=leanstep.planning.SearchSpace({name}=...)" for name in _SPACE}, **_SEARCH},
}

#: The step settings a planner took as keywords until 0.11; since 0.12 they travel in its spec
#: (``leanstep.StepSpec``), whose ``from_keywords`` takes them by the same names (the list is
#: :data:`leanstep.step.spec.SHORT_KEYWORDS`, which common, below step, cannot import).
_STEP_KEYWORDS = (
    "precision", "num_microbatches", "max_grad_norm", "has_aux", "token_weighted", "uses_rng", "has_state", "split",
    "unroll", "cast_batch", "donate", "loss", "accumulation", "spike_guard", "update_chunk", "loss_scale", "fp8",
    "master", "moments", "sharding", "int8", "update_in_backward",
)  # fmt: skip

#: function -> {keyword: what to write instead}, each moved in 0.12 with no deprecation before (the
#: release that made the spec the library's one currency and the state carry its guard); "spec": a
#: step setting, whose new spelling is the spec's (:func:`moved_keyword_error`).
MOVED_KEYWORDS: dict[str, dict[str, str]] = {
    "plan": {
        **dict.fromkeys(_STEP_KEYWORDS, "spec"),
        "rules": "pass leanstep.planning.plan_cluster(..., rules=...), which lays a model's partition rules out",
    },
    "plan_cluster": dict.fromkeys(_STEP_KEYWORDS, "spec"),
    "LeanstepStep": {
        **dict.fromkeys(("precision", "accumulation", "loss", "loss_scale", "master", "int8"), "spec"),
        **dict.fromkeys(
            ("rules", "layer_stack"), "pass extras=leanstep.verification.ModelExtras(rules=..., layer_stack=...)"
        ),
    },
    "gradient_stage": {
        "params_layout": "give it to each call of the gradient function instead: gradients(params, batch, ..., "
        "params_layout=...), as leanstep.step.ShardingLayer.gradients does",
    },
    "guarded_update": {
        "spike_guard": "the state carries its guard (a static field, beside the optimizer): build it with "
        "TrainState.create(..., spike_guard=guard), or from a StepSpec with one",
    },
}


def removed_keyword_error(where: str, given: Iterable[str]) -> TypeError | None:
    """The TypeError for the removed keywords of ``where`` among ``given`` (else for its moved ones:
    :data:`MOVED_KEYWORDS`), or None if there are none.

    Example:
      >>> removed_keyword_error("gradient_stage", ["num_microbatches", "precision"])
      TypeError('gradient_stage(num_microbatches=) was removed in leanstep 0.12 (deprecated in 0.8): pass accumulation=leanstep.Accumulation(num_microbatches=...)')
      >>> removed_keyword_error("gradient_stage", ["precision"]) is None
      True
    """
    removed, given = REMOVED_KEYWORDS.get(where, {}), list(given)
    old = sorted(name for name in given if name in removed)
    if not old:
        return moved_keyword_error(where, given)
    new = " and ".join(dict.fromkeys(removed[name] for name in old))
    return TypeError(
        f"{where}({', '.join(f'{name}=' for name in old)}) was removed in leanstep 0.12 (deprecated in 0.8): pass {new}"
    )


def moved_keyword_error(where: str, given: Iterable[str]) -> TypeError | None:
    """The TypeError for the keywords of ``where`` that moved in 0.12 (:data:`MOVED_KEYWORDS`), or None.

    Example:
      >>> moved_keyword_error("plan", ["precision", "max_grad_norm", "budget_bytes"])
      TypeError('plan(max_grad_norm=, precision=) takes its step settings in its spec since leanstep 0.12: pass spec=leanstep.StepSpec.from_keywords(max_grad_norm=..., precision=...)')
      >>> str(moved_keyword_error("guarded_update", ["loss", "spike_guard"])).split(":")[0]
      'guarded_update(spike_guard=) was removed in leanstep 0.12'
    """
    moved = MOVED_KEYWORDS.get(where, {})
    old = sorted(name for name in given if name in moved)
    if not old:
        return None
    names = ", ".join(f"{name}=" for name in old)
    settings = [name for name in old if moved[name] == "spec"]
    others = list(dict.fromkeys(moved[name] for name in old if moved[name] != "spec"))
    if not settings:
        return TypeError(f"{where}({names}) was removed in leanstep 0.12: {'; '.join(others)}")
    spec = f"spec=leanstep.StepSpec.from_keywords({', '.join(f'{name}=...' for name in settings)})"
    rest = "".join(f"; {text}" for text in others)
    return TypeError(f"{where}({names}) takes its step settings in its spec since leanstep 0.12: pass {spec}{rest}")


def refuses_removed_keywords(where: str) -> Callable[[_F], _F]:
    """Wraps a function so that a removed or moved keyword of ``where`` (:data:`REMOVED_KEYWORDS`,
    :data:`MOVED_KEYWORDS`) gets its TypeError."""
    if where not in REMOVED_KEYWORDS and where not in MOVED_KEYWORDS:
        raise KeyError(f"{where!r} has no removed or moved keywords")
    old = {*REMOVED_KEYWORDS.get(where, {}), *MOVED_KEYWORDS.get(where, {})}

    def wrap(function: _F) -> _F:
        @functools.wraps(function)
        def refusing(*args: Any, **kwargs: Any) -> Any:
            error = None if old.isdisjoint(kwargs) else removed_keyword_error(where, kwargs)
            if error is not None:
                raise error
            return function(*args, **kwargs)

        return refusing  # type: ignore[return-value]  # the same signature: functools.wraps

    return wrap


#: Each name moved from the top of ``leanstep`` into its sub-package in 0.12 -> that sub-package.
#: The top-level spelling warns in 0.12 (:func:`warn_moved`) and is removed in 0.13.
MOVED_NAMES: dict[str, str] = {
    name: f"leanstep.{package}"
    for package, names in {
        "blocks": (
            "MASTERS",
            "MOMENT_DTYPES",
            "REMAT_POLICIES",
            "SPLITS",
            "Fp8Collection",
            "Fp8Meta",
            "PrecisionWarning",
            "QuantizedArray",
            "SpikeState",
            "all_finite",
            "checkpoint_name",
            "clip_by_global_norm",
            "clip_by_global_norm_transform",
            "compress_moments",
            "fp8_dot_general",
            "fp8_matmul",
            "get_loss_scale",
            "get_precision",
            "get_remat_policy",
            "get_splitter",
            "global_norm",
            "microbatched_value_and_grad",
            "presplit_microbatches",
            "remat",
            "split_microbatches",
            "split_strided_microbatches",
            "strict_precision",
        ),
        "checkpoints": ("Checkpointer", "CheckpointError", "RestoreResult"),
        "compilation": ("CompileCount", "disable_compile_cache", "enable_compile_cache"),
        "inspection": (
            "AuditReport",
            "Collective",
            "CollectivesReport",
            "MemorySpaceReport",
            "ResidualReport",
            "audit",
            "check_offload",
            "collectives_report",
            "memory_space_report",
            "saved_residuals_report",
        ),
        "planning": (
            "ACCELERATORS",
            "Accelerator",
            "BudgetError",
            "Plan",
            "SearchOptions",
            "SearchSpace",
            "get_accelerator",
            "plan",
        ),
        "sharding": (
            "MeshAxes",
            "batch_sharding",
            "constrain",
            "data_mesh",
            "fsdp_partition_spec",
            "gathered",
            "mesh_axes",
            "param_specs",
            "shard_batch",
            "sharding_context",
        ),
        "step": (
            "REDUCTIONS",
            "Gradients",
            "GuardedState",
            "ShardingLayer",
            "gradient_stage",
            "guarded_update",
            "guarded_update_transform",
            "offload_opt_state",
            "shard_train_state",
            "state_shardings",
        ),
        "verification": (
            "CheckResult",
            "LeanstepStep",
            "VerifiableStep",
            "VerifyReport",
            "probe_optimizer",
            "verify",
            "verify_step",
        ),
    }.items()
    for name in names
}


def moved_name_message(name: str) -> str:
    """The one line a caller of the moved top-level ``leanstep.<name>`` gets, naming the new spelling.

    Example:
      >>> moved_name_message("plan")
      'leanstep.plan moved to leanstep.planning.plan in 0.12; the top-level name is removed in 0.13'
    """
    return f"leanstep.{name} moved to {MOVED_NAMES[name]}.{name} in 0.12; the top-level name is removed in 0.13"


def warn_moved(name: str) -> str | None:
    """The sub-package ``name`` moved to, after one ``DeprecationWarning`` saying so (attributed to
    the line that read ``leanstep.<name>``); None, and no warning, for a name that never moved."""
    package = MOVED_NAMES.get(name)
    if package is not None:
        # stacklevel 3: this function, then leanstep.__getattr__, then the line that read the name
        warnings.warn(moved_name_message(name), DeprecationWarning, stacklevel=3)
    return package
