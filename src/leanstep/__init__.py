"""leanstep: lean, robust JAX training steps.

bf16 compute on float32 master weights with a dynamic loss scale, gradient
accumulation over microbatches inside one jitted step, clipping by the global
gradient norm, and rematerialization, composed in the right order by
:func:`make_train_step`. The seed contracts live in :mod:`leanstep.tasks`.

The top level holds the step and its value: :func:`make_train_step`, :class:`StepSpec` and the
parts a spec is built from, :class:`TrainState` and what a step returns. Everything else lives in
its sub-package, reached as an attribute (``leanstep.planning.plan``, ``leanstep.sharding.data_mesh``):
``blocks``, ``step``, ``sharding``, ``inspection``, ``verification``, ``planning``,
``checkpoints``, ``compilation``, ``frameworks``, ``models``, ``training``. A name that 0.12 moved
off the top (``leanstep.plan``) still works in 0.12, with one ``DeprecationWarning`` naming its
new spelling (:data:`leanstep.common.removed.MOVED_NAMES`); it goes in 0.13.

Importing ``leanstep`` is light: each name and sub-package is imported when first used
(``leanstep.make_train_step`` imports :mod:`leanstep.step`, and JAX with it), so that the
``leanstep`` command handles signals and prints ``--help`` before JAX loads. The names and their
sub-packages are written twice, as the imports under ``TYPE_CHECKING`` below (read by type
checkers and the API reference) and as ``_EXPORTS`` and ``_SUBPACKAGES`` (read by the lazy
imports); a test checks that they, and ``__all__``, agree.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leanstep import (
        blocks,
        checkpoints,
        compilation,
        frameworks,
        inspection,
        models,
        planning,
        sharding,
        step,
        training,
        verification,
    )
    from leanstep.blocks import (
        Accumulation,
        DynamicLossScale,
        Fp8Recipe,
        Int8Recipe,
        LayerStack,
        LossContract,
        LossScale,
        NoOpLossScale,
        Precision,
        SpikeGuard,
        StaticLossScale,
    )
    from leanstep.step import (
        LossScaleSpec,
        MeshLayout,
        StepMetrics,
        StepSpec,
        TrainState,
        UpdateInfo,
        make_train_step,
    )


#: Each top-level name -> the sub-package it is imported from when first used: the imports from
#: sub-packages under ``TYPE_CHECKING`` above, as a value (``tests/test_public_api.py`` checks
#: that the two and ``__all__`` hold the same names).
_EXPORTS: dict[str, str] = {
    name: module
    for module, names in {
        "leanstep.blocks": (
            "Accumulation",
            "DynamicLossScale",
            "Fp8Recipe",
            "Int8Recipe",
            "LayerStack",
            "LossContract",
            "LossScale",
            "NoOpLossScale",
            "Precision",
            "SpikeGuard",
            "StaticLossScale",
        ),
        "leanstep.step": (
            "LossScaleSpec",
            "MeshLayout",
            "StepMetrics",
            "StepSpec",
            "TrainState",
            "UpdateInfo",
            "make_train_step",
        ),
    }.items()
    for name in names
}

#: The sub-packages reached as attributes of ``leanstep`` (``leanstep.planning``), imported when first used.
_SUBPACKAGES = (
    "blocks",
    "checkpoints",
    "compilation",
    "frameworks",
    "inspection",
    "models",
    "planning",
    "sharding",
    "step",
    "training",
    "verification",
)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        from leanstep.common.removed import warn_moved

        moved = warn_moved(name)  # one DeprecationWarning naming the new spelling; not kept here, so each use warns
        if moved is None:
            raise AttributeError(f"module 'leanstep' has no attribute {name!r}")
        return getattr(importlib.import_module(moved), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.12.0"

__all__ = [
    "Accumulation",
    "DynamicLossScale",
    "Fp8Recipe",
    "Int8Recipe",
    "LayerStack",
    "LossContract",
    "LossScale",
    "LossScaleSpec",
    "MeshLayout",
    "NoOpLossScale",
    "Precision",
    "SpikeGuard",
    "StaticLossScale",
    "StepMetrics",
    "StepSpec",
    "TrainState",
    "UpdateInfo",
    "blocks",
    "checkpoints",
    "compilation",
    "frameworks",
    "inspection",
    "make_train_step",
    "models",
    "planning",
    "sharding",
    "step",
    "training",
    "verification",
]
