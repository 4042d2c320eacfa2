"""What a leanstep offers its users by name: each package's ``__all__`` and each command's flags.

``python tests/helpers/public_surface.py > FILE`` writes it as JSON for the leanstep on the path.
tests/helpers/surface_0_11.json is 0.11.0's, written so from its source (``git archive c864286 src``),
for tests/test_removed.py to hold each later release to.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil


def public_names() -> dict[str, list[str]]:
    """``leanstep`` and each of its sub-packages that exports names -> its ``__all__``, sorted."""
    import leanstep

    packages = ["leanstep"] + [f"leanstep.{m.name}" for m in pkgutil.iter_modules(leanstep.__path__) if m.ispkg]
    names = {package: sorted(getattr(importlib.import_module(package), "__all__", ())) for package in packages}
    return {package: exported for package, exported in names.items() if exported}


def command_flags() -> dict[str, dict[str, list[str] | None]]:
    """Each ``leanstep`` command -> its flags (``--help`` aside) -> the values it is limited to, or None."""
    from leanstep.cli.main import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    return {
        command: {
            option: sorted(map(str, action.choices)) if action.choices else None
            for action in parser._actions
            for option in action.option_strings
            if option not in ("-h", "--help")
        }
        for command, parser in commands.items()
    }


if __name__ == "__main__":
    print(json.dumps({"names": public_names(), "flags": command_flags()}, indent=1, sort_keys=True))
