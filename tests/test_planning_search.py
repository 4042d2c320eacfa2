"""The cluster search's pieces (leanstep.planning.cluster_search, cluster_grid, search_options) on hand-made inputs.

Nothing here traces or compiles: candidates and families are plain records, a "compile" is a
lookup, and every expectation is computed by hand from the rules of leanstep.planning.cluster.
"""

from __future__ import annotations

import dataclasses

import pytest

from leanstep.planning.cluster_compile import priced
from leanstep.planning.cluster_grid import Family, Layout, families_of, format_seconds
from leanstep.planning.cluster_search import (
    Compiled,
    Limits,
    SearchState,
    compile_family,
    final_row,
    next_group,
    prune,
    rank,
    record,
    run_search,
    skip,
    start,
    strip,
)
from leanstep.planning.cost_model import StepCost, get_accelerator
from leanstep.planning.records import Candidate, Setting, family_rows
from leanstep.planning.search_options import SearchSpace, split_options

MS = 1e-3


def _candidate(m, remat="none", mesh="data=4", reduce="auto", **fields):
    return Candidate(Setting(m, remat, "float32", mesh, reduce), **fields)


def _compiled(m, predicted, fits=True, **fields):
    """A candidate as compiling leaves it: a peak (so ``compiled``), a fit, a predicted time."""
    return _candidate(m, peak_bytes=1000, fits=fits, predicted_seconds=predicted, **fields)


def _family(members, shape=None, remat="none", reduce="auto", argument_bytes=0, bound=0.0, estimate=0.0):
    return Family(shape or {"data": 4}, remat, reduce, tuple(members), argument_bytes, bound, estimate)


# --- families and their bounds ----------------------------------------------------------------------


def test_families_of_prices_every_member_as_computed_by_hand():
    # 1 GB/s links, 1 ms a collective, full bandwidth; a 4-device mesh lies in one 8-device node.
    accelerator = get_accelerator("h100", bandwidth=1e9, link_efficiency=1.0, latency=1e-3)
    layout = Layout(
        {"data": 2, "fsdp": 2}, rows=4, argument_bytes=123, sizes={"gradient": 8e6, "shard": 4e6, "gathered": 2e6}
    )
    space = SearchSpace(remat_policies=["none", "full"], microbatches=[1, 2, 3], reductions=["auto", "step"])
    candidates, families = families_of(layout, space, "float32", {"none": 0.5, "full": 0.6}, accelerator, first=10)

    # 3 does not divide the 4 rows: two counts x two policies x two reductions.
    assert [c.setting for c in candidates[:4]] == [
        Setting(1, "none", "float32", "data=2,fsdp=2", "auto"),
        Setting(2, "none", "float32", "data=2,fsdp=2", "auto"),
        Setting(1, "full", "float32", "data=2,fsdp=2", "auto"),
        Setting(2, "full", "float32", "data=2,fsdp=2", "auto"),
    ]
    assert [f.members for f in families] == [(10, 11), (12, 13), (14, 15), (16, 17)]
    assert all(c.argument_bytes == 123 for c in candidates) and all(f.argument_bytes == 123 for f in families)
    # Bound (no latency): all-reduce of the shard over data=2: 2 * 1/2 * 4 MB = 4 ms once; under
    # "auto" the reduce-scatter (1/2 * 8 MB = 4 ms) and the gather (1/2 * 2 MB = 1 ms) every microbatch.
    bounds = [c.bound_seconds for c in candidates]
    assert bounds[:4] == pytest.approx([0.5 + 9 * MS, 0.5 + 14 * MS, 0.6 + 9 * MS, 0.6 + 14 * MS], rel=1e-12)
    # "step": each once per step, whatever the count.
    assert bounds[4:] == pytest.approx([0.5 + 9 * MS] * 2 + [0.6 + 9 * MS] * 2, rel=1e-12)
    assert [f.bound for f in families] == [bounds[0], bounds[2], bounds[4], bounds[6]]
    # Estimate of the fewest-microbatch member, with 1 ms a collective; full remat gathers twice.
    assert families[0].estimate == pytest.approx(0.5 + (4 + 1) * MS + (4 + 1) * MS + (1 + 1) * MS, rel=1e-12)
    assert families[1].estimate == pytest.approx(0.6 + 5 * MS + 5 * MS + 2 * 2 * MS, rel=1e-12)


