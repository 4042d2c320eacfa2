"""What 0.12 removed (issue 42): the 0.7 import paths, the 0.8 keyword shims, and ``leanstep``
reading its own source at import. An old spelling gets leanstep's own TypeError naming the new one;
every public name and command flag of 0.11 still works or gets one message naming its new spelling."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import re
import sys
from pathlib import Path

import pytest

import leanstep
from helpers.public_surface import command_flags, public_names
from leanstep.common.removed import (
    MOVED_KEYWORDS,
    MOVED_NAMES,
    REMOVED_KEYWORDS,
    moved_keyword_error,
    moved_name_message,
    refuses_removed_keywords,
    removed_keyword_error,
)
from leanstep.planning.cluster import plan_cluster
from leanstep.planning.search_options import SearchOptions, SearchSpace
from leanstep.step.spec import SHORT_KEYWORDS

INIT = Path(leanstep.__file__)
FUNCTIONS = {
    "make_train_step": leanstep.make_train_step,
    "gradient_stage": leanstep.step.gradient_stage,
    "plan": leanstep.planning.plan,
    "plan_cluster": plan_cluster,
}
CASES = [(where, old) for where, removed in REMOVED_KEYWORDS.items() for old in sorted(removed)]
#: What 0.11.0 offered by name (tests/helpers/public_surface.py, run on its source): its public names and flags.
SURFACE_0_11 = json.loads((Path(__file__).parent / "helpers" / "surface_0_11.json").read_text())


@pytest.mark.parametrize(("where", "old"), CASES, ids=[f"{w}-{o}" for w, o in CASES])
def test_a_removed_keyword_gets_one_typeerror_naming_its_new_spelling(where, old):
    new = REMOVED_KEYWORDS[where][old]
    want = f"{where}({old}=) was removed in leanstep 0.12 (deprecated in 0.8): pass {new}"
    # Positional arguments are never looked at: the keyword is refused before the function runs.
    with pytest.raises(TypeError) as caught:
        FUNCTIONS[where](*([None] * 4), **{old: 1})
    assert str(caught.value) == want


@pytest.mark.parametrize(("where", "old"), CASES, ids=[f"{w}-{o}" for w, o in CASES])
def test_the_new_spelling_names_a_real_value_and_field(where, old):
    """``pass search=leanstep.planning.SearchOptions(exhaustive=...)``: that class exists and takes that keyword."""
    keyword, module, cls, field = re.fullmatch(
        r"(\w+)=(leanstep(?:\.\w+)?)\.(\w+)\((?:mesh, )?(\w+)=\.\.\.\)", REMOVED_KEYWORDS[where][old]
    ).groups()
    assert keyword in inspect.signature(FUNCTIONS[where]).parameters
    assert cls in importlib.import_module(module).__all__  # a public spelling, which warns about nothing
    assert field in inspect.signature(getattr(importlib.import_module(module), cls)).parameters
    assert old not in inspect.signature(FUNCTIONS[where]).parameters


MOVED = [(where, old) for where, moved in MOVED_KEYWORDS.items() for old in sorted(moved)]
PLACED = [(where, old) for where, old in MOVED if where in ("gradient_stage", "guarded_update")]


@pytest.mark.parametrize(("where", "old"), PLACED, ids=[f"{w}-{o}" for w, o in PLACED])
def test_a_keyword_moved_in_0_12_gets_one_typeerror_saying_what_to_write(where, old):
    """0.11's ``gradient_stage(params_layout=)`` and ``guarded_update(spike_guard=)``: the layout is
    given to each call now, the guard is the state's; the function no longer takes the keyword."""
    function = {"gradient_stage": leanstep.step.gradient_stage, "guarded_update": leanstep.step.guarded_update}[where]
    with pytest.raises(TypeError) as caught:
        function(*([None] * 2), **{old: 1})
    assert str(caught.value) == f"{where}({old}=) was removed in leanstep 0.12: {MOVED_KEYWORDS[where][old]}"
    assert str(moved_keyword_error(where, [old, "loss"])) == str(caught.value)
    assert old not in inspect.signature(function).parameters
    assert moved_keyword_error(where, ["loss"]) is None and str(removed_keyword_error(where, [old])) == str(
        caught.value
    )


