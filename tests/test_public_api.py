"""The public API: every name in ``__all__`` is importable from ``leanstep`` and documented."""

import inspect

import leanstep


def test_all_names_exist_and_are_documented():
    # Sorted as ruff's RUF022 sorts it (constants, classes, functions), which `ruff check` enforces.
    assert len(set(leanstep.__all__)) == len(leanstep.__all__)
    for name in leanstep.__all__:
        obj = getattr(leanstep, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert inspect.getdoc(obj), f"leanstep.{name} has no docstring"


def test_public_functions_are_annotated():
    for name in leanstep.__all__:
        obj = getattr(leanstep, name)
        if inspect.isfunction(obj) and obj.__module__.startswith("leanstep"):  # not JAX's re-exports
            signature = inspect.signature(obj)
            assert signature.return_annotation is not inspect.Signature.empty, name