def test_families_of_leaves_out_step_reduction_without_an_fsdp_axis_and_counts_that_do_not_divide():
    accelerator = get_accelerator("h100")
    layout = Layout({"data": 8}, rows=2, argument_bytes=0, sizes={"gradient": 0.0, "shard": 0.0, "gathered": 0.0})
    candidates, families = families_of(layout, SearchSpace(["none"], [4]), "float32", {"none": 0.0}, accelerator)
    assert candidates == [] and families == []
    candidates, families = families_of(layout, SearchSpace(["none"]), "float32", {"none": 0.0}, accelerator)
    assert [(f.reduce, f.members) for f in families] == [("auto", (0, 1))]


# --- start, next group -------------------------------------------------------------------------------


def test_start_groups_by_mesh_and_reduction_with_the_least_recompute_first():
    families = [
        _family([0], remat="full"),
        _family([1], remat="none"),
        _family([2], shape={"fsdp": 4}, remat="dots"),
        _family([3], remat="dots"),
        _family([4], remat="none", reduce="step"),
    ]
    state = start([_candidate(1)] * 5, families, {"none": 1.0, "dots": 1.5, "full": 2.0})
    assert [[f.members[0] for f in group] for group in state.pending] == [[1, 3, 0], [2], [4]]
    assert state.best is None and state.fewest is None and state.failed == ()


def test_next_group_takes_the_lowest_estimate_counting_the_tensor_axis_costs_seen():
    tensor = (_family([0], shape={"data": 2, "tensor": 2}, estimate=1.0),)
    plain = (_family([1], estimate=1.5),)
    state = SearchState((_candidate(1), _candidate(1)), (tensor, plain), fewest=4, fitted_policy="dots")
    group, after = next_group(state)
    assert group is tensor and after.pending == (plain,) and (after.fewest, after.fitted_policy) == (None, "")
    # 0.7 s of tensor-axis traffic seen on tensor=2 makes the first group 1.7 > 1.5.
    group, after = next_group(dataclasses.replace(state, tensor_seen={2: 0.7}))
    assert group is plain and after.pending == (tensor,)


# --- prune -------------------------------------------------------------------------------------------


def _pruning_state(**changes):
    """Family members 0-3 (1, 2, 4, 8 microbatches, bounds 9.0, 9.7, 9.9, 10.5 ms); 4 is the best, 10 ms."""
    bounds = [9.0 * MS, 9.7 * MS, 9.9 * MS, 10.5 * MS]
    members = [_candidate(m, "dots", bound_seconds=b) for m, b in zip((1, 2, 4, 8), bounds)]
    state = SearchState((*members, _compiled(1, 10.0 * MS)), (), best=4)
    return dataclasses.replace(state, **changes), _family(range(4), remat="dots", bound=bounds[0])


def test_prune_keeps_the_members_whose_bound_is_more_than_rtol_below_the_best():
    state, family = _pruning_state()
    # 9.0 * 1.02 = 9.18 and 9.7 * 1.02 = 9.894 are below 10; 9.9 * 1.02 = 10.098 is not.
    assert prune(state, family, Limits(budget=10**9, rtol=0.02)) == ((0, 1), "")
    assert prune(state, family, Limits(budget=10**9, rtol=0.0)).members == (0, 1, 2)
    # A cheaper policy of the group fitted with 2 microbatches: only fewer could still win.
    assert prune(dataclasses.replace(state, fewest=2), family, Limits(10**9)).members == (0,)