def test_the_planners_refuse_every_flat_search_keyword():
    fields = {f.name for cls in (SearchSpace, SearchOptions) for f in dataclasses.fields(cls)} | {"flops_rtol"}
    assert set(REMOVED_KEYWORDS["plan"]) == fields == set(REMOVED_KEYWORDS["plan_cluster"])


BUILDERS = {**FUNCTIONS, "LeanstepStep": leanstep.verification.LeanstepStep}
BUILT = [(where, old) for where, old in MOVED if where in BUILDERS and (where, old) not in PLACED]
assert len(PLACED) + len(BUILT) == len(MOVED)


@pytest.mark.parametrize(("where", "old"), BUILT, ids=[f"{w}-{o}" for w, o in BUILT])
def test_a_step_setting_0_11_gave_a_builder_as_a_keyword_names_the_spec(where, old):
    new = MOVED_KEYWORDS[where][old]
    spelling = f"pass spec=leanstep.StepSpec.from_keywords({old}=...)" if new == "spec" else new
    with pytest.raises(TypeError) as caught:
        BUILDERS[where](*([None] * 3), **{old: 1})
    assert str(caught.value).endswith(f"leanstep 0.12: {spelling}") and str(caught.value).startswith(f"{where}({old}=)")
    assert old not in inspect.signature(BUILDERS[where]).parameters
    if new == "spec":  # the spelling named works: from_keywords takes it
        assert old in SHORT_KEYWORDS and "spec" in inspect.signature(BUILDERS[where]).parameters


def test_the_planners_name_every_short_keyword_of_the_spec():
    # common (below step) keeps its own list: it is make_train_step's, keyword for keyword
    for where in ("plan", "plan_cluster"):
        assert {k for k, new in MOVED_KEYWORDS[where].items() if new == "spec"} == set(SHORT_KEYWORDS)


def test_a_removed_keyword_is_named_before_a_moved_one():
    assert str(removed_keyword_error("plan", ["exhaustive", "precision"])).startswith("plan(exhaustive=) was removed")
    error = removed_keyword_error("LeanstepStep", ["rules", "layer_stack", "precision"])
    assert str(error) == (
        "LeanstepStep(layer_stack=, precision=, rules=) takes its step settings in its spec since leanstep 0.12: "
        "pass spec=leanstep.StepSpec.from_keywords(precision=...); "
        "pass extras=leanstep.verification.ModelExtras(rules=..., layer_stack=...)"
    )


def test_several_removed_keywords_are_named_together_each_new_value_once():
    error = removed_keyword_error("gradient_stage", ["split", "has_aux", "num_microbatches", "precision"])
    assert str(error) == (
        "gradient_stage(has_aux=, num_microbatches=, split=) was removed in leanstep 0.12 (deprecated in 0.8): pass "
        "loss=leanstep.LossContract(has_aux=...) and accumulation=leanstep.Accumulation(num_microbatches=...) and "
        "accumulation=leanstep.Accumulation(split=...)"
    )


def test_the_wrapped_functions_keep_their_signature_without_a_catch_all():
    for where, function in FUNCTIONS.items():
        kinds = [p.kind for p in inspect.signature(function).parameters.values()]
        # make_train_step's short keywords, which StepSpec.from_keywords takes by name (the planners take a spec)
        assert (inspect.Parameter.VAR_KEYWORD in kinds) == (where == "make_train_step"), where
    # Any other unknown keyword is refused too, in Python's words plus the nearest keyword (tests/test_near_misses.py).
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_micro'"):
        leanstep.make_train_step(lambda p, b: 0.0, num_micro=2)


