"""``leanstep solve``: run a seed contract on JSON input and print JSON output.

Bad input of any kind (an unreadable, non-regular, oversized or non-UTF-8 file, malformed or too
deeply nested JSON, a value that is out of range for the dtype it becomes) raises
:class:`~leanstep.cli.jsontree.InputError`, which ``leanstep`` prints as one line with exit code 2.
A result that overflows float32 in the task's own arithmetic is printed, as ``"inf"`` or ``"nan"``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from importlib import resources
from typing import Any

from leanstep.cli.jsontree import (
    FLOAT32_MAX_TEXT,
    FLOAT32_TINY,
    FLOAT32_TINY_TEXT,
    MAX_ARRAY_DIMS,
    DuplicateKeyError,
    InputError,
    describe,
    dumps,
    float32_number,
    mismatch,
    tree_from_json,
    tree_to_json,
    unique_keys,
)
from leanstep.common.files import read_regular_file


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
    parser.add_argument(
        "task", nargs="?", choices=_task_names(), metavar="TASK", help="one of: " + ", ".join(_task_names())
    )
    parser.add_argument("--list", action="store_true", help="list the task names and exit")
    parser.add_argument(
        "--input",
        metavar="FILE",
        help="read the input JSON from FILE, a regular file of at most 64 MiB (default, or FILE -: standard input)",
    )
    parser.add_argument(
        "--example",
        type=int,
        metavar="N",
        help="run the seed's public example N (1-based) and compare with its expected output",
    )
    parser.set_defaults(run=run)


def load_examples(task: str) -> list[dict[str, Any]]:
    """The seed's public examples of ``task``: a list of ``{"input", "output"}`` dicts."""
    text = resources.files("leanstep").joinpath("examples").joinpath(f"{task}.json").read_text()
    return json.loads(text)["examples"]


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _read_int(value: Any, where: str, kind: str) -> int:
    """An ``"int"`` (>= 1, the task checks that) or ``"count"`` (>= 0) input as a Python int in int32's range.

    Integral floats (``2.0``, ``1e20``) count as integers and are range-checked like them.

    Raises:
      InputError: ``value`` is not an integer (bools, NaN and infinities are not), or lies outside
        ``[minimum, 2147483647]``.
    """
    integral = isinstance(value, int) or isinstance(value, float) and value.is_integer()
    if isinstance(value, bool) or not integral:
        raise InputError(f"{where}: expected an integer, got {describe(value)}")
    number = int(value)
    if kind == "count" and number < 0:
        raise InputError(f"{where} must be an integer >= 0, got {describe(value)}")
    # Within int32, an "int" below its minimum is left to the task, whose own check names it.
    if not _INT32_MIN <= number <= _INT32_MAX:
        minimum = 0 if kind == "count" else 1
        raise InputError(f"{where} must be an integer in [{minimum}, {_INT32_MAX}], got {describe(value)}")
    return number


def _read_scalar(value: Any, where: str, kind: str) -> Any:
    """A ``"scalar"`` (finite) or ``"positive"`` (> 0) input as a ``np.float32``.

    A nonzero scalar that underflows to 0 in float32 is accepted where 0 is (a learning rate);
    a ``"positive"`` one must be a normal float32 (>= 1.1754944e-38), since XLA flushes
    subnormals to 0 and 0 is what it must not be.

    Raises:
      InputError: ``value`` is not a number, is not finite, is out of range for its kind, or rounds
        to infinity (or, for ``"positive"``, below the normal range) in float32.
    """
    import numpy as np

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{where}: expected a number, got {describe(value)}")
    shown = describe(value) if isinstance(value, int) and abs(value) >= 10**20 else repr(float(value))
    # Traced under jit, so the task itself cannot check it: check it here.
    if kind == "positive" and not 0 < value < math.inf:
        raise InputError(f"{where} must be a positive finite number, got {shown}")
    if not -math.inf < value < math.inf:
        raise InputError(f"{where} must be a finite number, got {shown}")
    number = np.float32(float32_number(value, where))
    if kind == "positive" and number < FLOAT32_TINY:
        raise InputError(
            f"{where} must be a normal float32 in [{FLOAT32_TINY_TEXT}, {FLOAT32_MAX_TEXT}] "
            f"(XLA flushes smaller values to 0), got {shown}"
        )
    return number


