"""``leanstep solve``: run a seed contract on JSON input and print JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from leanstep.cli.jsontree import (
    InputError,
    dumps,
    mismatch,
    tree_from_json,
    tree_to_json,
)


def _task_names() -> list[str]:
    from leanstep.tasks import TASKS

    return sorted(TASKS)


def _inputs(task: str) -> dict[str, str]:
    """Each input key of ``task`` and how to read it (see :class:`leanstep.tasks.Task`)."""
    from leanstep.tasks import TASKS

    return TASKS[task].inputs


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "solve",
        help="run one of the four seed contracts on JSON input",
        description="Reads the task's input as JSON (from --input FILE or standard input), runs it under "
        "jax.jit and prints the output as one line of JSON.",
    )
    parser.add_argument("task", nargs="?", choices=_task_names(), metavar="TASK",
                        help="one of: " + ", ".join(_task_names()))
    parser.add_argument("--list", action="store_true", help="list the task names and exit")
    parser.add_argument("--input", metavar="FILE", help="read the input JSON from FILE (default: standard input)")
    parser.add_argument("--example", type=int, metavar="N",
                        help="run the seed's public example N (1-based) and compare with its expected output")
    parser.set_defaults(run=run)


def load_examples(task: str) -> list[dict[str, Any]]:
    """The seed's public examples of ``task``: a list of ``{"input", "output"}`` dicts."""
    text = resources.files("leanstep").joinpath("examples", f"{task}.json").read_text()
    return json.loads(text)["examples"]


def _read_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise InputError(f"{where}: expected an integer, got {value!r}")
    return int(value)


def _read_scalar(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{where}: expected a number, got {value!r}")
    return float(value)


def parse_input(task: str, data: Any) -> dict[str, Any]:
    """Checks ``data`` against the task's keys and converts each value to what the function takes."""
    import numpy as np

    expected = _inputs(task)
    if not isinstance(data, dict):
        raise InputError(f"input: expected a JSON object with keys {list(expected)}, got {type(data).__name__}")
    missing = [k for k in expected if k not in data]
    extra = [k for k in data if k not in expected]
    if missing:
        raise InputError(f"input is missing key(s) {missing}; {task} expects {list(expected)}")
    if extra:
        raise InputError(f"input has unexpected key(s) {extra}; {task} expects {list(expected)}")
    args: dict[str, Any] = {}
    for key, kind in expected.items():
        if kind == "tree":
            args[key] = tree_from_json(data[key], key)
        elif kind == "array":
            args[key] = tree_from_json(data[key], key)
            if isinstance(args[key], (dict, list)):
                raise InputError(f"{key}: expected an array (nested list of numbers), got a tree")
        elif kind in ("int", "count"):
            args[key] = _read_int(data[key], key)
            if kind == "count" and args[key] < 0:
                raise InputError(f"{key} must be an integer >= 0, got {args[key]}")
        else:
            value = _read_scalar(data[key], key)
            # Traced under jit, so the task itself cannot check it: check it here.
            if kind == "positive" and not 0 < value < float("inf"):
                raise InputError(f"{key} must be a positive finite number, got {value!r}")
            if not -float("inf") < value < float("inf"):
                raise InputError(f"{key} must be a finite number, got {value!r}")
            args[key] = np.float32(value)
    return args


def solve(task: str, data: Any) -> Any:
    """Runs ``task`` under ``jax.jit`` on decoded JSON ``data`` and returns the output as JSON values."""
    import jax
    import numpy as np

    from leanstep.tasks import TASKS

    fn, static = TASKS[task].function, TASKS[task].static
    args = parse_input(task, data)
    if task == "mixed-precision-step":
        args["good_steps"] = np.int32(args["good_steps"])
    try:
        out = jax.jit(fn, static_argnames=static)(**args)
    except (ValueError, TypeError) as error:
        raise InputError(str(error).splitlines()[0]) from None
    return tree_to_json(jax.device_get(out))


def run(args: argparse.Namespace) -> int:
    if args.list:
        for name in _task_names():
            print(name)
        return 0
    if args.task is None:
        raise InputError("solve: a TASK is required (or --list); tasks: " + ", ".join(_task_names()))
    if args.example is not None:
        examples = load_examples(args.task)
        if not 1 <= args.example <= len(examples):
            raise InputError(f"--example: {args.task} has examples 1 to {len(examples)}, got {args.example}")
        example = examples[args.example - 1]
        output = solve(args.task, example["input"])
        difference = mismatch(output, example["output"])
        print("input:    " + dumps(example["input"]))
        print("output:   " + dumps(output))
        print("expected: " + dumps(example["output"]))
        # Rounding both sides to 6 decimals can leave one unit between them.
        if difference <= 1.01:
            print("match: yes, to 6 decimals")
            return 0
        print(f"match: NO, off by {difference:.3g} units of the 6th decimal")
        return 1
    source = args.input or "standard input"
    try:
        text = Path(args.input).read_text() if args.input else sys.stdin.read()
    except OSError as error:
        raise InputError(f"--input: cannot read {source}: {error.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"malformed JSON in {source}: {error.msg} at line {error.lineno} column {error.colno}") from None
    print(dumps(solve(args.task, data)))
    return 0
