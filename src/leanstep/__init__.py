"""leanstep: lean, robust JAX training steps.

bf16 compute on float32 master weights with a dynamic loss scale, gradient
accumulation over microbatches inside one jitted step, clipping by the global
gradient norm, and rematerialization, composed in the right order by
:func:`make_train_step`. The seed contracts live in :mod:`leanstep.tasks`.

Importing ``leanstep`` is light: each public name is imported from its sub-package when first
used (``leanstep.make_train_step`` imports :mod:`leanstep.step`, and JAX with it), so that the
``leanstep`` command handles signals and prints ``--help`` before JAX loads. The names and
their sub-packages are written twice, as the imports under ``TYPE_CHECKING`` below (read by type
checkers and the API reference) and as ``_EXPORTS`` (read by the lazy imports); a test checks that
they, and ``__all__``, agree.

Size: the public API's table (_EXPORTS) and its TYPE_CHECKING imports, one line a name, and the
docstring that introduces them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leanstep.blocks import (
        MASTERS,
        MOMENT_DTYPES,
        REMAT_POLICIES,
        SPLITS,
        Accumulation,
        DynamicLossScale,
        Fp8Collection,
        Fp8Meta,
        Fp8Recipe,
        LossContract,
        LossScale,
        NoOpLossScale,
        Precision,
        PrecisionWarning,
        QuantizedArray,
        SpikeGuard,
        SpikeState,
        StaticLossScale,
        all_finite,
        checkpoint_name,
        clip_by_global_norm,
        clip_by_global_norm_transform,
        compress_moments,
        fp8_dot_general,
        fp8_matmul,
        get_loss_scale,
        get_precision,
        get_remat_policy,
        get_splitter,
        global_norm,
        microbatched_value_and_grad,
        presplit_microbatches,
        remat,
        split_microbatches,
        split_strided_microbatches,
        strict_precision,
    )
    from leanstep.checkpoints import Checkpointer, CheckpointError, RestoreResult
    from leanstep.compilation import CompileCount, disable_compile_cache, enable_compile_cache
    from leanstep.inspection import (
        AuditReport,
        Collective,
        CollectivesReport,
        MemorySpaceReport,
        ResidualReport,
        audit,
        check_offload,
        collectives_report,
        memory_space_report,
        saved_residuals_report,
    )
    from leanstep.planning import (
        ACCELERATORS,
        Accelerator,
        BudgetError,
        Plan,
        SearchOptions,
        SearchSpace,
        get_accelerator,
        plan,
    )
    from leanstep.sharding import (
        MeshAxes,
        batch_sharding,
        constrain,
        data_mesh,
        fsdp_partition_spec,
        gathered,
        mesh_axes,
        param_specs,
        shard_batch,
        sharding_context,
    )
    from leanstep.step import (
        REDUCTIONS,
        Gradients,
        GuardedState,
        ShardingLayer,
        StepMetrics,
        StepSpec,
        TrainState,
        UpdateInfo,
        gradient_stage,
        guarded_update,
        guarded_update_transform,
        make_train_step,
        offload_opt_state,
        shard_train_state,
        state_shardings,
    )
    from leanstep.verification import (
        CheckResult,
        LeanstepStep,
        VerifiableStep,
        VerifyReport,
        probe_optimizer,
        verify,
        verify_step,
    )


#: Each public name -> the sub-package it is imported from when first used: the imports under
#: ``TYPE_CHECKING`` above, as a value (``tests/test_public_api.py`` checks that the two and
#: ``__all__`` hold the same names).
_EXPORTS: dict[str, str] = {
    name: module
    for module, names in {
        "leanstep.blocks": (
            "MASTERS",
            "MOMENT_DTYPES",
            "REMAT_POLICIES",
            "SPLITS",
            "Accumulation",
            "DynamicLossScale",
            "Fp8Collection",
            "Fp8Meta",
            "Fp8Recipe",
            "LossContract",
            "LossScale",
            "NoOpLossScale",
            "Precision",
            "PrecisionWarning",
            "QuantizedArray",
            "SpikeGuard",
            "SpikeState",
            "StaticLossScale",
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
        "leanstep.checkpoints": (
            "Checkpointer",
            "CheckpointError",
            "RestoreResult",
        ),
        "leanstep.compilation": (
            "CompileCount",
            "disable_compile_cache",
            "enable_compile_cache",
        ),
        "leanstep.inspection": (
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
        "leanstep.planning": (
            "ACCELERATORS",
            "Accelerator",
            "BudgetError",
            "Plan",
            "SearchOptions",
            "SearchSpace",
            "get_accelerator",
            "plan",
        ),
        "leanstep.sharding": (
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
        "leanstep.step": (
            "REDUCTIONS",
            "Gradients",
            "GuardedState",
            "ShardingLayer",
            "StepMetrics",
            "StepSpec",
            "TrainState",
            "UpdateInfo",
            "gradient_stage",
            "guarded_update",
            "guarded_update_transform",
            "make_train_step",
            "offload_opt_state",
            "shard_train_state",
            "state_shardings",
        ),
        "leanstep.verification": (
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'leanstep' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__version__ = "0.11.0"

__all__ = [
    "ACCELERATORS",
    "MASTERS",
    "MOMENT_DTYPES",
    "REDUCTIONS",
    "REMAT_POLICIES",
    "SPLITS",
    "Accelerator",
    "Accumulation",
    "AuditReport",
    "BudgetError",
    "CheckResult",
    "CheckpointError",
    "Checkpointer",
    "Collective",
    "CollectivesReport",
    "CompileCount",
    "DynamicLossScale",
    "Fp8Collection",
    "Fp8Meta",
    "Fp8Recipe",
    "Gradients",
    "GuardedState",
    "LeanstepStep",
    "LossContract",
    "LossScale",
    "MemorySpaceReport",
    "MeshAxes",
    "NoOpLossScale",
    "Plan",
    "Precision",
    "PrecisionWarning",
    "QuantizedArray",
    "ResidualReport",
    "RestoreResult",
    "SearchOptions",
    "SearchSpace",
    "ShardingLayer",
    "SpikeGuard",
    "SpikeState",
    "StaticLossScale",
    "StepMetrics",
    "StepSpec",
    "TrainState",
    "UpdateInfo",
    "VerifiableStep",
    "VerifyReport",
    "all_finite",
    "audit",
    "batch_sharding",
    "check_offload",
    "checkpoint_name",
    "clip_by_global_norm",
    "clip_by_global_norm_transform",
    "collectives_report",
    "compress_moments",
    "constrain",
    "data_mesh",
    "disable_compile_cache",
    "enable_compile_cache",
    "fp8_dot_general",
    "fp8_matmul",
    "fsdp_partition_spec",
    "gathered",
    "get_accelerator",
    "get_loss_scale",
    "get_precision",
    "get_remat_policy",
    "get_splitter",
    "global_norm",
    "gradient_stage",
    "guarded_update",
    "guarded_update_transform",
    "make_train_step",
    "memory_space_report",
    "mesh_axes",
    "microbatched_value_and_grad",
    "offload_opt_state",
    "param_specs",
    "plan",
    "presplit_microbatches",
    "probe_optimizer",
    "remat",
    "saved_residuals_report",
    "shard_batch",
    "shard_train_state",
    "sharding_context",
    "split_microbatches",
    "split_strided_microbatches",
    "state_shardings",
    "strict_precision",
    "verify",
    "verify_step",
]
