"""leanstep.planning.one_device (and the `leanstep plan` CLI): XLA's memory accounting, the choice rule against a brute-force reference, the budget error, reality."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.tiny_runs import TINY_MLP
from leanstep.blocks.rematerialization import remat
from leanstep.common.memory_sizes import format_bytes
from leanstep.planning.candidates import first_fit
from leanstep.planning.one_device import (
    BudgetError,
    Candidate,
    Setting,
    choose,
    plan,
    search_candidates,
    settings_grid,
)
from leanstep.planning.search_options import SearchOptions
from leanstep.step.spec import StepSpec
from leanstep.step.state import TrainState
from leanstep.step.train_step import make_train_step
from leanstep.training import RunConfig, analysis, build_run

D, H, LAYERS, BATCH, T = 16, 64, 2, 4, 32
POLICIES = ("none", "full")
OPT = optax.adam(1e-2)


def _block(h, layer):
    return h + jnp.tanh(h @ layer["w1"]) @ layer["w2"]


def make_loss_fn(policy):
    block = remat(_block, policy, prevent_cse=False)

    def loss_fn(params, batch):
        h, _ = jax.lax.scan(lambda h, layer: (block(h, layer), None), batch["x"], params["layers"])
        return jnp.mean((h @ params["head"] - batch["y"]) ** 2)

    return loss_fn


def _params():
    rng = np.random.default_rng(0)
    return {
        "layers": {
            "w1": rng.normal(size=(LAYERS, D, H)).astype(np.float32) / 3,
            "w2": rng.normal(size=(LAYERS, H, D)).astype(np.float32) / 6,
        },
        "head": rng.normal(size=(D, 2)).astype(np.float32),
    }


def _batch():
    rng = np.random.default_rng(1)
    return {
        "x": rng.normal(size=(BATCH, T, D)).astype(np.float32),
        "y": rng.normal(size=(BATCH, T, 2)).astype(np.float32),
    }


def _plan(budget, **kw):
    kw.setdefault("candidates", settings_grid(BATCH, remat_policies=POLICIES))
    return plan(make_loss_fn, _params(), _batch(), OPT, StepSpec(max_grad_norm=1.0), budget_bytes=budget, **kw)


@pytest.fixture(scope="module")
def everything():
    """Every candidate compiled (6 small compiles, shared by the tests below)."""
    return _plan("1GiB", search=SearchOptions(exhaustive=True))


def _nbytes(tree):
    return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# --- what XLA reports, and the peak formula ---------------------------------------------------------


def test_every_candidate_has_xla_memory_and_the_documented_peak(everything):
    state = TrainState.create(_params(), OPT)
    assert len(everything.candidates) == 6 and all(c.compiled for c in everything.candidates)
    for c in everything.candidates:
        # The inputs are the state and the batch; the donated state comes back in place.
        assert c.argument_bytes == _nbytes(state) + _nbytes(_batch())
        assert c.alias_bytes == _nbytes(state)
        assert c.peak_bytes == c.argument_bytes + c.output_bytes - c.alias_bytes + c.temp_bytes
        assert c.fits and c.compile_seconds > 0 and c.executable is not None


def test_more_microbatches_and_more_remat_need_less_memory(everything):
    peak = {(c.setting.num_microbatches, c.setting.remat): c.peak_bytes for c in everything.candidates}
    for policy in POLICIES:
        assert peak[(1, policy)] > peak[(4, policy)]
    assert peak[(1, "none")] > peak[(1, "full")]


def test_xla_flops_count_a_loop_body_once_and_ours_do_not(everything):
    flops = {(c.setting.num_microbatches, c.setting.remat): c for c in everything.candidates}
    one, four = flops[(1, "none")], flops[(4, "none")]
    assert abs(four.flops / one.flops - 1) < 0.01  # the same arithmetic, split four ways
    assert four.xla_flops < one.xla_flops / 2
    assert flops[(1, "full")].flops > one.flops  # remat recomputes the forward pass


def test_the_plan_equals_the_executable_a_run_compiles_from_real_arrays(everything):
    """Abstract inputs and LLVM -O0 (planning) against real arrays and XLA's defaults (a run)."""
    for c in [everything.chosen]:
        s = c.setting
        step = make_train_step(
            make_loss_fn(s.remat), precision=s.precision, num_microbatches=s.num_microbatches, max_grad_norm=1.0
        )
        memory = step.lower(TrainState.create(_params(), OPT), _batch()).compile().memory_analysis()
        assert (
            memory.argument_size_in_bytes,
            memory.output_size_in_bytes,
            memory.alias_size_in_bytes,
            memory.temp_size_in_bytes,
        ) == (c.argument_bytes, c.output_bytes, c.alias_bytes, c.temp_bytes)