def test_prune_names_why_a_family_is_skipped():
    state, family = _pruning_state(fewest=1, fitted_policy="none")
    assert prune(state, family, Limits(10**9)) == ((), "more recompute than remat none at no fewer microbatches")
    # Exhaustive: nothing is ruled out by the search's assumptions, only by the budget.
    assert prune(state, family, Limits(10**9, exhaustive=True)) == ((), "")
    heavy = dataclasses.replace(family, argument_bytes=2048)
    assert prune(state, heavy, Limits(2047, exhaustive=True)).note == "state and batch alone take 2.0 KiB a device"

    state, family = _pruning_state(best=None)
    larger = _family([9], shape={"fsdp": 4}, remat="dots")  # the same 4 rows, fsdp 4 >= 1: holds less
    failed = dataclasses.replace(state, failed=(larger,))
    assert prune(failed, family, Limits(10**9)) == (
        (0, 1, 2, 3),
        "does not fit: the same rows with a larger fsdp axis did not",
    )
    other_policy = dataclasses.replace(state, failed=(dataclasses.replace(larger, remat="none"),))
    assert prune(other_policy, family, Limits(10**9)).note == ""


def test_prune_adds_the_tensor_axis_cost_seen_to_the_bound():
    state, _ = _pruning_state()
    family = _family(range(4), shape={"data": 2, "tensor": 2}, remat="dots", bound=9.0 * MS)
    # 9.0 + 0.5 = 9.5 ms, * 1.02 = 9.69 < 10 stays; 9.7 + 0.5 = 10.2 ms does not.
    assert prune(dataclasses.replace(state, tensor_seen={2: 0.5 * MS}), family, Limits(10**9)).members == (0,)
    seen = dataclasses.replace(state, tensor_seen={2: 1.5 * MS})
    assert prune(seen, family, Limits(10**9)) == ((), f"bound {format_seconds(10.5 * MS)} is not below the best found")
    assert format_seconds(10.5 * MS) == "10.5 ms"


def test_skip_notes_every_member_and_nothing_else():
    state, family = _pruning_state()
    after = skip(state, family, "why")
    assert [c.note for c in after.candidates] == ["why"] * 4 + [""]
    assert state.candidates[0].note == ""  # the state given is unchanged


# --- compile a family, record it ---------------------------------------------------------------------


def _fake_compiler(fitting_from, predicted=lambda m: m * MS, tensor=0.0):
    calls = []

    def compile_one(candidate):
        calls.append(candidate.setting.num_microbatches)
        m = candidate.setting.num_microbatches
        done = dataclasses.replace(
            candidate, peak_bytes=1000 // m, fits=m >= fitting_from, predicted_seconds=predicted(m)
        )
        return Compiled(done, tensor)

    return compile_one, calls


def test_compile_family_bisects_to_the_first_member_that_fits():
    counts = (1, 2, 4, 8, 16)
    state = SearchState(tuple(_candidate(m) for m in counts), ())
    family = _family(range(5))
    compile_one, calls = _fake_compiler(fitting_from=4)
    compiled, found = compile_family(state, family, family.members, compile_one, exhaustive=False)
    # The fewest (1: no), the most (16: yes), then halves: 4 (yes), 2 (no).
    assert calls == [1, 16, 4, 2] and list(compiled) == [0, 4, 2, 1] and found == 2
    compile_one, calls = _fake_compiler(fitting_from=32)
    assert compile_family(state, family, family.members, compile_one, exhaustive=False)[1] is None
    assert calls == [1, 16]  # the most does not fit: none does
    compile_one, calls = _fake_compiler(fitting_from=4)
    compiled, found = compile_family(state, family, (0, 1), compile_one, exhaustive=True)
    assert calls == [1, 2, 4, 8, 16] and found == 2  # every member, pruned or not


