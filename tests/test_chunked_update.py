"""The chunk-bounded update (leanstep.step.update.chunks, update.dependence): the same bits as the
whole-tree update, refusals named, and the peak it bounds (compile-only).

Simulated-device runs happen in a child process (this file is also its worker script)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from leanstep.blocks.masters import rows_bits
from leanstep.blocks.moments import compress_moments
from leanstep.step.spec_parts import check_update_chunk
from leanstep.step.update.chunks import Unit, chunk_plan

CHUNK = 100  # entries: the blocks' stack (3 layers) is cut a layer at a time, the small leaves packed
FORMS = {"float32": ("float32", "float32"), "lean": ("bfloat16-sr", "int8")}


def _optimizers() -> dict:
    schedule = optax.linear_schedule(0.05, 0.005, 20)
    return {
        "adamw": optax.adamw(1e-2, weight_decay=0.1),
        "lion": optax.lion(1e-3, weight_decay=0.01),
        "sgd_momentum": optax.sgd(0.05, momentum=0.9),
        "chain": optax.chain(
            optax.add_decayed_weights(1e-2), optax.scale_by_adam(), optax.scale_by_learning_rate(schedule)
        ),
    }


def _params(second_bias: bool = False) -> dict:
    keys = jax.random.split(jax.random.key(0), 4)
    blocks = {
        "w1": jax.random.normal(keys[0], (3, 16, 16)) * 0.3,
        "w2": jax.random.normal(keys[1], (3, 16, 16)) * 0.3,
        "b": jnp.zeros((3, 16)),
    }
    if second_bias:  # a fourth leaf in the stack: a layer can be looped over in two groups of leaves
        blocks["c"] = jax.random.normal(keys[3], (3, 16)) * 0.1
    return {"blocks": blocks, "out": jax.random.normal(keys[2], (16, 4)) * 0.3, "bias": jnp.zeros(4)}


def _loss(params: dict, batch: dict) -> jax.Array:
    h = batch["x"]
    for layer in range(3):
        block = jax.tree.map(lambda p, layer=layer: p[layer], params["blocks"])
        h = h + jnp.tanh(h @ block["w1"] + block["b"][None]) @ block["w2"]
        h = h + block["c"][None] if "c" in block else h
    return jnp.mean((h @ params["out"] + params["bias"][None] - batch["y"]) ** 2)


def _batch(step: int) -> dict:
    key = jax.random.fold_in(jax.random.key(1), step)
    x = jax.random.normal(key, (16, 16))
    return {"x": x, "y": jnp.tanh(x[:, :4] * 2.0)}


def _trajectory(
    optimizer: str, form: str, update_chunk: int | None, mesh=None, steps: int = 20, params: dict | None = None
) -> list[np.ndarray]:
    master, moments = FORMS[form]
    state = leanstep.TrainState.create(
        _params() if params is None else params, _optimizers()[optimizer], loss_scale="dynamic", master=master,
        moments=moments,
    )  # fmt: skip
    step = leanstep.make_train_step(
        _loss, precision="compute=bfloat16", num_microbatches=2, max_grad_norm=1.0, mesh=mesh,
        update_chunk=update_chunk, donate=False,
    )  # fmt: skip
    leaves = []
    for i in range(steps):
        state, metrics = step(state, _batch(i))
        leaves += [np.asarray(x) for x in jax.tree.leaves((state, metrics))]
    return leaves


def _identical(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b))


# --- the plan --------------------------------------------------------------------------------------


def test_plan_cuts_the_stack_a_layer_at_a_time_and_packs_the_rest():
    params = jax.tree.map(lambda p: p.astype(jnp.float32), _params())
    tx = compress_moments(optax.adamw(1e-3), "int8")
    plan, why = chunk_plan(tx, tx.init(params), params, CHUNK)
    # leaves in order: bias (4), blocks.b (3, 16), blocks.w1, blocks.w2 (3, 16, 16), out (16, 4)
    assert why is None
    assert plan.chunks == (
        (Unit(0), Unit(4)),
        (Unit(1, 0, 1), Unit(2, 0, 1), Unit(3, 0, 1)),
        (Unit(1, 1, 1), Unit(2, 1, 1), Unit(3, 1, 1)),
        (Unit(1, 2, 1), Unit(2, 2, 1), Unit(3, 2, 1)),
    )


def test_a_layer_larger_than_a_chunk_is_looped_over_a_group_of_leaves_at_a_time():
    params = jax.tree.map(lambda p: p.astype(jnp.float32), _params(second_bias=True))
    tx = compress_moments(optax.adamw(1e-3), "int8")
    plan, _ = chunk_plan(tx, tx.init(params), params, 300)
    # leaves: bias (4), blocks.b, blocks.c (3, 16), blocks.w1, blocks.w2 (3, 16, 16), out (16, 4); a layer
    # of the stack is 544 entries: w1 and w2 (256 each) in two loops, each with a bias for company
    assert plan.chunks == (
        (Unit(0), Unit(5)),
        *[(Unit(2, row, 1), Unit(3, row, 1)) for row in range(3)],
        *[(Unit(1, row, 1), Unit(4, row, 1)) for row in range(3)],
    )


@pytest.mark.parametrize("form", list(FORMS))
def test_groups_of_a_stacks_leaves_are_bit_identical_to_the_whole_tree(form):
    params = _params(second_bias=True)
    whole = _trajectory("adamw", form, None, params=params)
    assert _identical(whole, _trajectory("adamw", form, 300, params=params))
    per_step = len(whole) // 20
    assert not _identical(whole[:per_step], whole[-per_step:])  # the state moved: applied steps were compared


def test_a_leaf_whose_rows_the_optimizer_mixes_is_not_split():
    params = jax.tree.map(lambda p: p.astype(jnp.float32), _params())
    tx = optax.lamb(1e-3)  # the trust ratio: a norm over each whole leaf
    plan, _ = chunk_plan(tx, tx.init(params), params, CHUNK)
    assert all(unit.start is None for chunk in plan.chunks for unit in chunk)


def test_a_per_platform_branch_keeps_rows_and_a_branch_on_a_parameters_value_mixes_them():
    # lax.platform_dependent is a cond on an index of no parameter: rows stay where both branches
    # keep them (int8 moments search per platform); a cond on a value of the leaf mixes its rows.
    params = jax.tree.map(lambda p: p.astype(jnp.float32), _params())
    by_platform = lambda u: jax.lax.platform_dependent(u, cpu=lambda x: x * 2.0, default=lambda x: x * 3.0)
    by_value = lambda u: jax.lax.cond(jnp.sum(u) > 0, lambda x: x * 2.0, lambda x: x * 3.0, u)
    for branch, split in ((by_platform, True), (by_value, False)):
        tx = optax.GradientTransformation(
            lambda p: optax.EmptyState(), lambda u, s, p=None, f=branch: (jax.tree.map(f, u), s)
        )
        plan, why = chunk_plan(tx, tx.init(params), params, CHUNK)
        assert why is None and any(unit.start is not None for c in plan.chunks for unit in c) == split


def test_rows_bits_are_the_whole_leafs_rows():
    key = jax.random.key(7)
    whole = jax.random.bits(key, (6, 5, 3), jnp.uint32)
    for first in range(0, 6, 2):
        np.testing.assert_array_equal(rows_bits(key, (6, 5, 3), jnp.int32(first), 2), whole[first : first + 2])


# --- bit-identical -----------------------------------------------------------------------------------


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize(
    "optimizer",
    ["adamw", pytest.param("lion", marks=pytest.mark.slow), pytest.param("sgd_momentum", marks=pytest.mark.slow)],
)
def test_chunked_steps_are_bit_identical_to_the_whole_tree(optimizer, form):
    whole = _trajectory(optimizer, form, None)
    chunked = _trajectory(optimizer, form, CHUNK)
    assert _identical(whole, chunked)
    per_step = len(whole) // 20
    assert not _identical(whole[:per_step], whole[-per_step:])  # the state moved: applied steps were compared


def test_auto_equals_the_whole_tree_and_a_clip_in_the_chain_runs_whole():
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    state = leanstep.TrainState.create(_params(), tx, loss_scale="dynamic")
    with pytest.raises(
        ValueError, match=r"update_chunk=100: the optimizer's update mixes parameters \(.*clip_by_global_norm"
    ):
        leanstep.make_train_step(_loss, update_chunk=CHUNK).lower(state, _batch(0))
    runs = []
    for chunk in (None, "auto"):
        step = leanstep.make_train_step(_loss, update_chunk=chunk, donate=False)
        runs.append([np.asarray(x) for x in jax.tree.leaves(step(state, _batch(0)))])
    assert _identical(*runs)


@pytest.mark.parametrize("value", [0, -3, 1.5, "big", True])
def test_a_bad_update_chunk_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="update_chunk must be 'auto', a positive int"):
        leanstep.make_train_step(_loss, update_chunk=value)
    assert check_update_chunk(7) == 7 and check_update_chunk(None) is None


def test_a_spike_guard_on_the_loss_chunks_bit_identically():
    guard = leanstep.SpikeGuard(watch=("loss",))
    runs = []
    for chunk in (None, CHUNK):
        state = leanstep.TrainState.create(_params(), optax.adamw(1e-2), loss_scale="dynamic", spike_guard=guard)
        step = leanstep.make_train_step(_loss, update_chunk=chunk, spike_guard=guard, donate=False)
        leaves = []
        for i in range(6):
            state, metrics = step(state, _batch(i))
            leaves += [np.asarray(x) for x in jax.tree.leaves((state, metrics))]
        runs.append(leaves)
    assert _identical(*runs)


def test_a_spike_guard_on_the_update_norm_refuses_an_int_chunk():
    guard = leanstep.SpikeGuard(watch=("loss", "update_norm"))
    state = leanstep.TrainState.create(_params(), optax.adamw(1e-3), spike_guard=guard)
    step = leanstep.make_train_step(_loss, update_chunk=CHUNK, spike_guard=guard)
    with pytest.raises(ValueError, match="update_chunk=100 with a spike guard watching 'update_norm'"):
        step.lower(state, _batch(0))


# --- in child processes: XLA's default flags, simulated devices -----------------------------------

LAYOUTS = ("data", "fsdp")


def _one_device(out: Path) -> None:
    results = {form: _identical(_trajectory("chain", form, None), _trajectory("chain", form, CHUNK)) for form in FORMS}
    (out / "one_device.json").write_text(json.dumps(results))


#: XLA:CPU's flag that keeps LLVM from emitting fused multiply-adds (FMA instructions come with AVX2).
NO_FMA = "--xla_cpu_max_isa=AVX"


def _child(out: Path, mode: str, timeout: float = 900, xla_flags: str | None = None) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the suite's fast-compile flags: see test_a_chain_is_bit_identical...
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    proc = subprocess.run(
        [sys.executable, __file__, str(out), mode], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads((out / f"{mode}.json").read_text())


@pytest.mark.slow  # in this process, and in a child process with XLA's default flags: 4 runs of 20 steps
def test_a_chain_with_decay_and_a_schedule_is_bit_identical(tmp_path):
    # How LLVM fuses this chain's products and sums into multiply-adds inside the stack's loop
    # depends on XLA's flags: the 8-bit run is bit-identical under the suite's (conftest.py: no FMA
    # where its jaxlib has the older emitters, LLVM's optimizations off where not; in the latter the
    # float32 run differs in the last bit from step 5 on); under XLA's defaults (as users run) the
    # float32 run is identical and the 8-bit one is not yet (issue 40).
    assert _identical(_trajectory("chain", "lean", None), _trajectory("chain", "lean", CHUNK))
    assert _child(tmp_path, "one_device") == {"float32": True, "lean": False}


def worker(out: Path, mode: str = "worker") -> None:
    jax.config.update("jax_num_cpu_devices", 4)
    mesh = leanstep.sharding.data_mesh()
    results = {}
    if mode == "no_fma":  # and the chain on one device (test_a_chain_with_decay_and_a_schedule_...)
        for form in FORMS:
            results[f"one_device/chain/{form}"] = _identical(
                _trajectory("chain", form, None), _trajectory("chain", form, CHUNK)
            )
    for layout in LAYOUTS:
        layer = leanstep.step.ShardingLayer(mesh, fsdp=layout == "fsdp")
        for optimizer in _optimizers():
            for form in FORMS:
                name = f"{layout}/{optimizer}/{form}"
                try:
                    whole = _trajectory(optimizer, form, None, mesh=layer)
                    chunked = _trajectory(optimizer, form, CHUNK, mesh=layer)
                    results[name] = _identical(whole, chunked)
                except Exception as error:  # noqa: BLE001  # reported by the test, named
                    results[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                (out / f"{mode}.json").write_text(json.dumps(results))  # as it goes: a timeout keeps what ran


# --- the peak, compile-only ---------------------------------------------------------------------------


def _peak_per_parameter(master: str, moments: str, update_chunk) -> float:
    """Compile-only: the step's peak (arguments + outputs - aliased + temporaries) in bytes a
    parameter, the built-in transformer d 768, 14 layers, vocab 8192 (105.6M parameters)."""
    from leanstep.models.transformer import TransformerConfig, init_transformer, transformer_loss

    config = TransformerConfig(vocab_size=8192, d_model=768, n_layers=14, n_heads=12, d_ff=3072, seq_len=128)
    make = lambda key: leanstep.TrainState.create(
        init_transformer(key, config), optax.adamw(1e-3), loss_scale="dynamic", master=master, moments=moments
    )
    state = jax.eval_shape(make, jax.random.key(0))
    count = sum(x.size for x in jax.tree.leaves(state.params))
    assert count >= 100e6
    loss = functools.partial(transformer_loss, config=config, remat_policy="full")
    step = leanstep.make_train_step(
        loss, precision="compute=bfloat16", num_microbatches=2, max_grad_norm=1.0, update_chunk=update_chunk
    )
    memory = step.lower(state, {"tokens": jax.ShapeDtypeStruct((4, 129), jnp.int32)}).compile().memory_analysis()
    peak = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
    return (peak + memory.temp_size_in_bytes) / count


@pytest.fixture(scope="module")
def peaks() -> dict:
    """One compile a format (about 10 s each on two cores)."""
    return {
        "float32": _peak_per_parameter("float32", "float32", None),
        "int8 whole tree": _peak_per_parameter("bfloat16-sr", "int8", None),
        "int8": _peak_per_parameter("bfloat16-sr", "int8", "auto"),
        "bfloat16": _peak_per_parameter("bfloat16-sr", "bfloat16", "auto"),
    }


def test_the_chunked_update_bounds_the_lean_steps_peak(peaks):
    saved = 12.0 - (2.0 + 2 * (1 + 4 / 256))  # stored bytes a parameter: float32 AdamW less the lean state
    # what issue 40 found: the whole-tree update widens everything at once
    assert peaks["int8 whole tree"] > peaks["float32"], peaks
    # issue 40's bound: the lean step's peak is below float32 state's by most of what the lean state stores
    # less. It was 90% (24.95 against 16.91 bytes a parameter) until issue 58 put the whole-tree update
    # under one lax.cond: float32 state's step lost its select pass's temporaries (23.15), the chunked
    # lean step had none to lose (16.91, unchanged): on the Xeon the gap is 78% of the 7.97 bytes stored less.
    # lean-state.md's EPYC table has the lean step at 17.39 (XLA:CPU packs by ISA): about 72% there.
    assert peaks["float32"] - peaks["int8"] >= 0.65 * saved, peaks


def test_int8_moments_peak_below_bfloat16_moments(peaks):
    assert peaks["int8"] < peaks["bfloat16"], peaks


def test_clipping_adds_no_temporaries_to_the_chunked_update():
    # The norm's finiteness test covers the gradient's (update._decide): XLA:CPU kept every leaf's
    # unscaled copy live for a second pass over the gradient (9.3 bytes a parameter against 6.5).
    from leanstep.models.transformer import TransformerConfig, init_transformer

    config = TransformerConfig(vocab_size=1024, d_model=256, n_layers=4, n_heads=4, d_ff=1024, seq_len=64)
    make = lambda key: leanstep.TrainState.create(
        init_transformer(key, config), optax.adamw(1e-3), loss_scale="dynamic", master="bfloat16-sr", moments="int8"
    )
    state = jax.eval_shape(make, jax.random.key(0))
    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), state.params)
    count = sum(x.size for x in jax.tree.leaves(state.params))
    temps = {}
    for clip in (None, 1.0):
        # chunks of 2**18 entries (14 for the model's 3.4M): 2**16 gave the same temporaries (6.04 bytes a
        # parameter, with and without the clip) in twice the compile time (55 against 27 s, 2 cores)
        update = lambda s, g, clip=clip: leanstep.step.guarded_update(s, g, max_grad_norm=clip, update_chunk=2**18)[0]
        compiled = jax.jit(update, donate_argnums=0).lower(state, grads).compile()
        temps[clip] = compiled.memory_analysis().temp_size_in_bytes / count
    assert temps[1.0] <= temps[None] + 0.25, temps


@pytest.mark.slow  # a whole benchmark script's dry run: the run is the point
def test_tpu_fit_dry_run(tmp_path):
    from benchmarks.tpu_fit import main

    out = tmp_path / "fit.json"
    report = main(["--tiny", "--formats", "bf16-sr + int8 (chunked update)", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    run = report["train"]["bf16-sr + int8 (chunked update)"]
    assert len(run["losses"]) == 3 and np.all(np.isfinite(run["losses"]))
    assert report["formats"]["bf16-sr + int8 (chunked update)"]["peak_bytes"] > 0


@pytest.mark.slow  # a whole benchmark script's dry run: the run is the point
def test_tpu_fit_dry_run_trains_the_update_in_backward_beside_the_standard_step(tmp_path):
    from benchmarks.tpu_fit import main

    names = ["bf16-sr + int8 (chunked update)", "bf16-sr + int8 (update in backward)"]
    report = main(["--tiny", "--formats", ",".join(names), "--train", ",".join(names)])
    for name in names:
        assert report["formats"][name]["peak_bytes"] > 0
        losses = report["train"][name]["losses"]
        assert len(losses) == 3 and np.all(np.isfinite(losses)) and not any(report["train"][name]["skipped"])
    # the same loss, the same first step: the first losses agree (bf16 compute: to 1e-3)
    first = [report["train"][name]["losses"][0] for name in names]
    assert first[1] == pytest.approx(first[0], rel=1e-3)


if __name__ == "__main__":
    modes = {"worker": worker, "no_fma": functools.partial(worker, mode="no_fma"), "one_device": _one_device}
    modes[sys.argv[2]](Path(sys.argv[1]))
