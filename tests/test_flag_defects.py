"""Flags that passed their check and then crashed, did nothing, or said too little (issue 41, item 12).

Each refusal is one line naming the flag (and the setting, as written), exit code 2 from the CLI
and no traceback; each API refusal a ValueError naming the argument. Refusals are checked
in-process through RunConfig.validate() (what ``leanstep train`` runs first), and once each
through ``main`` for the exit code and the single line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import leanstep.training.run_steps
import leanstep.training.verify_run
from helpers.tiny_runs import QUIET, TINY_MLP
from leanstep.blocks.fp8 import MAX_HISTORY, Fp8Recipe
from leanstep.blocks.spike_guard import MAX_WINDOW, SpikeGuard
from leanstep.cli.main import main
from leanstep.inspection.auditing import audit
from leanstep.training import RunConfig, build_run
from leanstep.training.config import RESUMABLE_FIELDS, config_hash, setting_meaning
from leanstep.training.rollback import SpikeRollback
from leanstep.verification import VerifyReport

_TINY = {"size": "tiny", "steps": 2, "batch_size": 4, "seq_len": 8}


def _refusal(**fields: Any) -> str:
    with pytest.raises(ValueError) as caught:
        RunConfig(**{**_TINY, **fields}).validate()
    return str(caught.value)


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, captured.err
    return err


# --- --spike-guard --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("k=6,window=3000000000", "SpikeGuard.window must be an int in [2, 16777216]"),
        (f"window={MAX_WINDOW + 1}", "got 16777217"),
        ("window=100,warmup=2147483648", "SpikeGuard.warmup must be an int in [2, 2147483647]"),
        ("k=1e39", "SpikeGuard.k must be a positive number, finite in float32, got 1e+39"),
    ],
)
def test_a_spike_guard_past_its_counters_is_refused_before_the_step(spec, fragment):
    message = _refusal(spike_guard=spec)
    assert message.startswith("--spike-guard: ") and fragment in message


def test_the_spike_guard_at_its_bounds_runs_in_the_compiled_step():
    """window = 2**24 and warmup = 2**31 - 1 trace, compile and decide (the count exact, no overflow);
    the window's mean of one recorded value is that value, as a float64 reference says."""
    guard = SpikeGuard(window=MAX_WINDOW, warmup=2**31 - 1)
    state = guard.init()
    decide = jax.jit(guard.decide)
    spike, state = decide(state, {"loss": jnp.float32(2.5)}, jnp.array(True))
    spike, state = decide(state, {"loss": jnp.float32(1e30)}, jnp.array(True))
    assert not bool(spike) and int(state.recorded) == 2  # never judged before warmup
    assert np.asarray(state.values)[0, :2].tolist() == [2.5, np.float32(1e30)]


def test_the_cli_refuses_the_huge_window_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", "mlp", "--size", "tiny", "--steps", "2", "--out", str(out)]
    assert main([*argv, "--spike-guard", "k=6,window=3000000000"]) == 2
    assert "--spike-guard: SpikeGuard.window must be an int in [2, 16777216]" in _one_line(capsys)
    assert not out.exists()


# --- --spike-rollback -----------------------------------------------------------------------------


def test_a_rollback_that_could_never_fire_is_refused():
    message = _refusal(model="mlp", spike_guard="on", spike_rollback="after=5,within=2")
    assert message.startswith("--spike-rollback: SpikeRollback.after (5) must be at most within (2)")
    assert SpikeRollback.from_string("after=3,within=3") == SpikeRollback(after=3, within=3)  # can fire: 3 in a row
    with pytest.raises(ValueError, match=r"after \(51\) must be at most within \(50\)"):
        SpikeRollback(after=51)


# --- --fp8 ----------------------------------------------------------------------------------------