def test_the_chosen_executable_runs_the_same_step(everything):
    chosen = everything.chosen
    state, metrics = chosen.executable(TrainState.create(_params(), OPT), _batch())
    s = chosen.setting
    reference = make_train_step(make_loss_fn(s.remat), num_microbatches=s.num_microbatches, max_grad_norm=1.0)
    ref_state, ref_metrics = reference(TrainState.create(_params(), OPT), _batch())
    assert np.isfinite(float(metrics.loss)) and float(metrics.loss) == pytest.approx(float(ref_metrics.loss), rel=1e-6)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# --- the choice ------------------------------------------------------------------------------------


def _reference_choice(candidates, budget, rtol=0.02):
    """The documented rule, by brute force over every candidate."""
    fitting = [c for c in candidates if c.peak_bytes <= budget]
    if not fitting:
        return None
    least = min(c.flops for c in fitting)
    return min(
        (c for c in fitting if c.flops <= (1 + rtol) * least), key=lambda c: (c.setting.num_microbatches, c.flops)
    ).setting


def _lazy_choice(candidates, budget, rtol=0.02):
    """The planner's search over already compiled candidates; returns (chosen setting, compiles used)."""
    blank = [Candidate(c.setting, c.flops, 0.0) for c in candidates]
    used = []

    def compile_at(i, c):
        used.append(i)
        return dataclasses.replace(candidates[i], fits=candidates[i].peak_bytes <= budget)

    chosen = choose(search_candidates(blank, compile_at, rtol, exhaustive=False), rtol)
    return (chosen.setting if chosen else None), len(used)


def test_the_lazy_search_matches_brute_force_on_every_real_budget(everything):
    peaks = sorted({c.peak_bytes for c in everything.candidates})
    for budget in [peaks[0] - 1, *peaks, *(p + 1 for p in peaks)]:
        chosen, used = _lazy_choice(everything.candidates, budget)
        assert chosen == _reference_choice(everything.candidates, budget), budget
        assert used <= len(everything.candidates)


@st.composite
def _families(draw):
    """Synthetic candidates: per family a FLOPs count and peaks that fall with the microbatch count."""
    counts = draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12]), min_size=1, max_size=5, unique=True))
    candidates = []
    for f in range(draw(st.integers(1, 4))):
        flops = draw(st.floats(1e6, 1.1e6))
        peaks = sorted(draw(st.lists(st.integers(1, 100), min_size=len(counts), max_size=len(counts))), reverse=True)
        for m, peak in zip(sorted(counts), peaks):
            candidates.append(
                Candidate(Setting(m, f"policy{f}", "float32"), flops * (1 + m * 1e-4), 0.0, peak_bytes=peak)
            )
    return candidates, draw(st.integers(0, 101))


@settings(max_examples=50, deadline=None)
@given(_families())
def test_the_lazy_search_matches_brute_force_when_peaks_fall_with_microbatches(case):
    candidates, budget = case
    chosen, _ = _lazy_choice(candidates, budget)
    assert chosen == _reference_choice(candidates, budget)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40).map(sorted))
def test_first_fit_bisects_a_monotone_sequence(flags):
    probes = []
    found = first_fit(list(range(len(flags))), lambda i: probes.append(i) or flags[i])
    assert found == (flags.index(True) if True in flags else None)
    assert len(set(probes)) <= 2 + math.ceil(math.log2(len(flags)))


