"""leanstep.verification.verify and ``leanstep verify``: each check passes on correct steps and names the bug it exists for.

The bugs are re-created in :mod:`handwritten_steps`, an optax step written by hand (no leanstep
inside); the correct version of that step, leanstep's own steps for the built-in transformer and
MLP, and the framework models of ``tests/test_frameworks.py`` are the setups that must pass.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from helpers.handwritten_steps import BUGS, DROPPED, HandwrittenStep
from helpers.workers import run_worker
from leanstep.cli.main import main
from leanstep.training import RunConfig
from leanstep.training.verify_run import verify_run
from leanstep.verification.batches import microbatch_rows, poison_row, uneven_mask
from leanstep.verification.bounds import gamma, norm_bound, unit_roundoff
from leanstep.verification.report import CheckResult, VerifyReport
from leanstep.verification.trees import first_difference, worst_excess

BF16 = "params=float32,compute=bfloat16,output=float32"

#: bug -> (the check that must flag it, words of its diagnosis, words of where it points)
FLAGGED_BY = {
    "fp8_last_microbatch": ("fp8", "marin-community/marin#7659", "fp8/amax_history[0]"),
    "fp8_clipped": ("fp8", "AI-Hypercomputer/maxtext#672", "after a clipped step"),
    "bf16_norm": ("clip", "AI-Hypercomputer/maxtext#5143", "w"),
    "bf16_accumulation": ("accumulation", "deepspeedai/DeepSpeed#1800", "every microbatch has its weight"),
    "guard_per_microbatch": ("non_finite", "optax.apply_if_finite around optax.MultiSteps", "microbatch 2 of 4"),
    "loss_per_microbatch": (
        "token_weighting",
        "loss normalised per microbatch",
        "microbatch 3 weighs 0.25, expected 0.4",
    ),
    "float32_layer": ("compute_dtype", "dtype=float32", "float32[8, 3]"),
    "keys_reused": ("keys", "dropout keys reused across microbatches", "microbatches 0 and 1"),
    "batch_stat_per_device": ("meshes", "computed over each device's own rows", "model_state/running_mean"),
    "loss_scale_twice": ("reference", "the loss scale (1024) divided out twice", "relative error"),
    "divided_by_m_twice": ("reference", "gradients divided by M=4 twice", "relative error"),
}


# --- the pieces ----------------------------------------------------------------------------------


def test_bounds_are_the_textbook_ones():
    assert unit_roundoff(jnp.float32) == 2.0**-24 and unit_roundoff(jnp.bfloat16) == 2.0**-8
    assert gamma(4) == pytest.approx(4 * 2.0**-24 / (1 - 4 * 2.0**-24), rel=1e-15)
    assert gamma(2**30, jnp.bfloat16) == float("inf")
    # the probabilistic norm bound takes over from gamma_n once n is past lambda^2
    assert norm_bound(10) == pytest.approx(gamma(12))
    assert norm_bound(10**6) == pytest.approx(6 * np.sqrt(10**6 + 2) * 2.0**-24)


def test_microbatch_rows_poison_and_uneven_tokens():
    assert microbatch_rows(6, 3, "contiguous") == [[0, 1], [2, 3], [4, 5]]
    assert microbatch_rows(6, 3, "strided") == [[0, 3], [1, 4], [2, 5]]
    with pytest.raises(ValueError, match="num_microbatches: expected a divisor of the batch's 6 rows, got 4"):
        microbatch_rows(6, 4, "strided")
    batch = {"x": np.ones((4, 2), np.float32), "t": np.arange(4), "mask": np.ones((4, 8), np.float32)}
    poisoned = poison_row(batch, 2)
    assert np.isnan(poisoned["x"][2]).all() and np.isfinite(np.delete(poisoned["x"], 2, 0)).all()
    assert poisoned["t"].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="no floating leaf"):
        poison_row({"t": np.arange(4)}, 0)
    uneven, counts = uneven_mask(batch, "mask", microbatch_rows(4, 2, "contiguous"))
    assert counts == [4.0, 8.0] and uneven["mask"].sum() == 12  # 2 rows of 2 tokens, 2 rows of 4


def test_trees_first_difference_and_worst_excess():
    a = {"w": np.array([1.0, -0.0], np.float32), "n": np.int32(3)}
    assert first_difference(a, {"w": np.array([1.0, 0.0], np.float32), "n": np.int32(3)}) == ("w", 1)  # -0 is not +0
    assert first_difference(a, a) is None
    assert first_difference(a, {"w": a["w"]}) == ("(structure)", 0)
    excess = worst_excess({"w": np.array([1.0, np.nan])}, {"w": np.zeros(2)}, {"w": np.ones(2)})
    assert excess.position == 1 and excess.ratio == float("inf")


def test_report_json_and_lookup():
    ok = CheckResult("accumulation", "pass", "G vs G*", 1e-9, 6e-5, "bound")
    bad = CheckResult("resume", "fail", "killed vs straight", float("inf"), 0.0, "bit for bit", where="state/w[0]")
    report = VerifyReport("setup", (ok, bad))
    body = json.loads(report.to_json())
    assert (
        body["passed"] is False and body["checks"][1]["largest"] == "inf" and body["checks"][1]["where"] == "state/w[0]"
    )
    assert report["resume"] is bad and "FAILED" in str(report)
    with pytest.raises(KeyError, match="no check named 'clip'"):
        report["clip"]
    with pytest.raises(ValueError, match="status: expected one of"):
        CheckResult("x", "ok", "", 0.0, 0.0, "")


def test_verify_step_refuses_bad_arguments():
    with pytest.raises(ValueError, match="num_microbatches: expected an int >= 2 that divides the batch's 16 rows"):
        leanstep.verification.verify_step(HandwrittenStep(), num_microbatches=3)
    with pytest.raises(ValueError, match=r"checks: unknown \['clipping'\]"):
        leanstep.verification.verify_step(HandwrittenStep(), num_microbatches=4, checks=("clipping",))
    with pytest.raises(TypeError, match="checks: expected a sequence of check names, got the string 'clip'"):
        leanstep.verification.verify_step(HandwrittenStep(), num_microbatches=4, checks="clip")


# --- the hand-written step and the peers' bugs ------------------------------------------------------


@pytest.fixture(scope="module")
def correct_report():
    return leanstep.verification.verify_step(HandwrittenStep(), num_microbatches=4, name="hand-written optax step")


def test_the_correct_handwritten_step_passes_every_check(correct_report):
    statuses = {c.name: c.status for c in correct_report.checks}
    assert correct_report.passed, str(correct_report)
    # batch statistics; no remat policy; no layouts here; no int8 matmuls (tests/test_verification_int8.py);
    # a hand-written step has no LayerStack (tests/test_verification_in_backward.py)
    expected_na = {"full_batch", "remat", "meshes", "int8_agreement", "int8_microbatches", "int8_meshes", "in_backward"}
    assert {name for name, status in statuses.items() if status == "n/a"} == expected_na, statuses
    # the bugs' checks all ran on it and found the differences they allow small
    assert correct_report["accumulation"].largest < 2.0**-14 and correct_report["keys"].largest > 0


@pytest.mark.parametrize("bug", [b for b in BUGS if b != "batch_stat_per_device"])
def test_each_peer_bug_is_flagged_by_name_where_it_is(bug, correct_report):
    check, named, where = FLAGGED_BY[bug]
    assert correct_report[check].status == "pass"
    report = leanstep.verification.verify_step(HandwrittenStep(bug), num_microbatches=4, checks=(check,))
    result = report[check]
    assert result.status == "fail", str(report)
    assert named in result.diagnosis and where in result.where, str(report)


def test_a_dropped_microbatch_fails_the_weights_and_the_full_batch():
    report = leanstep.verification.verify_step(
        HandwrittenStep(DROPPED, batch_stat=False), num_microbatches=4, checks=("accumulation", "full_batch")
    )
    assert report["accumulation"].diagnosis == "microbatch(es) [3] left out of the accumulated gradient"
    assert "microbatch 3 weighs" in report["accumulation"].where
    assert report["full_batch"].status == "fail" and "left out or weighed wrong" in report["full_batch"].diagnosis
    clean = leanstep.verification.verify_step(
        HandwrittenStep(batch_stat=False), num_microbatches=4, checks=("full_batch",)
    )
    assert clean["full_batch"].status == "pass"


def worker(out: Path) -> None:
    """The meshes check, on 4 simulated devices: the correct step, the per-device statistic, a built-in model."""
    jax.config.update("jax_num_cpu_devices", 4)
    from leanstep.training.verify_run import verify_setup

    results = {}
    for bug in (None, "batch_stat_per_device"):
        report = leanstep.verification.verify_step(
            HandwrittenStep(bug), num_microbatches=4, checks=("meshes",), meshes=("data=2", "data=4")
        )
        results[str(bug)] = report["meshes"].to_dict()
    config = RunConfig(size="tiny", batch_size=8, seq_len=16, microbatches=2, precision=BF16, fp8="delayed")
    report = leanstep.verification.verify_step(
        verify_setup(config), num_microbatches=2, checks=("meshes",), meshes=("data=4", "fsdp=4", "data=2,tensor=2")
    )
    results["transformer"] = report["meshes"].to_dict()
    (out / "meshes.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
    return run_worker(__file__, tmp_path_factory.mktemp("verify"), "meshes.json")


@pytest.mark.slow  # 4 simulated devices in a child process, seven layouts checked
def test_meshes_pass_for_correct_steps_and_name_a_per_device_statistic(meshes):
    assert meshes["None"]["status"] == "pass" and meshes["transformer"]["status"] == "pass", meshes
    bug = meshes["batch_stat_per_device"]
    _, named, where = FLAGGED_BY["batch_stat_per_device"]
    assert bug["status"] == "fail" and named in bug["diagnosis"] and where in bug["where"], bug


# --- leanstep's own steps --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        dict(model="transformer", precision=BF16, microbatches=2, remat="dots", fp8="delayed"),
        dict(model="mlp", precision="float32", microbatches=4, remat="full", loss_scale="none"),
    ],
    ids=["transformer-bf16-fp8", "mlp-float32"],
)
def test_leanstep_built_in_models_pass_every_check(fields):
    config = RunConfig(size="tiny", batch_size=8, seq_len=16, **fields)
    report = verify_run(config, resume=False)
    assert report.passed, str(report)
    applies = {c.name for c in report.checks if c.status == "pass"}
    assert {"accumulation", "full_batch", "token_weighting", "clip", "non_finite", "compute_dtype", "remat"} <= applies
    assert ("fp8" in applies) == (fields.get("fp8") == "delayed")


def test_a_loss_that_ignores_the_remat_policy_fails_the_remat_check():
    def make_loss(policy):  # the policy is dropped: no jax.checkpoint anywhere
        return lambda p, b: jnp.mean(jnp.tanh(b["x"] @ p["w1"]) @ p["w2"])

    params = {"w1": jnp.ones((3, 4)), "w2": jnp.ones((4, 2))}
    batch = {"x": np.ones((4, 3), np.float32)}
    report = leanstep.verification.verify(make_loss, params, batch, num_microbatches=2, remat="dots", checks=("remat",))
    assert report["remat"].status == "fail" and "no jax.checkpoint" in report["remat"].diagnosis


@pytest.mark.slow  # a whole `leanstep verify`: every check, its 2-device child process and a resume
def test_the_cli_writes_the_table_and_the_json(tmp_path, capsys):
    path = tmp_path / "report.json"
    flags = ["--size", "tiny", "--batch-size", "8", "--seq-len", "16", "--microbatches", "2", "--devices", "2"]
    assert main(["verify", *flags, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "leanstep verify: every check passed" in out and "resume" in out
    body = json.loads(path.read_text())
    statuses = {c["name"]: c["status"] for c in body["checks"]}
    assert body["passed"] and statuses["meshes"] == "pass" and statuses["resume"] == "pass", statuses


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--checks", "clip,speed"], "--checks: expected comma-separated names among"),
        (["--devices", "0"], "--devices: expected an integer >= 1, got 0"),
        (["--microbatches", "3"], "--microbatches"),
        (["--batch-size", "1", "--microbatches", "1"], "--batch-size: verify needs 2 rows or more"),
    ],
)
def test_the_cli_refuses_bad_flags_in_one_line(flags, message, capsys):
    assert main(["verify", "--size", "tiny", "--seq-len", "16", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


# --- the framework models of tests/test_frameworks.py ----------------------------------------------


def test_framework_models_pass_and_the_nnx_cnn_head_runs_in_float32_under_bf16():
    from flax import nnx

    from leanstep.frameworks import nnx as lnnx
    from test_frameworks import CNN, cnn_loss, image_batches

    _, params, model_state = lnnx.split(CNN(rngs=nnx.Rngs(0)))

    def make_loss(policy, random=True):  # NNX draws dropout from its own Rngs: off when asked
        model = CNN(remat=policy, rngs=nnx.Rngs(0))
        model.dropout.deterministic = not random
        return lnnx.loss(lnnx.split(model)[0], cnn_loss)

    batch = {k: np.asarray(v) for k, v in image_batches(1)[0].items()}
    common = dict(num_microbatches=4, remat="dots", model_state=model_state, has_state=True, loss_scale="dynamic")
    report = leanstep.verification.verify(make_loss, params, batch, **common)
    assert report.passed, str(report)
    assert report["keys"].status == "pass"  # its dropout draws per microbatch from the Rngs counter
    # under bf16 its head takes nnx.BatchNorm's float32 output: the finding leanstep's PrecisionWarning makes too
    report = leanstep.verification.verify(make_loss, params, batch, precision=BF16, checks=("compute_dtype",), **common)
    assert report["compute_dtype"].status == "fail" and "float32[2, 288]" in report["compute_dtype"].where


def test_equinox_and_linen_models_pass_every_check_under_bf16():
    import equinox as eqx

    from leanstep.frameworks import equinox as leqx
    from leanstep.frameworks import linen as llinen
    from test_frameworks import LM, Net, image_batches, net_loss, token_batches

    model, model_state = eqx.nn.make_with_state(Net)(16, jax.random.key(0))
    params, static = leqx.split(model)
    batch = {k: np.asarray(v) for k, v in image_batches(1)[0].items()}
    report = leanstep.verification.verify(
        lambda policy: leqx.stateful_loss(static, net_loss), params, batch, precision=BF16, num_microbatches=4,
        model_state=model_state, has_state=True, loss_scale="dynamic",
    )  # fmt: skip
    assert report.passed, str(report)
    assert "reads the model state" in report["accumulation"].tolerance  # EMA batch norm: chained references

    tokens = {"tokens": np.asarray(token_batches(1)[0]["tokens"])}
    params, _ = llinen.split(LM().init(jax.random.key(0), tokens["tokens"][:, :-1]))

    def make_lm(policy, random=True):
        module = LM(remat=policy, dtype=jnp.bfloat16)

        def loss_fn(params, batch, key):
            logits = module.apply({"params": params}, batch["tokens"][:, :-1], train=random, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

        return loss_fn

    report = leanstep.verification.verify(
        make_lm, params, tokens, precision=BF16, num_microbatches=2, remat="dots", uses_rng=True, loss_scale="dynamic"
    )
    assert report.passed, str(report)
    assert report["keys"].status == "pass" and report["non_finite"].status == "pass"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    worker(Path(sys.argv[2]))
