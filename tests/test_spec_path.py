"""The path of ``--fp8`` and ``--moments`` from the command line to the traced step (issue 42: at
most 8 files, and no return to a file already left).

The path is traced, not listed: ``leanstep train``'s own code runs (the parser, ``run_train``,
``RunConfig``, ``train`` up to the step, ``build_run``, the state and the step traced on stand-ins;
``_train_locked`` is replaced by that trace, so nothing trains) under :func:`sys.setprofile`, which
records each call into leanstep's source that receives the value itself as an argument: the flag's
string (a fresh object, so that identity follows it: nothing else is that object), then what a call
that received it returned as the parsed value (an ``Fp8Recipe``). A hand-off is the edge from the
nearest leanstep frame of the caller to the callee's file. Only the value is followed, not the
objects that carry it (the argument namespace, ``RunConfig``, ``StepSpec``, ``Run``): every helper
that receives a config would count otherwise (``check_run``, ``check_state_fits``, ...), though it
never reads the flag; so a file that only hands a carrier on (``cli/flags.py``'s namespace,
``cli/train.py``, ``trainer.py``) is not on the traced path: counted with them, ``--fp8`` crosses
10 files and ``--moments`` 8 (``build.py`` hands the spec to ``TrainState.create``), neither returning.

Where JAX calls back what a file built with the value (a ``custom_vjp`` rule, an optimizer's
``init`` under ``eval_shape``), the hand-off is that file's own. A file that reads the value from
its carrier (``spec.fp8``) is a reader; a reader again after a later one has read is a return.

A return is a hand-off into a file the path had left: an edge ``A -> B`` where ``B`` was reached
before ``A``. Before issue 42's fourth round ``build.py`` handed the FP8 string back to
``config.py`` (``model_overrides`` parsed it a second time): that edge fails this test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import leanstep
from leanstep.blocks.fp8 import Fp8Recipe

SRC = Path(leanstep.__file__).resolve().parent


def _is_jax(frame) -> bool:
    name = frame.f_code.co_filename
    return any(f"{sep}{package}{sep}" in name for package in ("jax", "optax") for sep in "/\\")


class _Traced(Exception):
    """Raised where the run would start stepping: the step has been traced."""


def _trace_the_step(setup):
    run = setup.run
    run.make_step(mesh=setup.mesh).trace(run.abstract_state(), run.batch_spec())
    raise _Traced


def _handoffs(argv: list[str], value: str, parsed: type | None, monkeypatch, tmp_path) -> list[tuple[str, str, str]]:
    """The hand-offs of ``value`` (given as ``argv``'s flag) in ``leanstep train``, in call order."""
    from leanstep.cli.main import build_parser
    from leanstep.training import trainer

    monkeypatch.setattr(trainer, "_train_locked", _trace_the_step)
    args = build_parser().parse_args(["train", *argv, "--out", str(tmp_path / "run")])
    dest = next(argv[i][2:] for i in range(len(argv) - 1) if argv[i + 1] == value)
    token = "".join(list(value))  # a fresh str, not interned: identity follows it
    assert token == getattr(args, dest) and token is not getattr(args, dest)
    setattr(args, dest, token)
    tracked: dict[int, object] = {id(token): token}
    receivers: set[int] = set()
    edges: list[tuple[str, str, str]] = []

    def leanstep_file(frame) -> str | None:
        name = frame.f_code.co_filename
        return str(Path(name).relative_to(SRC)) if name.startswith(str(SRC)) else None

    def holds(frame) -> bool:
        # The value as an argument, or inside one directly (a ``**kwargs`` dict): not as ``self``
        # (the value's own methods are the value at work, not a hand-off).
        for name, v in frame.f_locals.items():
            inside = v.values() if isinstance(v, dict) else v if isinstance(v, (tuple, list)) else ()
            if name != "self" and (id(v) in tracked or any(id(x) in tracked for x in inside)):
                return True
        return False

    def profile(frame, event, arg):
        if event == "call":
            here = leanstep_file(frame)
            if here is None or not holds(frame):
                return
            receivers.add(id(frame))
            caller, nearest, through_jax = frame.f_back, None, False
            while caller is not None and id(caller) not in receivers:
                through_jax = through_jax or (nearest is None and _is_jax(caller))
                nearest = nearest or (caller if leanstep_file(caller) else None)
                caller = caller.f_back
            if caller is not None:  # handed on by a frame that received it
                edges.append((leanstep_file(caller), here, "handed"))
            elif through_jax:  # JAX calling back what this file built with it (a custom rule, a scan's body)
                edges.append((here, here, "handed"))
            else:  # read from what carries it (a config, a spec, a model's config)
                edges.append((leanstep_file(nearest) if nearest is not None else "<cli>", here, "read"))
        elif event == "return" and id(frame) in receivers:
            receivers.discard(id(frame))
            if parsed is not None and isinstance(arg, parsed):
                tracked[id(arg)] = arg  # kept alive in tracked: its id is not reused

    sys.setprofile(profile)
    try:
        with pytest.raises(_Traced):
            args.run(args)
    finally:
        sys.setprofile(None)
    return edges


def _path(edges: list[tuple[str, str, str]]) -> tuple[list[str], list[tuple[str, str]]]:
    """The files in the order the value reached them, and the returns: a hand-off into a file
    reached before the file handing it on, or a file reading the value from its carrier again
    after a later file has read it."""
    order: list[str] = []
    for caller, callee, _ in edges:
        for name in (caller, callee):
            if name != "<cli>" and name not in order:
                order.append(name)
    back = {(a, b) for a, b, _ in edges if a != "<cli>" and order.index(b) < order.index(a)}
    readers = [a for a, _, how in edges if how == "read"]
    readers = [a for i, a in enumerate(readers) if i == 0 or readers[i - 1] != a]
    again = {(readers[i - 1], a) for i, a in enumerate(readers) if a in readers[:i]}
    return order, sorted(back | again)


TINY = ["--model", "transformer", "--size", "tiny", "--batch-size", "4", "--seq-len", "8", "--microbatches", "2"]
TINY += ["--steps", "2", "--precision", "float32", "--no-progress", "--no-chart"]


@pytest.mark.parametrize(
    ("flag", "value", "parsed", "expected"),
    [
        (
            "--fp8",
            "delayed,history=4",
            Fp8Recipe,
            [
                "training/config.py",  # RunConfig: the flags parsed once into its StepSpec
                "step/spec.py",  # the spec's check of its fp8 field
                "blocks/fp8.py",  # Fp8Recipe.from_string: the one parse
                "training/build.py",  # build_run: the model built with spec.fp8
                "models/registry.py",
                "models/transformer.py",
                "blocks/fp8_dot.py",  # the matmuls of the traced step
            ],
        ),
        ("--moments", "bfloat16", None, ["training/config.py", "step/spec.py", "step/state.py", "blocks/moments.py"]),
        # TrainState.create reads spec.moments; the step's update reads the moments' format from
        # the optimizer moments.py built (through JAX: no hand-off).
    ],
)
def test_a_step_flag_reaches_the_step_through_at_most_8_files_and_never_returns(
    flag, value, parsed, expected, monkeypatch, tmp_path
):
    edges = _handoffs([*TINY, flag, value], value, parsed, monkeypatch, tmp_path)
    order, returns = _path(edges)
    assert returns == [], f"{flag} is handed back to a file it had left: {returns} (path {order})"
    assert len(order) <= 8, order
    assert order == expected