def test_record_keeps_the_fastest_fitting_candidate_and_the_groups_fewest_microbatches():
    state = SearchState((_candidate(1), _candidate(2), _candidate(4), _compiled(1, 3.0 * MS)), (), best=3)
    family = _family(range(3), shape={"data": 2, "tensor": 2}, remat="dots")
    compiled = {
        0: Compiled(_compiled(1, 1.0 * MS, fits=False), 0.4),
        1: Compiled(_compiled(2, 2.0 * MS), 0.3),
        2: Compiled(_compiled(4, 2.0 * MS), 0.2),
    }
    after = record(dataclasses.replace(state, tensor_seen={2: 0.25}), family, (0, 1, 2), compiled, found=1)
    # 2.0 ms beats 3.0 ms; the equal 2.0 ms of member 2 does not replace it; member 0 does not fit.
    assert after.best == 1 and after.best_seconds == 2.0 * MS
    assert (after.fewest, after.fitted_policy) == (2, "dots")
    assert after.tensor_seen == {2: 0.2} and after.candidates[:3] == tuple(r.candidate for r in compiled.values())
    assert after.failed == () and state.candidates[0].peak_bytes is None
    assert record(state, family, (0, 1, 2), compiled, found=1).tensor_seen == {2: 0.2}  # the first seen


def test_record_marks_a_family_failed_only_when_no_member_was_pruned():
    state = SearchState((_candidate(1), _candidate(2)), (), best=None, fewest=None)
    family = _family(range(2))
    compiled = {0: Compiled(_compiled(1, MS, fits=False), 0.0), 1: Compiled(_compiled(2, MS, fits=False), 0.0)}
    failed = record(state, family, (0, 1), compiled, found=None)
    assert failed.failed == (family,) and failed.best is None and failed.tensor_seen == {}
    assert record(state, family, (0,), {0: compiled[0]}, found=None).failed == ()


# --- the loop --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("truth", "calls", "best", "full_note"),
    [
        # "none" fits from 2 microbatches (10 ms): "full" may try only 1, which does not fit.
        ({0: (False, 9.0), 1: (True, 10.0), 2: (True, 11.0), 3: (False, 9.5)}, [0, 2, 1, 3], 1, ""),
        # "none" fits with 1: "full" recomputes more at no fewer microbatches, never compiled.
        ({0: (True, 10.0)}, [0], 0, "more recompute than remat none at no fewer microbatches"),
    ],
)
def test_run_search_compiles_what_the_rules_need_and_finds_the_fastest(truth, calls, best, full_note):
    """Two groups: data=4 ("none" then "full") and fsdp=4 ("step"), whose bound 10.5 ms * 1.02 is not
    below the 10 ms found, so it is never compiled."""
    counts = (1, 2, 4)
    candidates = [_candidate(m, "none", bound_seconds=5 * MS) for m in counts]
    candidates += [_candidate(m, "full", bound_seconds=6 * MS) for m in counts]
    candidates += [_candidate(m, "none", "fsdp=4", "step", bound_seconds=10.5 * MS) for m in counts]
    families = [
        _family((0, 1, 2), remat="none", estimate=5 * MS, bound=5 * MS),
        _family((3, 4, 5), remat="full", estimate=6 * MS, bound=6 * MS),
        _family((6, 7, 8), shape={"fsdp": 4}, reduce="step", estimate=12 * MS, bound=10.5 * MS),
    ]
    seen = []

    def compile_one(c):
        i = candidates.index(c)
        seen.append(i)
        fits, ms = truth[i]
        return Compiled(dataclasses.replace(c, peak_bytes=1, fits=fits, predicted_seconds=ms * MS), 0.0)

    state = run_search(start(candidates, families, {"none": 1.0, "full": 2.0}), Limits(10**9), compile_one)
    assert seen == calls and state.best == best and state.pending == ()
    assert state.candidates[4].note == full_note and not state.candidates[4].compiled
    assert [c.note for c in state.candidates[6:]] == ["bound 10.5 ms is not below the best found"] * 3


# --- the plan's rows --------------------------------------------------------------------------------


