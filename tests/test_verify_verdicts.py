"""What verify says it did (issue 57, item 13): the accumulation check's weighting as taken, a
report with nothing verified, and a step checked without the independent reference.

Before: the accumulation line said ``w_j = 1/M`` for a token-weighted loss without a mask leaf,
which is weighed by the loss's own counts; a report whose every check was ``n/a`` said "every check
passed"; and a hand-written step without ``reference_loss`` whose gradient is twice the loss's
everywhere got "every check passed", though the one check that could see it had not run.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import leanstep
from helpers.handwritten_steps import HandwrittenStep, padded_batch
from helpers.token_losses import make_token_loss
from leanstep.blocks.accumulation import Accumulation
from leanstep.blocks.loss_contract import LossContract
from leanstep.cli.main import main
from leanstep.verification.leanstep_step import LeanstepStep
from leanstep.verification.runs import Runs

PARAMS = {"w1": jnp.full((3, 5), 0.3), "w2": jnp.linspace(-0.5, 0.5, 10).reshape(5, 2)}
GRADIENT_CHECKS = ("accumulation", "full_batch", "reference", "token_weighting", "clip")


def _batch(rows: int = 8, tokens: int = 6) -> dict:
    rng = np.random.default_rng(5)
    mask = (np.arange(tokens)[None, :] < rng.integers(1, tokens + 1, size=rows)[:, None]).astype(np.float32)
    return {
        "x": rng.normal(size=(rows, tokens, 3)).astype(np.float32),
        "y": rng.normal(size=(rows, tokens, 2)).astype(np.float32),
        "mask": mask,
    }


def make_mean_loss(policy):
    return lambda params, batch: jnp.mean((jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)


@pytest.mark.parametrize(
    ("make_loss", "settings", "said"),
    [
        (make_token_loss, {"token_weighted": True}, "c_j / sum c (the loss's own token counts)"),
        (make_token_loss, {"token_weighted": True, "mask": "mask"}, "c_j / sum c (the 'mask' leaf's token counts)"),
        (make_mean_loss, {}, "1/M"),
    ],
)
def test_the_accumulation_line_states_the_weighting_it_used(make_loss, settings, said):
    batch = _batch()
    report = leanstep.verification.verify(
        make_loss, PARAMS, batch, num_microbatches=4, checks=("accumulation",), **settings
    )
    assert report["accumulation"].status == "pass", str(report)
    assert report["accumulation"].compared.endswith(f", w_j = {said}, in float64"), report["accumulation"].compared
    # The weights taken, against the mask's tokens counted here (the loss counts the same tokens).
    contract = LossContract(token_weighted=bool(settings))
    spec = leanstep.StepSpec(loss=contract, accumulation=Accumulation(4))
    setup = LeanstepStep(make_loss, PARAMS, batch, spec, mask=settings.get("mask"))
    runs = Runs(setup, num_microbatches=4)
    runs.register("batch", batch)
    counts = batch["mask"].reshape(4, 2, -1).sum(axis=(1, 2), dtype=np.float64)  # contiguous microbatches of 2 rows
    expected = counts / counts.sum() if settings else np.full(4, 0.25)
    np.testing.assert_allclose(runs.weights("batch", 4), expected, rtol=1e-12)
    assert runs.weighing("batch", 4) == said


def test_a_report_whose_every_check_is_na_says_nothing_was_verified():
    report = leanstep.verification.verify(
        make_mean_loss, PARAMS, _batch(), num_microbatches=2, checks=("token_weighting",)
    )
    assert report["token_weighting"].status == "n/a" and report.passed  # nothing failed: the exit code is 0
    assert str(report).splitlines()[0].endswith(": nothing verified: every check asked for (1) does not apply (n/a)")
    assert "every check passed" not in str(report)
    assert json.loads(report.to_json())["verdict"] == report.verdict


def test_the_cli_says_nothing_was_verified_when_the_one_check_asked_for_is_na(capsys):
    flags = ["--model", "mlp", "--size", "tiny", "--batch-size", "4", "--seq-len", "8", "--microbatches", "2"]
    assert main(["verify", *flags, "--checks", "fp8", "--no-resume"]) == 0
    out = capsys.readouterr().out
    assert "leanstep verify: nothing verified: every check asked for (1) does not apply" in " ".join(out.split())
    assert "every check passed" not in out


class _Doubled(HandwrittenStep):
    """The hand-written step with its loss, and so every gradient, twice what the loss says."""

    def _loss(self, *args, **kwargs):
        scaled, aux = super()._loss(*args, **kwargs)
        return 2 * scaled, aux


class _DoubledWithoutReference(_Doubled):
    reference_loss = None


def test_a_step_checked_without_its_reference_says_the_reference_did_not_run():
    report = leanstep.verification.verify_step(
        _DoubledWithoutReference(batch=padded_batch(4)), num_microbatches=4, checks=GRADIENT_CHECKS
    )
    # Every check that compares the step with itself passes the doubled gradient...
    assert all(report[name].status in ("pass", "n/a") for name in GRADIENT_CHECKS), str(report)
    assert report["reference"].status == "n/a" and report.passed
    # ...and the report says, first, that the one independent of the step did not run.
    first = str(report).splitlines()[0]
    assert "every check passed" not in first and "the independent reference did not run" in first, first
    # The control: given its reference_loss, the same step fails the reference check.
    control = leanstep.verification.verify_step(
        _Doubled(batch=padded_batch(4)), num_microbatches=4, checks=("reference",)
    )
    assert control["reference"].status == "fail" and control.verdict == "1 check(s) FAILED", str(control)
