"""Tests for leanstep.inspection.residuals: what each remat policy saves for the backward pass, and its bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.residual_blocks import (
    ALL_POLICIES,
    LAYERS,
    PARAMS,
    STACKED,
    B,
    D,
    H,
    L,
    X,
    block,
    loop_stack,
    scan_stack,
)
from leanstep.blocks.rematerialization import REMAT_POLICIES, remat
from leanstep.inspection.residuals import (
    RESIDUAL_KINDS,
    ResidualReport,
    saved_residuals_report,
    short_dtype_name,
)


def report(policy, fn=block, *args):
    return saved_residuals_report(remat(fn, policy), *(args or (PARAMS, X)))


def shapes(entries):
    return sorted(e.shape for e in entries)


def primitives(rep):
    return [e.primitive for e in rep.entries]


#: What tanh's derivative keeps of an activation: tanh's output (JAX 0.10), or 1 - tanh**2 (0.11).
TANH_SAVED = ("tanh", "one_minus_square")


# ------------------------------------------------------------------ what is saved


def test_full_saves_only_arguments():
    rep = report("full")
    assert rep.count("dot_general") == 0
    assert "tanh" not in primitives(rep)
    assert {e.kind for e in rep.entries} == {"argument"}
    assert rep.activation_bytes == 0
    # b1, w1, w2 and x; b2 enters linearly and is not needed.
    assert rep.total_bytes == (H + D * H + H * D + B * D) * 4


def test_dots_saves_the_matmul_not_the_tanh():
    rep = report("dots")
    assert "tanh" not in primitives(rep)
    # x @ W1 feeds tanh, whose derivative needs it; h @ W2 only feeds additions.
    assert shapes(rep.of_kind("dot_general")) == [(B, H)]
    assert {e.kind for e in rep.entries} == {"argument", "dot_general"}
    assert rep.activation_bytes == B * H * 4
    assert rep.total_bytes == report("full").total_bytes + B * H * 4


def test_none_saves_the_tanh_activations():
    rep = saved_residuals_report(block, PARAMS, X)
    tanh = [e for e in rep.entries if e.primitive in TANH_SAVED]
    assert shapes(tanh) == [(B, H)]
    assert rep.count("dot_general") == 0
    assert rep.activation_bytes > report("full").activation_bytes
    assert rep.activation_bytes >= B * H * 4


@pytest.mark.parametrize(("policy", "names"), [("save:h", {"h"}), ("save:pre", {"pre"}), ("save:pre,h", {"pre", "h"})])
def test_save_names_saves_exactly_the_tagged_values(policy, names):
    rep = report(policy)
    assert {e.name for e in rep.of_kind("named")} == names
    assert rep.count("named") == len(names)
    assert {e.kind for e in rep.entries} == {"argument", "named"}
    assert rep.activation_bytes == len(names) * B * H * 4


def test_save_name_that_nothing_carries_saves_nothing():
    assert report("save:nonexistent") == report("full")


def test_raw_policy_callable_is_applied():
    assert report(jax.checkpoint_policies.dots_saveable) == report("dots")
    rep = report(lambda prim, *_, **__: prim.name == "tanh")
    assert [e.primitive for e in rep.entries if e.kind != "argument"] == ["tanh"]


def test_dots_no_batch_skips_batched_matmuls():
    def attention_like(x, w, v):
        scores = jnp.einsum("bij,bjk->bik", x, w)  # dot_general with batch dim b
        return jnp.tanh(jnp.tanh(scores) @ v)  # dot_general without batch dims

    args = (jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5)), jnp.ones((5, 6)))
    # Independent prediction from the jaxpr: which dot_generals have batch dimensions.
    eqns = jax.make_jaxpr(attention_like)(*args).jaxpr.eqns
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    unbatched = [e for e in dots if not e.params["dimension_numbers"][1][0]]
    assert len(dots) == 2 and len(unbatched) == 1
    dots_saved = report("dots", attention_like, *args).of_kind("dot_general")
    no_batch_saved = report("dots_no_batch", attention_like, *args).of_kind("dot_general")
    assert shapes(dots_saved) == sorted(e.outvars[0].aval.shape for e in dots)
    assert shapes(no_batch_saved) == sorted(e.outvars[0].aval.shape for e in unbatched)
    # On the MLP block, which has no batched matmul, the two policies agree.
    assert report("dots_no_batch") == report("dots")


def test_byte_totals_are_shapes_times_itemsize_and_ordered():
    totals = {}
    for policy in ALL_POLICIES:
        rep = report(policy)
        for e in rep.entries:
            assert e.nbytes == int(np.prod(e.shape, dtype=np.int64)) * np.dtype(e.dtype).itemsize
            assert e.kind in RESIDUAL_KINDS
        assert rep.total_bytes == sum(e.nbytes for e in rep.entries)
        assert rep.input_bytes + rep.activation_bytes == rep.total_bytes
        totals[policy] = rep
    for attr in ("total_bytes", "activation_bytes"):
        full, dots, none = (getattr(totals[p], attr) for p in ("full", "dots", "none"))
        assert full <= dots <= none, attr
    assert totals["full"].activation_bytes < totals["dots"].activation_bytes
    assert totals["dots"].activation_bytes < totals["none"].activation_bytes


def test_bfloat16_residuals_count_two_bytes():
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), PARAMS)
    rep = report("dots", block, p, X.astype(jnp.bfloat16))
    assert [(e.shape, e.nbytes) for e in rep.of_kind("dot_general")] == [((B, H), B * H * 2)]


def test_layer_stack_saves_per_layer():
    reps = {p: saved_residuals_report(loop_stack(remat(block, p)), LAYERS, X) for p in REMAT_POLICIES}
    assert reps["full"].count("dot_general") == 0
    assert reps["dots"].count("dot_general") == L
    assert sum(primitives(reps["none"]).count(name) for name in TANH_SAVED) == L
    assert not any(name in primitives(reps[p]) for p in ("full", "dots") for name in TANH_SAVED)
    # Between layers "full" keeps only each later layer's input x.
    assert shapes(e for e in reps["full"].entries if e.kind != "argument") == [(B, D)] * (L - 1)
    assert reps["full"].total_bytes <= reps["dots"].total_bytes <= reps["none"].total_bytes


def test_scan_stack_saves_stacked_carries_for_full():
    rep = saved_residuals_report(scan_stack(remat(block, "full", prevent_cse=False)), STACKED, X)
    assert shapes(e for e in rep.entries if e.kind != "argument") == [(L, B, D)]
    dots = saved_residuals_report(scan_stack(remat(block, "dots", prevent_cse=False)), STACKED, X)
    none = saved_residuals_report(scan_stack(block), STACKED, X)
    assert rep.activation_bytes < dots.activation_bytes < none.activation_bytes


def test_sources_are_classified():
    const = jnp.arange(3.0)
    rep = saved_residuals_report(lambda x: jnp.sin(x * const), jnp.ones(3))
    assert [(e.kind, e.primitive) for e in rep.entries] == [("constant", None), ("other", "cos")]
    jitted = saved_residuals_report(jax.jit(block), PARAMS, X)
    assert {e.primitive for e in jitted.entries if e.kind == "other"} == {"jit"}
    rep = report("dots")
    assert rep.entries[-1].source.startswith("output of dot_general from ")
    assert rep.entries[-1].description == "output of dot_general"
    assert rep.entries[0].source == "from the argument p['b1']"
    assert rep.entries[0].description == "argument p['b1']"
    assert report("save:h").of_kind("named")[0].description == "named 'h'"
    with pytest.raises(ValueError, match=r"kind='tanh'"):
        rep.count("tanh")


def test_report_table():
    rep = report("dots")
    lines = str(rep).splitlines()
    assert lines[0].split() == ["kind", "value", "bytes", "source"]
    assert len(lines) == 1 + len(rep.entries) + 3
    assert lines[-1] == f"total: {len(rep.entries)} values, {rep.total_bytes:,} bytes"
    assert f"{rep.activation_bytes:,} bytes" in lines[-2]
    assert f"{rep.input_bytes:,} bytes" in lines[-3]
    rows = lines[1 : 1 + len(rep.entries)]
    bytes_end = {len(r) - len(r.split("  ")[-1]) for r in rows}  # right-aligned column
    assert len(bytes_end) == 1
    assert isinstance(rep, ResidualReport)


@pytest.mark.parametrize(
    ("dtype", "short"),
    [
        ("bfloat16", "bf16"),
        ("float32", "f32"),
        (np.dtype("int8"), "i8"),
        ("uint32", "u32"),
        ("complex64", "c64"),
        ("bool", "bool"),
    ],
)
def test_short_dtype_names(dtype, short):
    assert short_dtype_name(dtype) == short