def parse_input(task: str, data: Any) -> dict[str, Any]:
    """Checks ``data`` against the task's keys and converts each value to what the function takes.

    Raises:
      InputError: a key is missing or unexpected, or a value is not of its kind (see
        :class:`leanstep.tasks.Task`) or not representable in the dtype it becomes.
    """
    expected = _inputs(task)
    if not isinstance(data, dict):
        raise InputError(f"input: expected a JSON object with keys {list(expected)}, got {type(data).__name__}")
    missing = [k for k in expected if k not in data]
    extra = [describe(k) for k in data if k not in expected]
    if missing:
        raise InputError(f"input is missing key(s) {missing}; {task} expects {list(expected)}")
    if extra:
        raise InputError(f"input has unexpected key(s) [{', '.join(extra)}]; {task} expects {list(expected)}")
    args: dict[str, Any] = {}
    for key, kind in expected.items():
        if kind in ("tree", "array"):
            args[key] = tree_from_json(data[key], key)
            if kind == "array" and isinstance(args[key], (dict, list)):
                raise InputError(f"{key}: expected an array (nested list of numbers), got a tree")
        elif kind in ("int", "count"):
            args[key] = _read_int(data[key], key, kind)
        else:
            args[key] = _read_scalar(data[key], key, kind)
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
    source, text = read_input(args.input)
    try:
        data = json.loads(text, object_pairs_hook=unique_keys)
    except DuplicateKeyError as error:
        raise InputError(f"{source}: {error}") from None
    except json.JSONDecodeError as error:
        raise InputError(
            f"malformed JSON in {source}: {error.msg} at line {error.lineno} column {error.colno}"
        ) from None
    except RecursionError:
        raise InputError(
            f"malformed JSON in {source}: it nests too deeply for Python's JSON parser; "
            f"expected arrays of at most {MAX_ARRAY_DIMS} dimensions"
        ) from None
    except ValueError:  # the only other: an integer past Python's digit limit for int(str)
        raise InputError(
            f"malformed JSON in {source}: an integer has more than {sys.get_int_max_str_digits()} digits"
        ) from None
    print(dumps(solve(args.task, data)))
    return 0


#: ``--input`` files larger than this are refused before they are read.
MAX_INPUT_BYTES = 64 * 2**20


def _limit() -> str:
    return f"{MAX_INPUT_BYTES} bytes ({MAX_INPUT_BYTES / 2**20:g} MiB)"


def _shown(name: str) -> str:
    return name if name and name.isprintable() else ascii(name)


def read_input(name: str | None) -> tuple[str, str]:
    """The input text and the name errors call it by: ``--input`` FILE, or standard input for None or ``-``.

    A file is read with :func:`leanstep.common.files.read_regular_file` (a regular file only: a FIFO or
    device would block or never end). At most :data:`MAX_INPUT_BYTES` are read from either source.

    Raises:
      InputError: the file cannot be opened or read (a symlink loop is named as one), is not a
        regular file, is larger than the limit, or is not UTF-8 text.
    """
    if name is None or name == "-":
        source = "standard input"
        if sys.stdin is None:
            raise InputError("--input: standard input is closed; pass --input FILE")
        stream = getattr(sys.stdin, "buffer", sys.stdin)
        try:
            raw = stream.read(MAX_INPUT_BYTES + 1)
        except OSError as error:
            raise InputError(f"--input: cannot read standard input: {error.strerror or error}") from None
    else:
        source = _shown(name)
        try:
            raw = read_regular_file(name, what=f"--input {source}", limit=MAX_INPUT_BYTES)
        except ValueError as error:
            raise InputError(str(error)) from None
    if len(raw) > MAX_INPUT_BYTES:
        raise InputError(f"--input: {source} has more than {MAX_INPUT_BYTES} bytes; the limit is {_limit()}")
    if isinstance(raw, str):
        return source, raw
    try:
        return source, raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(
            f"--input: {source} is not UTF-8 text (byte 0x{raw[error.start]:02x} at offset {error.start})"
        ) from None