def test_history_with_current_scaling_is_refused():
    for spec, part in [("current,history=16", "history=16"), ("current,amax=most_recent", "amax=most_recent")]:
        message = _refusal(fp8=spec)
        assert message.startswith(f"--fp8: {part}: ") and "applies to delayed scaling only" in message
    with pytest.raises(ValueError, match="Fp8Recipe.history applies to delayed scaling only"):
        Fp8Recipe("current", history=16)
    assert Fp8Recipe.from_string("current,margin=1") == Fp8Recipe("current", margin=1)


def test_a_history_out_of_range_names_the_setting_and_its_range():
    message = _refusal(fp8="delayed,history=1000000000")
    assert message.startswith("--fp8: history=1000000000: history must be an int in [1, 65536]")
    assert "parameters" not in message and "--d-model" not in message
    assert Fp8Recipe.from_string(f"delayed,history={MAX_HISTORY}").history == MAX_HISTORY


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("delayed,window=4", "--fp8: unknown FP8 setting 'window=4' in 'delayed,window=4'; expected"),
        ("delayed,history=4,history=8", "--fp8: repeated FP8 setting 'history=8' in 'delayed,history=4,history=8'"),
        ("delayed,forward=e3m4", "--fp8: forward=e3m4: forward must be an FP8 format, one of e4m3, e5m2"),
        ("delayed,backward=int8", "--fp8: backward=int8: backward must be an FP8 format"),
    ],
)
def test_an_fp8_setting_is_named_when_refused(spec, fragment):
    assert fragment in _refusal(fp8=spec)


def test_forward_and_backward_formats_reach_the_model_from_the_flag():
    """The transformer's FP8 matmuls carry the formats --fp8 names, as the audit reads them from
    the program's operand dtypes (the recipe's default: e4m3 forward, e5m2 backward)."""

    def formats(spec: str) -> set[tuple[str, str]]:
        run = build_run(RunConfig(**_TINY, fp8=spec).validate())
        grad = jax.grad(run.loss_fn())
        return {m.dtypes[:2] for m in audit(grad, run.abstract_params(), run.batch_spec()).matmuls if m.scale}

    e4, e5 = "float8_e4m3fn", "float8_e5m2"
    assert formats("delayed") == {(e4, e4), (e5, e4)}  # forward; the transposes (gradient first)
    assert formats("delayed,forward=e5m2") == {(e5, e5)}
    assert formats("delayed,forward=e5m2,backward=e4m3") == {(e5, e5), (e4, e5)}


def test_the_fp8_help_names_every_setting(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for setting in ("margin=X", "forward=e4m3|e5m2", "backward=e4m3|e5m2", "delayed only", "history=1..65536"):
        assert setting in text, setting


# --- verify --moments / --spike-guard / --spike-rollback ------------------------------------------

_VERIFY = ["verify", *TINY_MLP, "--devices", "1"]


def test_verify_refuses_resume_only_flags_without_its_resume_check(capsys):
    assert main([*_VERIFY, "--moments", "int8", "--spike-guard", "on", "--no-resume"]) == 2
    err = _one_line(capsys)
    assert "--moments int8 --spike-guard on act only in verify's resume check, which --no-resume skips" in err


def test_verify_says_where_resume_only_flags_act(capsys, monkeypatch):
    seen: list[Any] = []

    def verify_run(config: RunConfig, **kwargs: Any) -> VerifyReport:
        seen.append((config, kwargs))
        return VerifyReport("stand-in", ())

    monkeypatch.setattr(leanstep.training.verify_run, "verify_run", verify_run)
    assert main([*_VERIFY, "--spike-guard", "on", "--spike-rollback", "on"]) == 0
    err = capsys.readouterr().err
    assert "note: --spike-guard on --spike-rollback on act only in the resume check" in err
    ((config, kwargs),) = seen
    assert (config.spike_guard, kwargs["resume"]) == ("on", True)  # handed to verify_run, resume check on
    assert main([*_VERIFY, "--moments", "bfloat16"]) == 0
    assert "note: --moments bfloat16 acts only in the resume check" in capsys.readouterr().err
    assert main([*_VERIFY, "--spike-guard", "NONE", "--moments", "float32"]) == 0  # the defaults: no note
    assert "note" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("verify: its resume check only") == 3


# --- --resume compares what the settings mean ------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "saved", "now"),
    [
        ("fp8", "delayed", "DELAYED"),
        ("fp8", "delayed", "delayed,history=1024,amax=max,margin=0"),
        ("fp8", "current,margin=1", "current, margin=1.0"),
        ("spike_guard", "on", "k=6,window=100,warmup=100,watch=loss"),
        ("spike_guard", "none", "None"),
        ("spike_rollback", "after=2,within=10", "within=10,after=2,lr=0.5"),
    ],
)
def test_settings_written_differently_are_the_same_config(field, saved, now):
    a, b = RunConfig(**{field: saved}), RunConfig(**{field: now})
    assert b.mismatches(a.to_json()) == [] and config_hash(a) == config_hash(b)
    other = {"fp8": "current", "spike_guard": "k=5", "spike_rollback": "after=3,within=10"}[field]
    assert b.mismatches(RunConfig(**{field: other}).to_json()) == [field]
    assert config_hash(b) != config_hash(RunConfig(**{field: other}))


