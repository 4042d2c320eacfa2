"""``RunConfig(budget=...)``: the library chooses the microbatches and remat for a memory budget
(:func:`leanstep.training.analysis.fit_memory_budget`, which ``train`` calls), as ``leanstep train
--budget`` did in the CLI; the budget's flags checked where the config is."""

from __future__ import annotations

import dataclasses

import pytest

from leanstep.training import RunConfig
from leanstep.training.analysis import fit_memory_budget, plan_run

# The MLP with 2 rows: few candidates to compile (the planner itself is tested in test_planning.py).
SMALL = RunConfig(model="mlp", size="tiny", batch_size=2, microbatches=1, seq_len=8, steps=2)


def test_the_budget_choice_is_the_planners_applied_to_the_config():
    fitted, said = fit_memory_budget(dataclasses.replace(SMALL, budget="64MiB"))
    setting = plan_run(SMALL, "64MiB").chosen.setting
    assert (fitted.microbatches, fitted.remat) == (setting.num_microbatches, setting.remat)
    assert fitted.budget == "64MiB" and fitted.mesh is None
    assert len(said) == 1 and said[0].startswith("--budget 64MiB: chose --microbatches")
    assert fit_memory_budget(SMALL) == (SMALL, ())  # no budget: as it is, nothing said


def test_a_budget_nothing_fits_is_one_error_naming_it():
    with pytest.raises(ValueError, match=r"^--budget: no setting fits the budget of 1.0 KiB"):
        fit_memory_budget(dataclasses.replace(SMALL, budget="1KiB"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"budget": "lots"}, "--budget: "),
        ({"mesh": "auto", "budget": "1GiB"}, "--mesh auto plans a mesh over --devices N devices per process"),
        ({"mesh": "auto", "devices": 2}, "--mesh auto needs --budget"),
        ({"accelerator": "a100"}, "--accelerator a100 prices only the plan of --mesh auto"),
    ],
)
def test_the_budgets_fields_are_checked_with_the_config(fields, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SMALL, **fields).validate()


def test_a_run_with_a_budget_is_not_sized_for_the_machine(monkeypatch):
    """The budget plans the run's settings for the model given: the machine's size rule stays out."""
    from types import SimpleNamespace

    import jax

    from leanstep.training.machine_size import choose_for_machine

    tpu = SimpleNamespace(platform="tpu", device_kind="TPU v5 lite", memory_stats=lambda: {"bytes_limit": 16 << 30})
    monkeypatch.setattr(jax, "devices", lambda *a: [tpu])
    assert choose_for_machine(RunConfig()).config.d_model == 384
    budgeted = choose_for_machine(RunConfig(budget="8GiB")).config
    assert budgeted.d_model is None and budgeted.size == "mini"
