"""The house rules of ../shared/STYLE.md, checked on the source so that they keep holding.

Read from the files with ``ast`` (imports inside functions count: a cycle hidden by a lazy
import is still a cycle), plus one import of every module to see what each name is bound to.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import leanstep

SRC = Path(leanstep.__file__).resolve().parent
#: Lines of a module, as ``ruff format`` lays it out.
MAX_LINES = 400
#: Lines above which a module's docstring says why it is one module (a ``Size:`` paragraph).
EXPLAINED_LINES = 350
#: Modules allowed over MAX_LINES, with the reason. Empty: every module fits.
LONG_MODULES: dict[str, str] = {}
#: Lines of a function's body, its docstring left out (a nested function's lines count in it too).
MAX_FUNCTION_LINES = 80
#: Parameters of a function (``self``/``cls`` left out; ``*args`` and ``**kwargs`` one each).
MAX_PARAMETERS = 12
#: Functions allowed more parameters, with the reason. Empty: every function fits (a step setting
#: travels in the StepSpec, so no builder re-spells them).
MANY_PARAMETERS: dict[str, str] = {}
#: What library code may pass make_train_step beside the loss and the spec: where and how it runs.
STEP_BUILDER_KEYWORDS = ("mesh", "jit")
#: The sub-packages, each with the sub-packages it may import: the architecture, bottom up.
#: ``leanstep`` is the package itself (its ``__init__``: the public API) and ``tasks`` the seeds.
LAYERS: dict[str, set[str]] = {
    "common": set(),
    "blocks": {"common"},
    "sharding": {"common"},
    "compilation": {"common"},
    "checkpoints": {"common"},
    "step": {"common", "blocks", "sharding"},
    "inspection": {"common", "blocks"},
    "planning": {"common", "blocks", "sharding", "step", "inspection"},
    # verify takes plan's inputs (a params builder per remat policy): planning.plan_inputs reads them
    "verification": {"common", "blocks", "sharding", "step", "inspection", "planning"},
    "models": {"common", "blocks", "sharding"},
    "frameworks": {"common", "blocks", "step"},
    "tasks": {"common", "blocks"},
    "training": {
        "common",
        "blocks",
        "sharding",
        "step",
        "inspection",
        "planning",
        "checkpoints",
        "compilation",
        "models",
        "verification",
    },
    "bench": {"common", "blocks", "sharding", "step", "inspection", "checkpoints", "models", "frameworks", "training"},
    "cli": set(),  # filled below: anything but itself
    # the package's own __init__: the top-level names, the sub-packages as attributes, the moved names' table
    "leanstep": {
        "common",
        "blocks",
        "sharding",
        "compilation",
        "checkpoints",
        "step",
        "inspection",
        "planning",
        "verification",
        "models",
        "frameworks",
        "training",
    },
}
LAYERS["cli"] = set(LAYERS) - {"cli", "leanstep"}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(SRC.rglob("*.py"))}


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """``(module, names, line)`` for every import of a leanstep module in ``path``, lazy ones included."""
    found = []
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names if alias.name.startswith("leanstep")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if base.startswith("leanstep"):
                names = [alias.name for alias in node.names]
                # ``from leanstep.cli import plan`` imports the module leanstep.cli.plan.
                submodules = [f"{base}.{name}" for name in names if f"{base}.{name}" in MODULES]
                found += [(sub, [], node.lineno) for sub in submodules]
                found.append((base, [n for n in names if f"{base}.{n}" not in MODULES], node.lineno))
    return found


def graph() -> dict[str, set[str]]:
    return {
        name: {target for target, _, _ in imports(path) if target in MODULES and target != name}
        for name, path in MODULES.items()
    }


def test_the_checks_see_the_package():
    assert len(MODULES) > 40 and "leanstep.step.train_step" in MODULES and "leanstep.training.trainer" in MODULES
    assert "leanstep.step.state" in graph()["leanstep.step.train_step"]


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph (package ``__init__`` modules left out: importing ``a.b`` runs ``a``), or None."""
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    edges = {a: {b for b in targets if b not in packages} for a, targets in edges.items() if a not in packages}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder_finds_a_planted_cycle():
    edges = graph()
    assert (
        find_cycle({**edges, "leanstep.step.state": edges["leanstep.step.state"] | {"leanstep.step.train_step"}})
        is not None
    )


def test_no_import_cycle():
    assert find_cycle(graph()) is None


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES or name in LONG_MODULES, f"{name} has {lines} lines; split it (or say why here)"
    doc = ast.get_docstring(ast.parse(MODULES[name].read_text())) or ""
    assert lines <= EXPLAINED_LINES or any(p.startswith("Size: ") for p in doc.split("\n\n")), (
        f"{name} has {lines} lines: split it by concern, or say in a 'Size: ' paragraph of its docstring why it is one"
    )


