"""``leanstep train --fp8`` (and ``--master``/``--moments``): the built-in transformer as a run.

A killed (SIGKILL) and resumed run ends bit-identical to an uninterrupted one, FP8 state
included; the recipe is recorded and must match on ``--resume``; settings that cannot work are
refused naming ``--fp8``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import leanstep
from helpers.tiny_runs import QUIET, TINY_TRANSFORMER
from leanstep.blocks.fp8_state import fp8_leaves
from leanstep.training import RunConfig, build_run

FLAGS = [*TINY_TRANSFORMER, "--eval-every", "100", "--eval-batches", "1"]
FLAGS += [*QUIET, "--checkpoint-every", "3", "--keep-checkpoints", "10", "--steps", "12"]
FP8 = "delayed,history=4"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    (root / "a.py").write_bytes((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_bytes())
    return root


def _argv(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["train", *FLAGS, "--data", str(corpus), "--out", str(out), *extra]


def _command(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "leanstep.cli.main", *_argv(corpus, out, *extra)]


def _env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _final_state(run: Path):
    config = RunConfig(
        **{
            k: v
            for k, v in json.loads((run / "config.json").read_text())["run"].items()
            if k in RunConfig.__dataclass_fields__
        }
    )
    template = build_run(config).init_state()
    with leanstep.checkpoints.Checkpointer(run / "checkpoints") as checkpointer:
        restored = checkpointer.restore(template)
    return restored.step, restored.state


@pytest.mark.slow  # a run SIGKILLed in a child process, resumed, against a straight run: the kill is the point
@pytest.mark.parametrize(
    "flags",
    [["--fp8", FP8], ["--master", "bfloat16-sr-kahan", "--moments", "int8"]],
    ids=["fp8", "lean-state"],
)
def test_a_killed_and_resumed_run_ends_bit_identical_to_an_uninterrupted_one(tmp_path, corpus, cli, flags):
    """FP8 state, and (issue 29) bfloat16 masters with stochastic rounding, a Kahan buffer and
    8-bit moments: every leaf of the state after SIGKILL and --resume equals the straight run's.

    The straight run and the resume run in this process; only the run that is killed is a child."""
    straight = cli(*_argv(corpus, tmp_path / "straight", *flags))
    assert straight.code == 0, straight.err[-3000:]
    killed = tmp_path / "killed"
    # A child process: the run is killed (SIGKILL) mid-way, which pytest's own process must survive.
    process = subprocess.Popen(
        _command(corpus, killed, *flags), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 240
    while not (killed / "checkpoints" / "6").is_dir() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    resumed = cli(*_argv(corpus, killed, *flags, "--resume"))
    assert resumed.code == 0, resumed.err[-3000:]
    (step_a, a), (step_b, b) = _final_state(tmp_path / "straight"), _final_state(killed)
    assert step_a == step_b == 12
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    if flags[0] == "--fp8":
        metas = fp8_leaves(a.params)
        assert len(metas) == 4 * 6 and all(np.any(np.asarray(m) != 0) for m in metas)  # 4 matmuls, 6 leaves: moved
        assert json.loads((killed / "config.json").read_text())["run"]["fp8"] == FP8
    else:
        assert a.master == "bfloat16-sr-kahan" and a.master_error is not None
        assert jax.tree.leaves(a.params)[0].dtype == jnp.bfloat16


def test_resuming_with_another_recipe_is_refused(tmp_path, corpus, cli):
    out = tmp_path / "run"
    first = cli(*_argv(corpus, out, "--fp8", FP8, "--steps", "3"))
    assert first.code == 0, first.err[-2000:]
    again = cli(*_argv(corpus, out, "--fp8", "current", "--steps", "3", "--resume"))
    assert again.code == 2 and "fp8" in again.err


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--fp8", "delayed", "--model", "mlp"], "--fp8 delayed: FP8 matmuls are built into --model transformer"),
        (["--fp8", "sometimes"], "--fp8: Fp8Recipe.scaling"),
        (["--fp8", "delayed,history=0"], "--fp8: history=0: history must be an int in"),
        (["--fp8", "delayed,window=4"], "--fp8: unknown FP8 setting 'window=4'"),
        (["--fp8", "current,margin=x"], "--fp8: FP8 setting 'margin=x' is not a number"),
    ],
)
def test_an_fp8_recipe_that_cannot_work_is_refused_naming_the_flag(extra, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        RunConfig(size="tiny", steps=2, **_fields(extra)).validate()


def _fields(extra: list[str]) -> dict:
    pairs = dict(zip(extra[::2], extra[1::2]))
    return {flag.removeprefix("--"): value for flag, value in pairs.items()}


def test_the_transformer_with_fp8_has_one_meta_per_block_matmul_and_layer():
    run = build_run(RunConfig(size="tiny", steps=2, fp8="delayed,history=8"))
    params = run.abstract_params()
    metas = params["blocks"]["fp8"]
    assert sorted(metas) == ["fc", "out", "proj", "qkv"]
    assert metas["qkv"].input_history.shape == (run.model.config.n_layers, 8)
    plain = build_run(RunConfig(size="tiny", steps=2))
    assert leanstep_count(plain) == leanstep_count(run)  # the FP8 state is no parameter


def leanstep_count(run) -> int:
    from leanstep.models.transformer import count_params

    return count_params(run.abstract_params())
