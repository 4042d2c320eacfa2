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
#: Lines as ``ruff format`` lays them out (one argument a line once a call is long), which
#: added a fifth to the modules that had been written to fit 400 denser lines.
MAX_LINES = 500
#: Modules allowed over MAX_LINES, with the reason. Empty: every module fits.
LONG_MODULES: dict[str, str] = {}


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
    """``leanstep.plan`` is the function and nothing else: every submodule is reachable as itself."""
    clashes = []
    for info in pkgutil.walk_packages(leanstep.__path__, "leanstep."):
        module = importlib.import_module(info.name)
        parent_name, _, attr = info.name.rpartition(".")
        if getattr(importlib.import_module(parent_name), attr) is not module:
            clashes.append(info.name)
    assert clashes == []