def test_a_hash_as_written_is_0_11s(tmp_path):
    """The hash 0.11's checkpoints hold: sha256 of the identifying fields as written, the added
    fields at their default left out (the formula, written out here)."""
    config = RunConfig(fp8="DELAYED", spike_guard="on", master="bfloat16-sr")
    identity = {k: v for k, v in dataclasses.asdict(config).items() if k not in RESUMABLE_FIELDS}
    added = {"fp8": "none", "master": "float32", "moments": "float32", "spike_guard": "none", "spike_rollback": "none"}
    added["optimizer"] = "adamw"  # 0.12's field: 0.11 had no such key, and trained AdamW
    added["int8"] = "none"  # 0.12's field: 0.11 had no int8 matmuls
    added["update_in_backward"] = "off"  # 0.12's field: 0.11 had only the standard step
    identity = {k: v for k, v in identity.items() if not (k in added and v == added[k])}
    expected = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    assert config_hash(config, as_written=True) == expected != config_hash(config)
    assert setting_meaning("fp8", "DELAYED") == "Fp8Recipe()"


_RUN = ["train", *TINY_MLP, *QUIET, "--precision", "float32", "--eval-every", "100"]
_RUN += ["--eval-batches", "1", "--checkpoint-every", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    (root / "a.txt").write_bytes(bytes(rng.choice(list(b"abcdefgh      "), size=20_000).tolist()))
    return root


@pytest.mark.parametrize("written_by", ["0.12", "0.11"])
def test_a_run_resumes_with_its_settings_written_another_way(corpus, tmp_path, capsys, monkeypatch, written_by):
    """Stopped at step 1 with --spike-guard on, resumed with the defaults written out (and in upper
    case): it goes on. Its checkpoint's hash is 0.12's, or (a run stopped under 0.11) as written."""
    if written_by == "0.11":
        monkeypatch.setattr(leanstep.training.run_steps, "config_hash", lambda c: config_hash(c, as_written=True))
    out = tmp_path / "run"
    base = [*_RUN, "--data", str(corpus), "--out", str(out), "--steps", "3"]
    assert main([*base, "--spike-guard", "on", "--stop-at", "1"]) == 0
    monkeypatch.undo()
    capsys.readouterr()
    assert main([*base, "--spike-guard", "K=6,window=100,warmup=100,watch=loss", "--resume", "--stop-at", "2"]) == 0
    assert "different config" not in capsys.readouterr().err
    assert main([*base, "--spike-guard", "k=5", "--resume"]) == 2  # the control: another guard
    err = _one_line(capsys)
    assert "--resume: " in err and "belongs to a different config: --spike-guard " in err
