"""One place for each rule of a run's configuration (issue 60): who parses ``--mesh``, who resolves
``--precision auto`` and ``--size auto``, who parses ``--spike-rollback``, where the mesh's refusals
are written. Read from the source's syntax trees, so a second copy of a rule fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "leanstep"


def _callers(name: str) -> set[str]:
    """The modules (paths under ``src/leanstep``) that call ``name`` (a function, or ``Class.method``)."""
    owner, _, attribute = name.rpartition(".")
    found = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            function = node.func
            if owner:
                hit = (
                    isinstance(function, ast.Attribute)
                    and function.attr == attribute
                    and isinstance(function.value, ast.Name)
                    and function.value.id == owner
                )
            else:
                hit = (isinstance(function, ast.Name) and function.id == name) or (
                    isinstance(function, ast.Attribute) and function.attr == name
                )
            if hit:
                found.add(str(path.relative_to(SRC)))
    return found


def test_the_mesh_flag_is_parsed_in_one_place():
    # --mesh becomes RunConfig.step's MeshLayout (step/spec_parts.py parses its string form); the CLI and
    # the training read that layout (RunConfig.mesh_shape, cli.flags.mesh_devices). The verification's
    # own lists of layouts (not the flag) are parsed where they are listed.
    callers = _callers("parse_mesh")
    assert "step/spec_parts.py" in callers
    assert {c for c in callers if c.startswith(("cli/", "training/")) and c != "training/verify_run.py"} == set()
    assert _callers("mesh_devices") <= {"cli/flags.py", "cli/train.py"}


def test_precision_and_size_auto_are_resolved_in_one_place():
    assert _callers("resolve_precision") == {"training/machine_size.py"}
    assert _callers("size_for_machine") == {"training/machine_size.py"}
    # the CLI maps flags to RunConfig fields; the library decides what a run is
    assert {c for c in _callers("choose_for_machine") if c.startswith("cli/")} == set()


def test_spike_rollback_is_parsed_into_a_value_once():
    # RunConfig.rollback parses it (run_identity holds the parser to compare what two saved strings mean).
    assert _callers("SpikeRollback.from_string") == {"training/config.py"}


@pytest.mark.parametrize("refusal", ["has_state=True with reduce=", "split='presplit' is not supported with a mesh"])
def test_each_mesh_refusal_is_written_once(refusal):
    written = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if refusal in p.read_text()]
    assert written == ["step/spec.py"]