def test_a_real_lazy_plan_compiles_less_and_chooses_as_brute_force(everything):
    peaks = {(c.setting.num_microbatches, c.setting.remat): c.peak_bytes for c in everything.candidates}
    budget = peaks[(2, "none")]  # the fewest-FLOPs family fits from 2 microbatches on
    result = _plan(budget)
    assert result.chosen.setting == _reference_choice(everything.candidates, budget)
    assert result.chosen.peak_bytes <= budget
    assert sum(c.compiled for c in result.candidates) < len(everything.candidates)
    assert (
        "*" in str(result)
        and json.loads(json.dumps(result.to_json()))["chosen"]["remat"] == result.chosen.setting.remat
    )


def test_a_budget_too_small_names_the_smallest_peak_and_its_setting(everything):
    subset = [c for c in everything.candidates if c.setting.num_microbatches == 4]
    smallest = min(subset, key=lambda c: c.peak_bytes)
    with pytest.raises(BudgetError) as info:
        _plan(smallest.peak_bytes - 1, candidates=[c.setting for c in subset])
    assert isinstance(info.value, ValueError)
    assert info.value.smallest.setting == smallest.setting and info.value.smallest.peak_bytes == smallest.peak_bytes
    s = smallest.setting
    assert (
        f"the smallest peak found is {format_bytes(smallest.peak_bytes)} ({smallest.peak_bytes:,} bytes), "
        f"with num_microbatches={s.num_microbatches}, remat={s.remat!r}" in str(info.value)
    )


def test_arguments_over_the_budget_stop_the_search_after_one_compile(everything):
    """The state and the batch are every candidate's arguments: below them nothing can fit."""
    arguments = everything.candidates[0].argument_bytes
    assert all(c.argument_bytes == arguments for c in everything.candidates)
    compiled = []

    def compile_at(i, candidate):
        compiled.append(i)
        found = next(c for c in everything.candidates if c.setting == candidate.setting)
        return dataclasses.replace(found, fits=found.peak_bytes <= arguments - 1)

    blank = [Candidate(c.setting, flops=c.flops) for c in everything.candidates]
    result = search_candidates(blank, compile_at, 0.02, exhaustive=False, budget=arguments - 1)
    assert len(compiled) == 1 and sum(c.compiled for c in result) == 1 and not any(c.fits for c in result)
    with pytest.raises(BudgetError, match="no setting fits"):
        _plan(arguments - 1)


# --- grids, bad input ---------------------------------------------------------------------------


def test_settings_grid_uses_the_divisors():
    assert [s.num_microbatches for s in settings_grid(12, remat_policies=("none",))] == [1, 2, 3, 4, 6, 12]
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        settings_grid(0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            dict(candidates=[(3, "none", "float32")]),
            ValueError,
            "num_microbatches=3 must be a positive divisor of the batch size 4",
        ),
        (dict(candidates=[(1, "sometimes", "float32")]), ValueError, "unknown policy='sometimes'"),
        (dict(candidates=[(1, "none")]), TypeError, "triples"),
        (dict(candidates=[]), ValueError, "candidates is empty"),
        (dict(budget_bytes="a lot"), ValueError, "is not a size"),
    ],
)
def test_plan_rejects_bad_input_before_compiling(kwargs, error, match):
    kwargs.setdefault("budget_bytes", "1MiB")
    with pytest.raises(error, match=match):
        plan(make_loss_fn, _params(), _batch(), OPT, **kwargs)


def test_search_options_reject_a_bad_margin_or_compiler_options_when_made():
    with pytest.raises(ValueError, match=r"rtol must be a number in \[0, 1\), got 1.5"):
        SearchOptions(rtol=1.5)
    with pytest.raises(TypeError, match="compiler_options must be a dict, 'auto' or None, got 'fast'"):
        SearchOptions(compiler_options="fast")


def test_plan_rejects_batch_leaves_of_different_lengths():
    with pytest.raises(ValueError, match="share one leading batch axis"):
        plan(make_loss_fn, _params(), {"x": np.ones((4, T, D)), "y": np.ones((3, T, 2))}, OPT, budget_bytes="1MiB")


# --- a run's config and the CLI ------------------------------------------------------------------


