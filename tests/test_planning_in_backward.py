"""The planner chooses the update inside the backward pass where the standard step does not fit (issue 59)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import optax
import pytest

from leanstep import LayerStack
from leanstep.planning import BudgetError, Setting, plan
from leanstep.planning.in_backward import in_backward_settings
from leanstep.training import RunConfig
from leanstep.training.analysis import plan_run

#: A transformer of 0.43M parameters (d 128, 2 layers, d_ff 512), 4 rows of 32 tokens, bfloat16
#: compute, bf16-sr masters and int8 moments: the run's path (``leanstep plan``).
_RUN = (
    "--size", "tiny", "--d-model", "128", "--layers", "2", "--heads", "2", "--d-ff", "512",
    "--batch-size", "4", "--seq-len", "32", "--optimizer", "adamw", "--precision", "compute=bf16",
    "--master", "bfloat16-sr", "--moments", "int8",
)  # fmt: skip
_FIELDS = dict(size="tiny", d_model=128, n_layers=2, n_heads=2, d_ff=512, batch_size=4, seq_len=32, optimizer="adamw",
               precision="compute=bfloat16", master="bfloat16-sr", moments="int8")  # fmt: skip


@pytest.mark.slow  # a budgeted plan compiling the standard candidates and the update in backward: the search is the point
def test_plan_chooses_the_update_inside_the_backward_pass_when_the_standard_step_does_not_fit(
    cli, tmp_path, tiny_corpus
):
    """Compiled on the CPU (``memory_analysis()``: arguments + outputs - aliased + temporaries), the
    standard step of this run peaks at 31,956,540 bytes (one microbatch, full remat; 31,956,860
    without remat) and the update inside the backward pass at 15,775,804 (one microbatch), so a
    budget of 24,000,000 bytes holds only the second: ``leanstep train --budget`` plans it (the
    standard candidates planned, none fitting), prints why in one line with both peaks, and trains
    with it (its config.json says so)."""
    out = tmp_path / "run"
    budget = 24_000_000
    result = cli("train", *_RUN, "--budget", str(budget), "--steps", "1", "--data", tiny_corpus, "--out", out,
                 "--no-progress", "--no-chart", "--eval-batches", "1")  # fmt: skip
    assert result.code == 0, result.err
    text = " ".join((result.out + result.err).split())
    assert "chose --microbatches 1 --remat none --update-in-backward on (predicted peak 15," in text
    assert f"--budget {budget}: the standard step does not fit in 22.9 MiB (its smallest peak 30." in text
    assert "the update inside the backward pass does (15." in text and "x that step's FLOPs" in text
    assert json.loads((out / "config.json").read_text())["run"]["update_in_backward"] == "on"


def test_the_runs_plan_lists_both_kinds_of_candidate():
    """The same run planned by :func:`leanstep.training.analysis.plan_run` (``leanstep plan``'s and
    ``train --budget``'s): the standard candidates, none fitting, then the chosen one."""
    config = RunConfig(**_FIELDS)
    settings = [Setting(1, r, "compute=bfloat16") for r in ("none", "full")]
    result = plan_run(config, 24_000_000, candidates=settings)
    assert [(c.setting.remat, c.setting.update_in_backward, c.fits) for c in result.candidates] == [
        ("none", False, False), ("full", False, False), ("none", True, True)
    ]  # fmt: skip
    assert result.chosen is result.candidates[-1] and result.notes[0].startswith("the standard step does not fit")
    standard = plan_run(config, 40_000_000, candidates=settings)  # the standard step fits: as before
    assert not standard.chosen.setting.update_in_backward and not any(
        c.setting.update_in_backward for c in standard.candidates
    )


def _tiny_stack() -> tuple[LayerStack, dict, dict]:
    stack = LayerStack(
        embed=lambda top, b: b["x"] @ top["w_in"],
        layer=lambda p, x: jnp.tanh(x @ p["w"]),
        head=lambda top, x, b: jnp.mean((x @ top["w_out"] - b["y"]) ** 2),
    )
    params = {"w_in": jnp.ones((8, 64)), "blocks": {"w": jnp.zeros((4, 64, 64))}, "w_out": jnp.ones((64, 1))}
    return stack, params, {"x": jnp.ones((4, 8)), "y": jnp.ones((4, 1))}


def test_a_plain_loss_keeps_the_budget_error_and_a_stack_that_does_not_fit_either_names_both():
    """Without ``stack=`` nothing more is tried; with it, a budget below both steps' peaks raises one
    BudgetError over both kinds of candidate, its smallest named with update_in_backward."""
    stack, params, batch = _tiny_stack()
    candidates = [(1, "none", "float32")]
    with pytest.raises(BudgetError) as plain:
        plan(lambda _: stack, params, batch, optax.adam(0.1), budget_bytes=1000, candidates=candidates)
    assert len(plain.value.candidates) == 1 and "update_in_backward" not in str(plain.value)
    with pytest.raises(BudgetError) as both:
        plan(lambda _: stack, params, batch, optax.adam(0.1), budget_bytes=1000, candidates=candidates, stack=stack)
    kinds = [c.setting.update_in_backward for c in both.value.candidates]
    assert kinds == [False, True]
    assert both.value.smallest.peak_bytes == min(c.peak_bytes for c in both.value.candidates)
    if both.value.smallest.setting.update_in_backward:
        assert "update_in_backward=True" in str(both.value)


def test_the_settings_tried_are_one_per_microbatch_count_and_precision():
    settings = [Setting(m, r, "float32") for m in (1, 2) for r in ("none", "dots", "full")]
    assert in_backward_settings(settings) == (
        Setting(1, "none", "float32", update_in_backward=True),
        Setting(2, "none", "float32", update_in_backward=True),
    )
