"""The public API in groups (issue 42): the step and its value at the top of ``leanstep``, the rest in
sub-packages; every name 0.12 moved off the top still works in 0.12 with one warning naming its new
spelling; and ``import leanstep`` stays light."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import leanstep
from leanstep.common.removed import MOVED_NAMES

#: The top level, exactly: the step, the state and what a step returns, the parts a StepSpec is built from.
TOP_LEVEL = {
    "make_train_step",
    "StepSpec",
    "TrainState",
    "StepMetrics",
    "UpdateInfo",
    "Precision",
    "LossContract",
    "Accumulation",
    "DynamicLossScale",
    "StaticLossScale",
    "NoOpLossScale",
    "LossScale",
    "LossScaleSpec",  # StepSpec.loss_scale's type
    "MeshLayout",  # StepSpec.sharding's type
    "SpikeGuard",
    "Fp8Recipe",
    "Int8Recipe",  # StepSpec.int8's type
    "LayerStack",  # the loss StepSpec.update_in_backward takes
}
SUBPACKAGES = {
    "blocks",
    "step",
    "sharding",
    "inspection",
    "verification",
    "planning",
    "checkpoints",
    "compilation",
    "frameworks",
    "models",
    "training",
}
#: How many names ``leanstep.__all__`` held in 0.11: each is now at the top or moved.
NAMES_IN_0_11 = 92


def test_the_top_level_is_the_step_its_value_and_the_sub_packages():
    assert len(set(leanstep.__all__)) == len(leanstep.__all__)
    assert set(leanstep.__all__) == TOP_LEVEL | SUBPACKAGES
    assert set(leanstep._EXPORTS) == TOP_LEVEL and set(leanstep._SUBPACKAGES) == SUBPACKAGES
    assert {name for name in dir(leanstep) if not name.startswith("_")} >= TOP_LEVEL | SUBPACKAGES


def test_every_field_of_a_spec_has_its_type_at_the_top():
    hints = inspect.get_annotations(leanstep.StepSpec, eval_str=True)
    named = {
        t.__name__ for hint in hints.values() for t in (*getattr(hint, "__args__", ()), hint) if inspect.isclass(t)
    }
    assert named - {"Any", "bool", "float", "int", "str", "NoneType"} <= TOP_LEVEL


def test_the_public_names_agree_in_the_imports_the_lazy_tables_and_all():
    tree = ast.parse(Path(leanstep.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    typed = {a.asname or a.name: node.module for node in block.body for a in node.names}
    assert {name: module for name, module in typed.items() if module != "leanstep"} == leanstep._EXPORTS
    assert sorted(name for name, module in typed.items() if module == "leanstep") == sorted(leanstep._SUBPACKAGES)
    assert sorted([*leanstep._EXPORTS, *leanstep._SUBPACKAGES]) == sorted(leanstep.__all__)
    for name, module in leanstep._EXPORTS.items():
        assert getattr(leanstep, name) is getattr(importlib.import_module(module), name), name
    for name in leanstep._SUBPACKAGES:
        assert getattr(leanstep, name) is importlib.import_module(f"leanstep.{name}"), name


def test_all_names_exist_and_are_documented():
    # Sorted as ruff's RUF022 sorts it (constants, classes, functions), which `ruff check` enforces.
    for name in leanstep.__all__:
        obj = getattr(leanstep, name)
        if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj):
            assert inspect.getdoc(obj), f"leanstep.{name} has no docstring"


def test_public_functions_are_annotated():
    for name in leanstep.__all__:
        obj = getattr(leanstep, name)
        if inspect.isfunction(obj) and obj.__module__.startswith("leanstep"):  # not JAX's re-exports
            signature = inspect.signature(obj)
            assert signature.return_annotation is not inspect.Signature.empty, name


def test_the_moved_names_are_the_rest_of_0_11s_and_public_in_their_sub_package():
    assert (
        len(MOVED_NAMES) + len(TOP_LEVEL - {"LossScaleSpec", "MeshLayout", "Int8Recipe", "LayerStack"}) == NAMES_IN_0_11
    )  # (new in 0.12: LossScaleSpec, MeshLayout, Int8Recipe, LayerStack)
    assert not set(MOVED_NAMES) & set(leanstep.__all__)
    assert not set(MOVED_NAMES) & set(dir(leanstep))
    for name, module in MOVED_NAMES.items():
        assert module.removeprefix("leanstep.") in SUBPACKAGES and name in importlib.import_module(module).__all__


@pytest.mark.parametrize("name", sorted(MOVED_NAMES))
def test_a_moved_name_warns_once_naming_its_new_spelling_and_is_the_same_object(name):
    module = MOVED_NAMES[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(leanstep, name)
    assert [(w.category, str(w.message)) for w in caught] == [
        (
            DeprecationWarning,
            f"leanstep.{name} moved to {module}.{name} in 0.12; the top-level name is removed in 0.13",
        )
    ]
    assert caught[0].filename == __file__  # the caller's line, not leanstep's
    assert value is getattr(importlib.import_module(module), name)
    assert name not in vars(leanstep)  # not kept at the top: the next use warns again


def test_a_moved_name_warns_on_every_use_and_in_a_from_import():
    for _ in range(2):
        with pytest.warns(DeprecationWarning, match=r"^leanstep\.plan moved to leanstep\.planning\.plan in 0\.12;"):
            from leanstep import plan
    assert plan is leanstep.planning.plan


def test_an_unknown_name_is_an_attribute_error_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="module 'leanstep' has no attribute 'plans'"):
            leanstep.plans  # noqa: B018
        assert not hasattr(leanstep, "Checkpoint")


def test_import_leanstep_does_not_import_jax():
    """The ``leanstep`` command handles signals and ``--help`` before JAX loads: the top level and
    the moved names' table import nothing heavy."""
    code = (
        "import sys, leanstep\n"
        "dir(leanstep); leanstep.__version__; hasattr(leanstep, 'no_such_name')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'numpy', 'optax')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
