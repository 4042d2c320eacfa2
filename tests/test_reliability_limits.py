"""Reliability, second round: counts past int32, numbers past float32, run directories in use, paths.

The catalogue here follows tests/test_reliability_input.py (exit 2, one stderr line naming the
flag, nothing written); the whole catalogue across the reliability files is counted at the end.
A property-based fuzz of ``leanstep train``'s, ``plan``'s and ``report``'s command lines asserts that
no input ends in a traceback, a hang, or an exit code other than 0, 1 or 2.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leanstep.planning.one_device
import leanstep.training
import leanstep.training.curves
from leanstep.cli.main import main
from leanstep.models import build_model
from leanstep.training import RunConfig
from leanstep.training.run_lock import RunLock
from test_reliability_input import CATALOGUE, Case, _t, paths  # noqa: F401 - paths is a fixture

BIG = str(2**31)
_PLAN = ("--model", "mlp", "--size", "tiny", "--budget", "1GiB")
HUGE = "1" + "0" * 40

CASES = [
    # counts past int32: refused where parsed, naming the range
    *[
        Case(
            f"train/{flag.strip('-').replace('-', '_')}_{'huge' if value == HUGE else 'past_int32'}",
            _t(flag, value),
            2,
            f"{flag} must be an integer in [{low}, 2147483647], got {value}",
        )
        for flag, value, low in (
            ("--steps", BIG, 1),
            ("--steps", HUGE, 1),
            ("--batch-size", BIG, 1),
            ("--seq-len", BIG, 1),
            ("--eval-every", BIG, 1),
            ("--eval-batches", BIG, 1),
            ("--checkpoint-every", BIG, 1),
            ("--keep-checkpoints", HUGE, 1),
            ("--max-consecutive-skips", BIG, 1),
            ("--warmup-steps", BIG, 0),
            ("--microbatches", BIG, 1),
            ("--d-model", BIG, 1),
            ("--layers", HUGE, 1),
            ("--stop-at", BIG, 1),
        )
    ],
    Case(
        "train/seed_past_32_bits",
        _t("--seed", str(2**32)),
        2,
        "--seed must be an integer in [0, 4294967295], got 4294967296",
    ),
    Case("train/seed_huge", _t("--seed", HUGE), 2, f"--seed must be an integer in [0, 4294967295], got {HUGE}"),
    Case(
        "train/tokens_per_step_past_int32",
        _t("--batch-size", "65536", "--seq-len", "65536", "--microbatches", "1"),
        2,
        "--batch-size 65536 times --seq-len 65536 is more than 2147483647 tokens per step",
    ),
    Case(
        "train/stop_at_past_steps",
        _t("--steps", "5", "--stop-at", "9"),
        2,
        "--stop-at 9 is past --steps 5: the run would never stop there",
    ),
    # numbers past float32: a setting that would be inf, or a denormal that flushes to zero
    *[
        Case(
            f"train/{flag.strip('-').replace('-', '_')}_{name}",
            _t(flag, value),
            2,
            f"{flag} must be in float32's normal range [1.1754944e-38, 3.4028235e+38]",
        )
        for flag in ("--lr", "--initial-loss-scale", "--max-grad-norm")
        for name, value in (("past_float32", "1e39"), ("denormal", "1e-40"), ("smallest_denormal", "1.4e-45"))
    ],
    Case(
        "train/weight_decay_past_float32",
        _t("--weight-decay", "1e39"),
        2,
        "--weight-decay must be at most 3.4028235e+38 (it becomes a float32), got 1e+39",
    ),
    # the run directory: one writer at a time
    Case(
        "train/out_in_use", _t(out="{locked_run}"), 2, "--out '{locked_run}' is in use by another leanstep train (pid"
    ),
    Case(
        "train/resume_while_in_use",
        _t("--resume", out="{locked_run}"),
        2,
        "--out '{locked_run}' is in use by another leanstep train (pid",
    ),
    Case(
        "plan/node_size_past_int32",
        ("plan", *_PLAN, "--devices", "8", "--node-size", HUGE),
        2,
        f"--node-size must be an integer in [1, 2147483647], got {HUGE}",
    ),
    Case(
        "plan/peak_flops_past_float64",
        ("plan", *_PLAN, "--devices", "8", "--peak-flops", "1e400"),
        2,
        "--peak-flops (Accelerator.flops) must map dtype names to positive FLOP/s",
    ),
    Case(
        "plan/devices_past_int32",
        ("plan", *_PLAN, "--devices", BIG),
        2,
        "--devices must be an integer in [1, 2147483647], got 2147483648",
    ),
    Case(
        "train/run_lock_a_symlink",
        _t(out="{symlinked_lock_run}"),
        1,
        "cannot lock the run directory --out '{symlinked_lock_run}'",
    ),
]


@pytest.fixture(scope="module")
def limits_paths(paths):  # noqa: F811 - the fixture imported above
    p = dict(paths)
    p["locked_run"] = p["tmp"] / "locked_run"
    lock = RunLock(p["locked_run"]).acquire()  # another open file description: flock refuses this process too
    p["symlinked_lock_run"] = p["tmp"] / "symlinked_lock_run"
    p["symlinked_lock_run"].mkdir()
    (p["symlinked_lock_run"] / "run.lock").symlink_to(p["tmp"] / "elsewhere.lock")
    yield p
    lock.release()


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_past_the_limits_gets_a_clear_error(case: Case, limits_paths, capsys):
    names = {k: str(v) for k, v in limits_paths.items()}
    argv = [a.format(**names) for a in case.call]
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    assert (code, captured.out) == (case.expected, "")
    assert captured.err.count("\n") == 1 and captured.err.startswith("leanstep"), captured.err
    assert case.fragment.format(**names) in captured.err
    if "--out" in argv:  # a run refused writes nothing
        out = Path(argv[argv.index("--out") + 1])
        assert not (out / "checkpoints").exists() and not (out / "config.json").exists()


def test_a_model_past_2_31_parameters_draws_no_array_past_int32_indexing(monkeypatch):
    # 2.2e9 parameters, abstractly (no memory). Indexing one draw that large overflowed int32 once
    # run (not under eval_shape, so the test looks at the draws themselves).
    from leanstep.models import layers

    draws, normal = [], jax.random.normal

    def recording(key, shape, *args, **kwargs):
        draws.append(int(np.prod(shape)))
        return normal(key, shape, *args, **kwargs)

    monkeypatch.setattr(layers.jax.random, "normal", recording)
    model = build_model("transformer", "tiny", d_model=8192, d_ff=131072, n_layers=1, n_heads=8)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    assert sum(x.size for x in jax.tree.leaves(shapes)) > 2**31
    assert draws and max(draws) <= 2**31 - 1, draws


def test_init_draws_the_same_numbers_as_one_sliced_draw_and_per_array_past_the_limit(monkeypatch):
    from leanstep.models import layers

    key, specs = jax.random.key(3), {"w": ((2, 3), 0.5), "b": ((4,), 2.0)}
    flat = np.asarray(jax.random.normal(key, (10,), jnp.float32))  # the reference: one draw, sliced in NumPy
    drawn = layers.normal_arrays(key, specs)
    np.testing.assert_array_equal(drawn["w"], 0.5 * flat[:6].reshape(2, 3))
    np.testing.assert_array_equal(drawn["b"], 2.0 * flat[6:])
    monkeypatch.setattr(layers, "_MAX_DRAW", 9)  # as if the model had more than 2**31 - 1 parameters
    drawn = layers.normal_arrays(key, specs)
    keys = jax.random.split(key, 2)
    np.testing.assert_array_equal(drawn["w"], 0.5 * np.asarray(jax.random.normal(keys[0], (2, 3))))
    np.testing.assert_array_equal(drawn["b"], 2.0 * np.asarray(jax.random.normal(keys[1], (4,))))


def test_tilde_means_home_in_every_path_of_a_run(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = RunConfig(out="~/runs/a", data="~/corpus")
    assert config.out == str(tmp_path / "runs/a") and config.data == str(tmp_path / "corpus")
    assert RunConfig(out="runs/~a").out == "runs/~a"  # only a leading ~ is the home directory


def test_the_catalogue_has_250_cases_with_unique_ids():
    import test_reliability_library
    import test_reliability_outputs
    import test_reliability_solve

    cases = [
        *CATALOGUE,
        *CASES,
        *test_reliability_library.CASES,
        *test_reliability_outputs.CASES,
        *test_reliability_solve.CASES,
    ]
    assert len(cases) >= 250, len(cases)
    assert len({c.id for c in cases}) == len(cases)


# --- fuzz: any command line ends in 0, 1 or 2, one line on error, never a traceback or a hang -----

_NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True).map(repr),
    st.sampled_from(
        [
            "0",
            "-0",
            "1e39",
            "1e-45",
            "inf",
            "-inf",
            "nan",
            "",
            " ",
            "0x10",
            "1_0",
            "٣",
            "1e308",
            "4294967296",
            "2147483648",
            "ten",
        ]
    ),
)
_FLAGS = [
    "--steps",
    "--batch-size",
    "--seq-len",
    "--microbatches",
    "--lr",
    "--initial-loss-scale",
    "--max-grad-norm",
    "--weight-decay",
    "--warmup-steps",
    "--seed",
    "--eval-every",
    "--eval-batches",
    "--checkpoint-every",
    "--keep-checkpoints",
    "--max-consecutive-skips",
    "--stop-at",
    "--d-model",
    "--layers",
    "--heads",
    "--d-ff",
    "--devices",
]
_WORDS = st.sampled_from(
    ["--precision", "--remat", "--loss-scale", "--schedule", "--model", "--size", "--mesh", "--reduce"]
)
_TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        [
            "params=bfloat16,compute=bfloat16,output=float32",
            "float32",
            "save:nothing",
            "dots",
            "none",
            "dynamic",
            "static",
            "data=2",
            "data=0",
            "fsdp=-1",
            "1GiB",
            "-1GiB",
            "1e400B",
            "[/red]",
            "~",
        ]
    ),
)


_CODES: list[int] = []  # exit codes the train fuzz saw
_PLAN_CODES: list[int] = []  # ... and the plan fuzz


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    numbers=st.lists(st.tuples(st.sampled_from(_FLAGS), _NUMBERS), max_size=4),
    words=st.lists(st.tuples(_WORDS, _TEXT), max_size=2),
)
def test_fuzz_train_command_lines(numbers, words, tmp_path_factory, capsys, monkeypatch_module):
    root = tmp_path_factory.getbasetemp()
    argv = [
        "train",
        "--model",
        "mlp",
        "--size",
        "tiny",
        "--data",
        str(root / "fuzz-corpus"),
        "--out",
        str(root / "fuzz-run"),
        "--no-progress",
        "--no-chart",
    ]
    for flag, value in [*numbers, *words]:
        argv += [flag, value] if not value.startswith("-") else [f"{flag}={value}"]
    code = _run(argv, capsys)
    assert code in (0, 1, 2)
    _CODES.append(code)


class _Reached(BaseException):
    """Raised where the planner would compile: every check before it has passed."""


def _run(argv: list[str], capsys) -> int:
    signal.alarm(60)  # a hang fails the test instead of the suite
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    except _Reached:
        code = 0
    finally:
        signal.alarm(0)
    captured = capsys.readouterr()
    if code:
        assert captured.err.count("\n") == 1 and captured.err.startswith("leanstep"), (argv, captured.err)
    return code


@pytest.fixture(scope="module")
def monkeypatch_module(tmp_path_factory):
    """Every valid command line stops where training or planning would start (after every check, before
    compiling)."""
    root = tmp_path_factory.getbasetemp()
    corpus = root / "fuzz-corpus"
    corpus.mkdir(exist_ok=True)
    (corpus / "a.py").write_text("print('hello world')\n" * 200)
    mp = pytest.MonkeyPatch()

    def checked_only(config, **kwargs):
        config.validate()
        leanstep.training.trainer.check_out(Path(config.out))
        leanstep.training.data.load_corpus(config.data, seq_len=config.seq_len)
        return {"curves": None}

    mp.setattr(leanstep.training, "train", checked_only)

    def reached(*args, **kwargs):
        raise _Reached

    mp.setattr(leanstep.planning.one_device, "compile_candidate", reached)
    mp.setattr(leanstep.training.curves, "plot_curves", lambda metrics, path, **kwargs: Path(path))
    yield mp
    mp.undo()


_PLAN_FLAGS = st.sampled_from(
    [
        "--budget",
        "--remat-policies",
        "--microbatch-counts",
        "--batch-size",
        "--seq-len",
        "--precision",
        "--max-grad-norm",
        "--d-model",
        "--json",
    ]
)
_PLAN_VALUES = st.one_of(
    _NUMBERS,
    _TEXT,
    st.sampled_from(
        [
            "64MiB",
            "0B",
            "1e30GiB",
            "-5MiB",
            "1,2",
            "0,1",
            "2,2",
            "dots,none",
            "save:x",
            "",
            "nothing,dots",
            "{tmp}/p.json",
            "{tmp}",
            "{tmp}/missing/p.json",
            "/dev/null/x.json",
        ]
    ),
)


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(flags=st.lists(st.tuples(_PLAN_FLAGS, _PLAN_VALUES), max_size=4))
def test_fuzz_plan_command_lines(flags, tmp_path_factory, capsys, monkeypatch_module):
    root = tmp_path_factory.getbasetemp()
    argv = ["plan", "--model", "mlp", "--size", "tiny", "--budget", "64MiB"]
    for flag, value in flags:
        value = value.replace("{tmp}", str(root))
        argv += [flag, value] if not value.startswith("-") else [f"{flag}={value}"]
    code = _run(argv, capsys)
    assert code in (0, 1, 2)
    _PLAN_CODES.append(code)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    metrics=st.one_of(
        st.binary(max_size=200),
        st.lists(
            st.dictionaries(
                st.sampled_from(
                    [
                        "kind",
                        "step",
                        "loss",
                        "grad_norm",
                        "loss_scale",
                        "skipped",
                        "clipped",
                        "consecutive_skips",
                        "tokens_per_sec",
                        "elapsed_s",
                        "lr",
                        "heldout_loss",
                        "heldout_bits_per_byte",
                    ]
                ),
                st.one_of(
                    st.none(),
                    st.booleans(),
                    st.integers(-(2**70), 2**70),
                    st.floats(),
                    st.text(max_size=5),
                    st.sampled_from(["train", "eval"]),
                ),
            ),
            max_size=4,
        ).map(lambda rows: "\n".join(json.dumps(r) for r in rows).encode()),
    ),
    config=st.one_of(st.none(), st.binary(max_size=50), st.sampled_from([b"{}", b"[]", b'{"run": 1}'])),
)
def test_fuzz_report_of_any_run_directory(metrics, config, tmp_path_factory, capsys, monkeypatch_module):
    run = tmp_path_factory.mktemp("fuzz-report")
    (run / "metrics.jsonl").write_bytes(metrics)
    if config is not None:
        (run / "config.json").write_bytes(config)
    assert _run(["report", str(run)], capsys) in (0, 1, 2)


def test_the_fuzzes_reached_both_valid_and_refused_command_lines():
    assert 0 in _CODES and 2 in _CODES, _CODES  # runs after the fuzzes (file order)
    assert 0 in _PLAN_CODES and 2 in _PLAN_CODES, _PLAN_CODES
