"""The README and the documentation site say what is true: their examples run, their commands exist.

- Every ```python block of README.md and docs/**/*.md runs: a page's blocks in order, in one
  namespace, each page one test. A block that cannot run in seconds on a 2-core laptop is shown
  as ```bash or ```text instead.
- Shell blocks are not run, but every ``leanstep ...`` command line in them (and in inline code)
  parses with the CLI's own parser, every ``python -m`` module exists, and every test file they
  name exists.
- docs/architecture.md names every module of src/leanstep and has a section per sub-package.
- The README is short, and its Quickstart is the two commands CI runs.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PACKAGE = REPO / "src" / "leanstep"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]

# A fence at the start of a line, its info string, its body, and the closing fence.
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
LANGUAGES = {"python", "bash", "text"}
SHELL_OPERATORS = {"&&", "||", ";", "|", "&"}

QUICKSTART = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && leanstep train",
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && python -m pytest -q',
)


def name_of(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def blocks(page: Path) -> list[tuple[str, int, str]]:
    """``(language, first line number of the body, body)`` of every fenced block of ``page``."""
    text = page.read_text()
    return [
        (match.group(1).strip(), text.count("\n", 0, match.start(2)) + 1, match.group(2))
        for match in FENCE.finditer(text)
    ]


def inline_code(page: Path) -> list[str]:
    """The inline code spans of ``page``, outside its fenced blocks."""
    return re.findall(r"`([^`\n]+)`", FENCE.sub("", page.read_text()))


def split_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line, as argument lists (comments and operators removed)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands, command = [], []
    for token in [*lexer, ";"]:
        if token in SHELL_OPERATORS:
            if command:
                commands.append(command)
            command = []
        else:
            command.append(token)
    return commands


def shell_commands(page: Path) -> list[list[str]]:
    """Every simple command of the page's bash blocks."""
    commands = []
    for language, _, body in blocks(page):
        if language == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                commands += split_commands(line)
    return commands


def inline_commands(page: Path) -> list[list[str]]:
    """Inline code that starts with ``leanstep `` or ``python -m `` (without placeholders like ``<name>``)."""
    spans = [span for span in inline_code(page) if span.startswith(("leanstep ", "python -m ")) and "<" not in span]
    return [command for span in spans for command in split_commands(span)]


def python_pages() -> list[Path]:
    return [page for page in PAGES if any(language == "python" for language, _, _ in blocks(page))]


def test_the_docs_exist_and_have_examples():
    assert (DOCS / "index.md").is_file() and (DOCS / "architecture.md").is_file()
    assert len(python_pages()) >= 8


@pytest.mark.parametrize("page", PAGES, ids=name_of)
def test_every_block_names_its_language_and_none_hides(page):
    """A ```py or ```python3 block would escape the examples' test; an indented fence too."""
    for language, line, _ in blocks(page):
        assert language in LANGUAGES, f"{name_of(page)}:{line - 1}: a ```{language} block; use one of {LANGUAGES}"
    indented = re.findall(r"^[ \t]+```", page.read_text(), re.MULTILINE)
    assert not indented, f"{name_of(page)}: an indented fence is not checked; put it at the start of a line"


@pytest.mark.parametrize("page", python_pages(), ids=name_of)
def test_python_blocks_run(page):
    namespace: dict = {"__name__": "__docs__"}
    for language, line, body in blocks(page):
        if language == "python":
            # Padded so that a traceback's line numbers are the page's.
            exec(compile("\n" * (line - 1) + body, str(page), "exec"), namespace)
    if page == README:  # the train step trains
        assert float(namespace["metrics"].loss) < 1.0 and not bool(namespace["metrics"].skipped)
    if page.name == "frameworks.md":  # the last of the three trained an Equinox MLP
        assert not bool(namespace["metrics"].skipped) and float(namespace["metrics"].loss) >= 0
        assert type(namespace["model"]).__name__ == "MLP"


def test_quickstart_is_two_commands_and_ci_runs_the_second():
    quickstart = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", quickstart, re.DOTALL)
    assert tuple(commands) == QUICKSTART
    ci = (REPO / ".ci" / "run").read_text()
    assert commands[1].split("&& ", 2)[2] in ci  # the install-and-test part, after the venv step


def test_ci_builds_the_docs_strictly():
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"pip install .*\[[\w,]*docs", ci)
    assert "mkdocs build --strict" in ci


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 200


def test_readme_links_resolve():
    for link in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", README.read_text()):
        if not re.match(r"[a-z]+:", link):
            assert (REPO / link).exists(), f"README.md links to {link}, which does not exist"


