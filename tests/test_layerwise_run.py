"""``leanstep train --update-in-backward on``: the run's field and flag, its step, its resume and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from leanstep import LayerStack
from leanstep.training import RunConfig
from leanstep.training.build import build_run

_TINY = {"size": "tiny", "steps": 2, "batch_size": 4, "seq_len": 8, "optimizer": "adamw"}


def _records(run: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("tokens_per_sec", "elapsed_s")} for r in lines]


def _refusal(**fields: object) -> str:
    with pytest.raises(ValueError) as caught:
        RunConfig(**{**_TINY, **fields}).validate()  # type: ignore[arg-type]
    return str(caught.value)


def test_the_flag_makes_the_runs_loss_the_models_layer_stack():
    """On, the run's loss is the transformer's LayerStack as the run's loss contract says (a mean
    of each microbatch, not token-weighted), whatever --remat; the step's spec carries the field."""
    run = build_run(RunConfig(**_TINY, update_in_backward="on", precision="float32"))
    assert run.step.update_in_backward and not run.step.loss.token_weighted
    assert isinstance(run.loss_fn(), LayerStack) and isinstance(run.loss_fn("full"), LayerStack)
    off = build_run(RunConfig(**_TINY, precision="float32"))
    assert not off.step.update_in_backward and not isinstance(off.loss_fn(), LayerStack)
    assert isinstance(off.layer_stack(), LayerStack)  # what the planner may choose


def test_a_run_trains_inside_the_backward_pass_and_resumes_as_it_was(tmp_path, cli, tiny_flags, tiny_corpus):
    """5 steps straight, 5 steps stopped at 3 and resumed: the same records bit for bit; the first
    step's loss is the standard step's (the same forward pass), and its gradient norm within 1e-5."""
    argv = ("train", *tiny_flags, "--data", tiny_corpus, "--steps", "5", "--optimizer", "adamw", "--eval-every", "2")
    on = (*argv, "--update-in-backward", "on")
    assert cli(*on, "--out", tmp_path / "straight").code == 0
    assert cli(*on, "--out", tmp_path / "resumed", "--stop-at", "3", "--checkpoint-every", "3").code == 0
    assert cli(*on, "--out", tmp_path / "resumed", "--resume", "--checkpoint-every", "3").code == 0
    assert cli(*argv, "--out", tmp_path / "standard").code == 0
    straight, resumed = _records(tmp_path / "straight"), _records(tmp_path / "resumed")
    assert [r["step"] for r in straight if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    assert straight == resumed
    assert json.loads((tmp_path / "straight" / "config.json").read_text())["run"]["update_in_backward"] == "on"
    first, standard = straight[0], _records(tmp_path / "standard")[0]
    assert first["loss"] == pytest.approx(standard["loss"], rel=1e-6)
    assert first["grad_norm"] == pytest.approx(standard["grad_norm"], rel=1e-5)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"model": "mlp"}, "takes --model transformer (its layers as a LayerStack), not mlp"),
        ({"fp8": "delayed"}, "--fp8 delayed keeps FP8 state under the layers"),
    ],
)
def test_what_the_flag_cannot_take_is_refused_in_one_line_naming_it(fields, fragment):
    message = _refusal(update_in_backward="on", **fields)
    assert message.startswith("--update-in-backward on: ") and fragment in message and "\n" not in message


def test_the_flag_takes_on_or_off():
    assert _refusal(update_in_backward="yes") == "--update-in-backward: expected on or off, got 'yes'"
    assert "update_in_backward" not in RunConfig().mismatches({k: v for k, v in RunConfig().to_json().items()
                                                              if k != "update_in_backward"})  # fmt: skip
