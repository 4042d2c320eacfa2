"""``leanstep solve``: the seeds' JSON in, one line of JSON out, one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from leanstep.cli.jsontree import mismatch
from leanstep.cli.main import main
from leanstep.cli.solve import load_examples
from leanstep.tasks import TASKS


def test_list_names_the_four_tasks(cli):
    code, out, _ = cli("solve", "--list")
    assert code == 0
    assert out.split() == sorted(TASKS)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_example_one_prints_input_output_expected_and_matches(cli, task):
    code, out, err = cli("solve", task, "--example", "1")
    assert code == 0, err
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["input", "output", "expected", "match"]
    output = json.loads(lines[1].split(":", 1)[1])
    assert mismatch(output, load_examples(task)[0]["output"]) <= 1.01
    assert lines[3] == "match: yes, to 6 decimals"


def test_stdin_gives_the_seed_output_as_one_json_line(cli):
    example = load_examples("mixed-precision-step")[2]
    code, out, _ = cli("solve", "mixed-precision-step", stdin=json.dumps(example["input"]))
    assert code == 0
    assert out.count("\n") == 1
    assert json.loads(out) == example["output"]  # 1.5e+38 prints as such, booleans as false
    assert '"grads_finite": false' in out


def test_input_file_and_list_nodes(cli, tmp_path):
    example = load_examples("global-norm-clipping")[2]  # a tree with a list of objects
    path = tmp_path / "in.json"
    path.write_text(json.dumps(example["input"]))
    code, out, _ = cli("solve", "global-norm-clipping", "--input", str(path))
    assert code == 0
    assert json.loads(out) == example["output"]


@pytest.mark.parametrize(
    ("task", "stdin", "message"),
    [
        ("mixed-precision-step", "{not json", "malformed JSON in standard input"),
        ("mixed-precision-step", "[1, 2]", "expected a JSON object"),
        ("gradient-accumulation", '{"params": {}, "x": [[1]], "y": [[1]]}', "missing key(s) ['num_microbatches']"),
        ("checkpointed-residual-block", '{"params": {}, "x": [[1]], "y": [[1]], "z": 1}', "unexpected key(s) ['z']"),
        (
            "checkpointed-residual-block",
            '{"params": {"w1": [[1, 2], [3]]}, "x": [[1]], "y": [[1]]}',
            "rows of different lengths",
        ),
        (
            "checkpointed-residual-block",
            '{"params": {"w1": "a"}, "x": [[1]], "y": [[1]]}',
            "expected a number or a nested list",
        ),
        (
            "checkpointed-residual-block",
            '{"params": {"w1": [[1.0]], "b1": [0.0], "w2": [[1.0]], "b2": [0.0]}, "x": [[1.0, 2.0]], "y": [[1.0]]}',
            "x has shape (1, 2); expected (*, 1)",
        ),
        (
            "gradient-accumulation",
            json.dumps({**load_examples("gradient-accumulation")[0]["input"], "num_microbatches": 3}),
            "batch size 4 is not divisible by num_microbatches=3",
        ),
        (
            "gradient-accumulation",
            json.dumps({**load_examples("gradient-accumulation")[0]["input"], "num_microbatches": 1.5}),
            "num_microbatches: expected an integer",
        ),
        (
            "global-norm-clipping",
            '{"grads": {"w": [1.0]}, "max_norm": -1}',
            "max_norm must be a positive finite number, got -1.0",
        ),
        ("global-norm-clipping", '{"grads": {"w": [true]}, "max_norm": 1}', "grads['w'][0]: expected a number"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_2(cli, task, stdin, message):
    code, out, err = cli("solve", task, stdin=stdin)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert message in err


def test_unknown_task_and_bad_example_number(cli):
    with pytest.raises(SystemExit) as info:
        main(["solve", "no-such-task"])
    assert info.value.code == 2
    code, _, err = cli("solve", "mixed-precision-step", "--example", "4")
    assert code == 2 and "has examples 1 to 3, got 4" in err


def test_missing_input_file(cli, tmp_path):
    code, _, err = cli("solve", "mixed-precision-step", "--input", str(tmp_path / "nope.json"))
    assert code == 2 and "nope.json does not exist" in err


def test_console_script_exits_2_without_a_traceback():
    # A child process: the exit code and stderr of the command itself, as a shell sees them.
    result = subprocess.run(
        [sys.executable, "-m", "leanstep.cli.main", "solve", "gradient-accumulation"],
        input='{"params": 1',
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("leanstep solve: error: malformed JSON")
    assert "Traceback" not in result.stderr