def test_the_wrapper_passes_everything_else_through():
    @refuses_removed_keywords("gradient_stage")
    def stage(*args, **kwargs):
        """Its doc."""
        return args, kwargs

    assert stage(1, precision="bfloat16") == ((1,), {"precision": "bfloat16"})
    assert stage.__doc__ == "Its doc." and stage.__name__ == "stage"


@pytest.mark.parametrize(
    "old", ["leanstep.gradients", "leanstep.checkpoint", "leanstep._checks", "leanstep.plan_records"]
)
def test_the_0_7_import_paths_are_gone(old):
    sys.modules.pop(old, None)
    with pytest.raises(ModuleNotFoundError, match=f"No module named '{re.escape(old)}'"):
        importlib.import_module(old)


def test_import_leanstep_installs_no_import_hook_and_sharding_forwards_nothing():
    assert not [f for f in sys.meta_path if type(f).__module__.startswith("leanstep")]
    for name in ("shard_train_state", "state_shardings"):
        with pytest.raises(AttributeError):
            getattr(leanstep.sharding, name)


def test_leanstep_reads_no_source_at_import():
    """``__init__`` imports only importlib and typing: it no longer opens and parses itself."""
    tree = ast.parse(INIT.read_text())
    imported = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module != "__future__"}
    assert imported == {"importlib", "typing"}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not names & {"open", "__file__", "ast"}


def test_the_0_11_surface_is_0_11s():
    """The file the next two tests read is 0.11.0's: its 87 top-level names and its 7 commands."""
    assert len(SURFACE_0_11["names"]["leanstep"]) == 87 and "plan" in SURFACE_0_11["names"]["leanstep"]
    assert sorted(SURFACE_0_11["flags"]) == ["audit", "bench", "plan", "report", "solve", "train", "verify"]
    assert SURFACE_0_11["flags"]["train"]["--size"] == ["mini", "small", "tiny"]


@pytest.mark.parametrize("package", sorted(SURFACE_0_11["names"]))
def test_every_public_name_of_0_11_works_or_names_its_new_spelling(package):
    exported = public_names().get(package, [])
    for name in SURFACE_0_11["names"][package]:
        if name in exported:
            assert hasattr(importlib.import_module(package), name), f"{package}.{name}"
            continue
        assert package == "leanstep" and name in MOVED_NAMES, f"{package}.{name} of 0.11 is gone without a message"
        with pytest.warns(DeprecationWarning) as caught:
            value = getattr(leanstep, name)
        assert [str(w.message) for w in caught] == [moved_name_message(name)]
        assert value is getattr(importlib.import_module(MOVED_NAMES[name]), name)


@pytest.mark.parametrize("command", sorted(SURFACE_0_11["flags"]))
def test_every_flag_of_0_11_is_still_a_flag_with_each_choice_it_had(command):
    """No table in common/removed.py renames a flag: each of 0.11 is still taken, with each of its choices."""
    flags = command_flags()[command]
    for flag, choices in SURFACE_0_11["flags"][command].items():
        assert flag in flags, f"leanstep {command} {flag} of 0.11 is gone without a message"
        assert set(choices or ()) <= set(flags[flag] or ()) or flags[flag] is None, (command, flag, flags[flag])


def test_the_version_is_read_from_one_place_and_no_moved_name_outlives_its_release():
    """pyproject.toml takes ``leanstep.__version__``; the release it names has removed what was due
    and keeps what goes later (a shim past its date is a defect, STYLE.md)."""
    pyproject = (INIT.parents[2] / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.MULTILINE)
    assert 'version = {attr = "leanstep.__version__"}' in pyproject
    assert not re.search(r'^version = "', pyproject, re.MULTILINE)  # no second, literal version
    version = tuple(int(part) for part in leanstep.__version__.split(".")[:2])
    removed_in = re.search(r"removed in leanstep (\d+)\.(\d+)", str(removed_keyword_error("plan", ["rtol"])))
    goes_in = re.search(r"removed in (\d+)\.(\d+)$", moved_name_message("plan"))
    assert tuple(map(int, removed_in.groups())) <= version < tuple(map(int, goes_in.groups()))