def test_cli_plan_for_a_cluster_plans_in_a_subprocess_and_names_the_flags(tmp_path, cli):
    out = tmp_path / "plan.json"
    argv = [
        "plan",
        "--devices",
        "2",
        "--mesh",
        "data=2",
        *TINY_MLP,
        "--microbatch-counts",
        "1",
        "--remat-policies",
        "none",
        "--accelerator",
        "a100",
        "--json",
        str(out),
    ]
    result = cli(*argv)
    assert result.code == 0, result.err  # this process runs one device: the planner runs in a child with 2
    saved = json.loads(out.read_text())
    assert saved["num_devices"] == 2 and saved["accelerator"]["name"] == "a100" and saved["compiles"] == 1
    assert saved["chosen"]["mesh"] == "data=2" and saved["chosen"]["predicted_seconds"] > 0
    assert "chosen: --microbatches 1 --remat none --mesh data=2 --reduce auto" in result.out


def test_cli_plan_prints_the_table_and_writes_json(tmp_path, cli):
    out = tmp_path / "plan.json"
    argv = [
        "plan",
        "--budget",
        "64MiB",
        *TINY_MLP,
        "--microbatch-counts",
        "1,2",
        "--remat-policies",
        "none,dots",
        "--json",
        str(out),
    ]
    result = cli(*argv)
    assert result.code == 0, result.err
    saved = json.loads(out.read_text())
    assert (saved["chosen"]["num_microbatches"], saved["chosen"]["remat"]) == (1, "none")
    assert saved["budget_bytes"] == 64 * 2**20 and len(saved["candidates"]) == 4
    # plan_run planned the step a run takes: its inputs are the run's state and a token batch.
    config = RunConfig(model="mlp", size="tiny", batch_size=4, seq_len=8)
    state = build_run(config).init_state()
    assert saved["chosen"]["argument_bytes"] == _nbytes(state) + 4 * (8 + 1) * 4
    assert saved["chosen"]["precision"] == build_run(config).config.precision  # --precision auto, resolved
    text = result.out
    assert "->" in text and "chosen: --microbatches 1 --remat none" in text


def test_cli_plan_reports_a_budget_too_small(tmp_path, cli, monkeypatch, everything):
    def too_small(config, budget, **options):
        raise BudgetError(budget, everything.candidates[-1], everything.candidates)

    monkeypatch.setattr(analysis, "plan_run", too_small)
    out = tmp_path / "plan.json"
    result = cli("plan", "--budget", "1KiB", *TINY_MLP, "--json", out)
    assert result.code == 1
    saved = json.loads(out.read_text())
    assert saved["chosen"] is None and "no setting fits the budget of 1.0 KiB" in saved["error"]
    assert "no setting fits" in result.out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["plan", "--budget", "lots"], "--budget: memory size 'lots' is not a size"),
        (["plan", "--budget", "1MiB", "--microbatch-counts", "3"], "num_microbatches=3 must be a positive divisor"),
        (["plan", "--budget", "1MiB", "--remat-policies", "sometimes"], "unknown policy='sometimes'"),
        (["plan", "--budget", "1MiB", "--batch-size", "0"], "--batch-size must be an integer >= 1"),
    ],
)
def test_cli_plan_rejects_bad_flags(argv, match, cli):
    result = cli(*argv)
    assert result.code == 2 and result.err.startswith("leanstep plan: error: ") and match in result.err, result.err


def test_plan_run_refuses_fsdp_and_asks_for_a_mesh():
    with pytest.raises(ValueError, match="--budget plans --mesh, not --fsdp: use --mesh auto"):
        analysis.plan_run(RunConfig(devices=2, fsdp=True), "1GiB")


def test_plan_run_plans_the_run_s_spec_and_takes_no_step_setting_beside_it():
    with pytest.raises(
        TypeError, match=r"plan_run got the options max_grad_norm=: .* the step's settings are the config's"
    ):
        analysis.plan_run(RunConfig(size="tiny"), "1GiB", max_grad_norm=1.0)


def test_a_cluster_plan_of_a_run_builds_its_state_from_the_run_s_spec():
    # Before, plan_run's cluster branch re-spelled four of the run's settings; the spike guard's window
    # (in the state) was not among them. One device, so the plan runs here, with one candidate.
    def arguments(guard):
        config = RunConfig(size="tiny", batch_size=4, seq_len=8, spike_guard=guard)
        found = analysis.plan_run(config, "1GiB", num_devices=1, remat_policies=["none"], microbatches=[1])
        return found.chosen.argument_bytes

    assert arguments("on") > arguments("none")