def test_final_row_says_why_a_candidate_was_not_chosen():
    chosen = _compiled(1, 10.0 * MS)
    assert final_row(_compiled(1, 12.0 * MS), chosen, 0.02).note == "predicted 12.0 ms, +20.0%"
    assert final_row(_compiled(1, 9.0 * MS, fits=False), chosen, 0.02).note == "peak 1000 B over the budget"
    # 9.9 * 1.02 = 10.098 >= 10: ruled out by its bound; 9.7 * 1.02 = 9.894 < 10: by a fitting count.
    assert (
        final_row(_candidate(2, bound_seconds=9.9 * MS), chosen, 0.02).note
        == "bound 9.9 ms is not below the best found"
    )
    assert final_row(_candidate(2, bound_seconds=9.7 * MS), chosen, 0.02).note == "fewer microbatches fit"
    assert final_row(_candidate(2, note="skipped early"), chosen, 0.02).note == "skipped early"


def test_rank_orders_by_predicted_time_then_keeps_the_uncompiled_in_order():
    rows = [_candidate(1), _compiled(2, 3.0), _candidate(4), _compiled(8, 1.0)]
    assert [c.setting.num_microbatches for c in rank(rows)] == [8, 2, 1, 4]


def test_strip_drops_an_executable_unless_kept():
    c = _compiled(1, 1.0, executable="exe")
    assert strip(c, keep=False).executable is None and strip(c, keep=True).executable == "exe"
    assert strip(c, keep=False) == c  # executables take no part in equality


def test_priced_fills_the_cost_models_figures():
    cost = StepCost(flops=2e9, bytes=300, collectives=4, compute_seconds=0.25, communication_seconds=0.5)
    c = priced(_compiled(1, None), cost, compile_seconds=1.5)
    assert (c.flops, c.bytes_per_step, c.collectives) == (2e9, 300, 4)
    assert (c.compute_seconds, c.communication_seconds, c.predicted_seconds, c.compile_seconds) == (
        0.25,
        0.5,
        0.75,
        1.5,
    )


# --- the settings values -----------------------------------------------------------------------------


def test_search_space_checks_its_axes_when_made():
    assert SearchSpace(meshes=[{"data": 2}], reductions=["step"]).cluster_only == ["meshes", "reductions"]
    with pytest.raises(ValueError, match="unknown policy='sometimes'"):
        SearchSpace(remat_policies=["sometimes"])
    with pytest.raises(ValueError, match=r"reductions must be among \('auto', 'step', 'microbatch'\), got 'often'"):
        SearchSpace(reductions=["often"])
    with pytest.raises(ValueError, match="SearchSpace.microbatches must hold positive ints, got 0"):
        SearchSpace(microbatches=[0, 1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        SearchSpace().remat_policies = ("none",)


def test_split_options_sorts_flat_keywords_into_the_two_values():
    space, search, rest = split_options(
        {"meshes": [{"data": 2}], "rtol": 0.1, "exhaustive": True, "has_aux": True, "candidates": []}
    )
    assert space == {"meshes": [{"data": 2}]} and search == {"rtol": 0.1, "exhaustive": True}
    assert rest == {"has_aux": True, "candidates": []}


def test_family_rows_shows_one_member_a_family_the_chosen_first():
    fast, slow = _compiled(2, 1.0), _compiled(1, 2.0)
    unfit = _compiled(1, 0.5, fits=False, mesh="fsdp=4")
    chosen = _compiled(4, 3.0, remat="full")
    rows = [slow, fast, unfit, _candidate(2, mesh="fsdp=4"), _candidate(1, "dots"), _candidate(2, "dots"), chosen]
    # The chosen; then by predicted time: the last compiled of fsdp=4 (0.5, though it does not fit),
    # the fastest fitting of data=4 (1.0, not 2.0); dots, never compiled, last: its last member.
    assert family_rows(rows, chosen) == [chosen, unfit, fast, rows[5]]
    assert family_rows(rows, chosen)[0] is chosen