def functions(path: Path) -> list[tuple[str, int, int]]:
    """``(qualified name, body lines without the docstring, parameters)`` of every function in ``path``."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = child.body
                has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                first = body[1] if has_doc and len(body) > 1 else body[0]
                lines = 0 if has_doc and len(body) == 1 else child.end_lineno - first.lineno + 1
                args = child.args
                named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
                count = len(named) + (args.vararg is not None) + (args.kwarg is not None)
                count -= bool(named) and named[0].arg in ("self", "cls") and isinstance(node, ast.ClassDef)
                found.append((f"{prefix}{child.name}", lines, count))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return found


def test_the_function_checks_count_what_they_say():
    source = 'def f(self, a, *b, c, **d):\n    """Doc."""\n    x = 1\n    return x\nclass C:\n    def m(self, a):\n        pass\n'
    path = Path(pytest.importorskip("tempfile").mkdtemp()) / "probe.py"
    path.write_text(source)
    assert functions(path) == [("f", 2, 5), ("C.m", 1, 1)]


def test_no_function_is_too_long():
    long = [
        f"{name}.{function} has {lines} lines"
        for name, path in MODULES.items()
        for function, lines, _ in functions(path)
        if lines > MAX_FUNCTION_LINES
    ]
    assert long == [], f"split these (at most {MAX_FUNCTION_LINES} lines, docstring excluded)"


def test_no_function_takes_too_many_parameters():
    many = [
        f"{name}.{function} takes {count}"
        for name, path in MODULES.items()
        for function, _, count in functions(path)
        if count > MAX_PARAMETERS and f"{name}.{function}" not in MANY_PARAMETERS
    ]
    assert many == [], f"group these into values (at most {MAX_PARAMETERS} parameters)"


def settings_given_as_keywords(source: str) -> list[str]:
    """``line: keywords`` of each ``make_train_step(...)`` call in ``source`` that passes step settings
    as keywords (``**kwargs`` among them) instead of a StepSpec."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        keywords = [k.arg or "**" for k in node.keywords if k.arg not in STEP_BUILDER_KEYWORDS]
        if called == "make_train_step" and keywords:
            found.append(f"{node.lineno}: {', '.join(keywords)}")
    return found


def test_the_settings_check_finds_planted_keywords():
    planted = (
        "step = make_train_step(loss, precision='bfloat16', mesh=m)\nother = leanstep.make_train_step(loss, **kw)\n"
    )
    assert settings_given_as_keywords(planted) == ["1: precision", "2: **"]
    assert settings_given_as_keywords("step = make_train_step(loss, spec, mesh=layer, jit=False)\n") == []


def test_library_code_builds_its_steps_from_a_spec():
    """``make_train_step(loss, **short)`` is the user's one-line form; the library passes a StepSpec."""
    benchmarks = SRC.parent.parent / "benchmarks"  # the contenders too, where the checkout has them
    paths = [*MODULES.values(), *(sorted(benchmarks.glob("*.py")) if benchmarks.is_dir() else [])]
    offenders = [f"{path.name}:{call}" for path in paths for call in settings_given_as_keywords(path.read_text())]
    assert offenders == []


def test_no_step_kwargs_in_the_library():
    """The step's settings travel as one value: no ``**step_kwargs`` handed from layer to layer."""
    assert [name for name, path in MODULES.items() if "step_kwargs" in path.read_text()] == []


def subpackage(module: str) -> str:
    """``leanstep.step.gradients`` -> ``step``; ``leanstep`` -> ``leanstep``; ``leanstep.tasks`` -> ``tasks``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "leanstep"


def test_every_module_is_in_a_layer():
    assert {subpackage(name) for name in MODULES} == set(LAYERS)


def test_the_layers_are_a_hierarchy():
    assert find_cycle({f"leanstep.{a}": {f"leanstep.{b}" for b in deps} for a, deps in LAYERS.items()}) is None


def boundary_crossings(edges: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} imports {b}"
        for a, targets in edges.items()
        for b in targets
        if subpackage(a) != subpackage(b) and subpackage(b) not in LAYERS[subpackage(a)]
    )


def test_sub_packages_import_only_the_layers_below_them():
    assert boundary_crossings(graph()) == []


def test_the_boundary_check_finds_a_planted_crossing():
    edges = graph()
    planted = {**edges, "leanstep.common.checks": {"leanstep.step.state"}}
    assert boundary_crossings(planted) == ["leanstep.common.checks imports leanstep.step.state"]


def test_no_private_module_is_imported_across_sub_packages():
    crossings = [
        f"{name}:{line} imports {target}"
        for name, path in MODULES.items()
        for target, _, line in imports(path)
        if any(part.startswith("_") for part in target.split(".")) and subpackage(name) != subpackage(target)
    ]
    assert crossings == []


def test_no_private_name_crosses_a_module_boundary():
    crossings = [
        f"{name}:{line} imports {target}.{n}"
        for name, path in MODULES.items()
        for target, names, line in imports(path)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert crossings == []


def test_the_library_never_imports_the_cli_or_rich():
    offenders = []
    for name, path in MODULES.items():
        if name.startswith("leanstep.cli"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [
                f"{name} imports {m}"
                for m in modules
                if m in ("leanstep.cli", "rich") or m.startswith(("leanstep.cli.", "rich."))
            ]
    assert offenders == []


def test_no_name_is_both_a_module_and_something_else():
    """``leanstep.planning.plan`` is the function and nothing else: every submodule is reachable as itself."""
    clashes = []
    for info in pkgutil.walk_packages(leanstep.__path__, "leanstep."):
        module = importlib.import_module(info.name)
        parent_name, _, attr = info.name.rpartition(".")
        if getattr(importlib.import_module(parent_name), attr) is not module:
            clashes.append(info.name)
    assert clashes == []