def test_every_docs_page_is_in_the_nav():
    config = (REPO / "mkdocs.yml").read_text()
    for page in DOCS.rglob("*.md"):
        assert page.relative_to(DOCS).as_posix() in config, f"{name_of(page)} is not in mkdocs.yml's nav"


def command_pages() -> list[Path]:
    return [page for page in PAGES if any(c[0] == "leanstep" for c in shell_commands(page) + inline_commands(page))]


@pytest.mark.parametrize("page", command_pages(), ids=name_of)
def test_leanstep_commands_parse(page, capsys):
    """A command line of a shell block parses whole; inline code such as ``leanstep plan --budget``
    (a flag named in prose) names a subcommand and flags it has."""
    from leanstep.cli.main import build_parser

    for command in shell_commands(page):
        if command[0] == "leanstep":
            try:
                build_parser().parse_args(command[1:])
            except SystemExit as exit:
                pytest.fail(f"{name_of(page)}: `{shlex.join(command)}` exits {exit.code}: {capsys.readouterr().err}")
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command in inline_commands(page):
        if command[0] == "leanstep":
            assert command[1] in subcommands, f"{name_of(page)}: `{shlex.join(command)}`: no subcommand {command[1]}"
            flags = subcommands[command[1]]._option_string_actions
            unknown = [arg for arg in command[2:] if arg.startswith("-") and arg.split("=")[0] not in flags]
            assert not unknown, f"{name_of(page)}: `{shlex.join(command)}`: leanstep {command[1]} has no {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=name_of)
def test_python_modules_and_test_files_exist(page):
    for command in shell_commands(page) + inline_commands(page):
        if command[0] in ("python", "python3") and "-m" in command:
            module = command[command.index("-m") + 1]
            if module.startswith("benchmarks."):  # run from the repository root, outside the wheel
                path = REPO / Path(*module.split(".")).with_suffix(".py")
                assert path.is_file(), f"{name_of(page)}: python -m {module}: no {path.relative_to(REPO)}"
            else:
                assert importlib.util.find_spec(module) is not None, f"{name_of(page)}: python -m {module}"
    text = page.read_text()
    for pattern in sorted(set(re.findall(r"tests/[\w*/]+\.py", text))):
        assert list(REPO.glob(pattern)), f"{name_of(page)} names {pattern}, which matches no file"
    for module in sorted(set(re.findall(r"(?<![\w/-])benchmarks\.(\w+)", text))):
        assert (REPO / "benchmarks" / f"{module}.py").is_file(), f"{name_of(page)} names benchmarks.{module}"


def modules() -> list[str]:
    """Every module of src/leanstep by dotted name, a package by its own name."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_architecture_names_every_module():
    text = (DOCS / "architecture.md").read_text()
    missing = [name for name in modules() if f"`{name}`" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_architecture_has_a_section_per_sub_package():
    headings = [line for line in (DOCS / "architecture.md").read_text().splitlines() if line.startswith("#")]
    for folder in sorted(path.parent for path in PACKAGE.glob("*/__init__.py")):
        name = f"`leanstep.{folder.name}`"
        assert any(name in heading for heading in headings), f"docs/architecture.md has no section for {name}"


def test_architecture_names_only_modules_that_exist():
    """The first column of its module tables: a renamed or removed module leaves no stale row."""
    known = set(modules())
    rows = re.findall(r"^\| `(leanstep[\w.]*)` \|", (DOCS / "architecture.md").read_text(), re.MULTILINE)
    assert rows and not sorted(set(rows) - known)


def unit_of(module: str) -> str:
    """The part of leanstep ``module`` belongs to: its sub-package, or the top-level module itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def imports_by_unit() -> dict[str, set[str]]:
    """For each sub-package and top-level module, the other parts of leanstep it imports (lazy imports too)."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        unit = unit_of(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        targets = found.setdefault(unit, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {unit_of(alias.name) for alias in node.names if alias.name.startswith("leanstep")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("leanstep"):
                if node.module == "leanstep":  # from leanstep import _moved
                    names = {f"leanstep.{alias.name}" for alias in node.names}
                    targets |= names & set(modules())
                else:
                    targets.add(unit_of(node.module))
        targets.discard(unit)
    return found


def test_architecture_dependency_table_is_the_imports():
    section = (DOCS / "architecture.md").read_text().split("## Dependency order", 1)[1]
    table = {
        name: set() if imports == "nothing" else set(re.findall(r"`([\w.]+)`", imports))
        for name, imports in re.findall(r"^\| `([\w.]+)` \| (.+?) \|$", section, re.MULTILINE)
    }
    assert table == imports_by_unit(), "docs/architecture.md's dependency table differs from the imports"
