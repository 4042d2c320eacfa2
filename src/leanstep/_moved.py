"""The import paths of leanstep 0.7, kept working through 0.8 with a ``DeprecationWarning``.

0.8 put the flat modules into sub-packages (``leanstep.gradients`` is now
``leanstep.step.gradients``). ``import leanstep`` installs one finder that answers an old
path with a module that forwards every attribute to the new one and warns once, on import.
Nothing in leanstep imports an old path; the public names in ``leanstep`` never moved.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

__all__ = ["MOVED", "install", "moved_attribute"]

#: Old module path -> new module path.
MOVED: dict[str, str] = {
    f"leanstep.{old}": f"leanstep.{new}"
    for old, new in {
        "_checks": "common.checks",
        "files": "common.files",
        "memory_sizes": "common.memory_sizes",
        "_jaxpr": "common.jaxprs",
        "precision": "blocks.precision",
        "rounding": "blocks.rounding",
        "loss_scale": "blocks.loss_scale",
        "loss_scale_registry": "blocks.loss_scale_registry",
        "clipping": "blocks.clipping",
        "rematerialization": "blocks.rematerialization",
        "microbatches": "blocks.microbatches",
        "accumulation": "blocks.accumulation",
        "compute_dtype_check": "blocks.compute_dtype_check",
        "partition_rules": "sharding.partition_rules",
        "model_sharding": "sharding.model_sharding",
        "distributed": "sharding.distributed",
        "state": "step.state",
        "param_checks": "step.param_checks",
        "gradients": "step.gradients",
        "update": "step.update",
        "sharding_layer": "step.sharding_layer",
        "auditing": "inspection.auditing",
        "audit_records": "inspection.audit_records",
        "flops": "inspection.flops",
        "hlo_text": "inspection.hlo_text",
        "residuals": "inspection.residuals",
        "collectives": "inspection.collectives",
        "plan_records": "planning.records",
        "plan_compile": "planning.candidates",
        "cluster_planning": "planning.cluster",
        "cluster_grid": "planning.cluster_grid",
        "cost_model": "planning.cost_model",
        "checkpoint": "checkpoints.checkpointer",
        "checkpoint_layout": "checkpoints.layout",
        "checkpoint_manifest": "checkpoints.manifest",
        "checkpoint_trees": "checkpoints.trees",
        "compile_cache": "compilation.cache",
        "atomic_file_cache": "compilation.atomic_file_cache",
        "compile_count": "compilation.count",
    }.items()
}

#: Names of the old ``leanstep.sharding`` module that moved out of the ``leanstep.sharding`` package.
MOVED_ATTRIBUTES: dict[tuple[str, str], str] = {
    ("leanstep.sharding", "shard_train_state"): "leanstep.step.state_sharding",
    ("leanstep.sharding", "state_shardings"): "leanstep.step.state_sharding",
}


def _warn(old: str, new: str, stacklevel: int) -> None:
    # ``warnings`` skips importlib's own frames, so the levels count leanstep's frames only.
    warnings.warn(
        f"{old} moved to {new} in leanstep 0.8; the old path goes in 0.9 (the names in leanstep itself stay)",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


class _Forward(types.ModuleType):
    """An old module path: every attribute is the new module's."""

    def __init__(self, old: str, new: types.ModuleType) -> None:
        super().__init__(old, new.__doc__)
        self.__dict__["_target"] = new

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_target"], name)

    def __dir__(self) -> list[str]:
        return dir(self.__dict__["_target"])


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name]
        _warn(spec.name, new, stacklevel=2)  # create_module, then the importer
        return _Forward(spec.name, importlib.import_module(new))

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    """Adds the finder once (``import leanstep`` calls this)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def moved_attribute(module: str, name: str) -> Any:
    """A package's ``__getattr__`` for a name that moved elsewhere; AttributeError for any other."""
    new = MOVED_ATTRIBUTES.get((module, name))
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    _warn(f"{module}.{name}", f"{new}.{name}", stacklevel=3)  # the package's __getattr__, then its user
    return getattr(importlib.import_module(new), name)
