"""Lean optimizer state (issue 29): moments in bfloat16 or 8-bit blocks, bfloat16 masters with
stochastic rounding, composed with the step.

Quantization against an independent float64 NumPy reference per block; memory from XLA's memory
analysis; the step's collectives under ``fsdp=8`` (8 simulated devices, a subprocess) unchanged;
a skipped step bit-identical; stochastic rounding unbiased and deterministic; round-to-nearest
masters refused, and as a (test-only) control, shown to stall.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from helpers.workers import run_worker
from leanstep.blocks import moments as moments_module
from leanstep.blocks.dynamic_map import decode_with, map_tables
from leanstep.blocks.masters import ROUND_TO_NEAREST_CONTROL, stochastic_round
from leanstep.blocks.moments import QuantizedArray, dequantize, dynamic_map, quantize

# --- the map and the blocks, against float64 NumPy ---------------------------------------------------


def ref_map(signed: bool) -> np.ndarray:
    """The dynamic map from the paper's description, in float64: per exponent e of 0..6, the
    midpoints of an even split of [0.1, 1] into 2**e (signed) or 2**(e+1) parts, times
    10**(e-6); their negatives if signed; 0 and 1; signed, -1 in place of the smallest negative."""
    values = {0.0, 1.0}
    for e in range(7):
        parts = 2**e if signed else 2 ** (e + 1)
        edges = [0.1 + 0.9 * k / parts for k in range(parts + 1)]
        for a, b in itertools.pairwise(edges):
            values.add((a + b) / 2 * 10.0 ** (e - 6))
            if signed:
                values.add(-(a + b) / 2 * 10.0 ** (e - 6))
    ordered = sorted(values)
    if signed:
        ordered.remove(max(v for v in ordered if v < 0))
        ordered = sorted([*ordered, -1.0])
    return np.asarray(ordered, np.float64)


def ref_map_float32(signed: bool) -> np.ndarray:
    """The map as float32 holds it: each exact ratio ``k / d`` of ``ref_map`` (``k = 2n + 18i + 9``
    over ``d = 2n * 10**(7 - e)``, the same midpoints) as the float32 product ``k * fl32(1 / d)``."""
    values = {0.0, 1.0}
    for e in range(7):
        parts = 2**e if signed else 2 ** (e + 1)
        d = 2 * parts * 10 ** (7 - e)
        for i in range(parts):
            v = float(np.float32(2 * parts + 18 * i + 9) * np.float32(1.0 / d))
            values.update({v, -v} if signed else {v})
    ordered = sorted(values)
    if signed:
        ordered.remove(max(v for v in ordered if v < 0))
        ordered = sorted([*ordered, -1.0])
    return np.asarray(ordered, np.float32)


def ref_quantize(x: np.ndarray, signed: bool, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scales, decoded) of ``x`` (float32), block by block along the last axis, in float64."""
    values = ref_map_float32(signed).astype(np.float64)
    mids = ((values[:-1] + values[1:]) / 2).astype(np.float32).astype(np.float64)
    x = np.asarray(x, np.float32).reshape(-1, np.shape(x)[-1] if np.ndim(x) else 1)
    n = x.shape[1]
    codes, scales, decoded = np.zeros(x.shape, np.uint8), [], np.zeros(x.shape, np.float32)
    for row in range(x.shape[0]):
        row_scales = []
        for start in range(0, n, block):
            chunk = x[row, start : start + block].astype(np.float64)
            a = np.max(np.abs(chunk))
            row_scales.append(a)
            normalized = (chunk / a).astype(np.float32).astype(np.float64) if a > 0 else np.zeros_like(chunk)
            c = np.array([np.sum(mids < v) for v in normalized])
            codes[row, start : start + block] = c
            decoded[row, start : start + block] = (values[c] * a).astype(np.float32)
        scales.append(row_scales)
    return codes, np.asarray(scales, np.float32), decoded


def test_the_map_equals_the_papers_construction():
    for signed in (True, False):
        np.testing.assert_array_equal(dynamic_map(signed), ref_map_float32(signed))
        # within 1.5 units in the last place of the float64 construction (the product rounds twice)
        exact = ref_map(signed)
        ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
        np.testing.assert_array_less(np.abs(dynamic_map(signed) - exact), 1.5 * ulp)
    assert dynamic_map(True)[0] == -1.0 and dynamic_map(True)[-1] == 1.0 and 0.0 in dynamic_map(True)


def _cases(rng: np.random.Generator) -> list[tuple[str, np.ndarray, bool]]:
    normal = rng.normal(size=(3, 700)).astype(np.float32) * 10.0 ** rng.integers(-8, 3, size=(3, 1))
    zeros_block = normal.copy()
    zeros_block[1, 256:512] = 0.0
    huge = normal.copy()
    huge[2, 300] = 1e30
    negative_max = normal.copy()
    negative_max[0, 10] = -1e3
    second_moment = np.abs(normal) ** 2
    return [
        ("normal, a tail block of 188", normal, True),
        ("a block of zeros", zeros_block, True),
        ("a block with one huge value", huge, True),
        ("a negative largest value", negative_max, True),
        ("non-negative, unsigned", second_moment, False),
        ("one row, shorter than a block", normal[0, :37], True),
        ("a scalar", np.float32(-3.5), True),
        ("3-D", rng.normal(size=(2, 3, 300)).astype(np.float32), True),
    ]


@pytest.mark.parametrize("index", range(8))
def test_quantize_and_dequantize_equal_the_float64_reference_per_block(index):
    name, x, signed = _cases(np.random.default_rng(0))[index]
    q = jax.jit(lambda v: quantize(v, signed=signed, block_size=256))(jnp.asarray(x))
    codes, scales, decoded = ref_quantize(x, signed, 256)
    np.testing.assert_array_equal(np.asarray(q.codes).reshape(codes.shape), codes, err_msg=name)
    np.testing.assert_array_equal(np.asarray(q.scales).reshape(scales.shape), scales, err_msg=name)
    np.testing.assert_array_equal(np.asarray(dequantize(q)).reshape(decoded.shape), decoded, err_msg=name)
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == np.shape(x)


@pytest.mark.parametrize("signed", [True, False])
def test_the_accelerators_search_finds_the_cpus_codes(signed):
    # quantize searches the midpoints by gathers on a CPU and by compare-and-count elsewhere
    # (lax.platform_dependent): the accelerator's branch, run here, must find the same codes.
    _, mids = map_tables(signed)
    x = np.concatenate([c[1].ravel() for c in _cases(np.random.default_rng(2)) if c[2] == signed])
    normalized = jnp.asarray(np.concatenate([x / np.max(np.abs(x)), mids, np.nextafter(mids, 2.0), [0.0, 1.0]]))
    codes = {m: moments_module._search(m)(jnp.asarray(mids), normalized) for m in ("scan", "compare_all")}
    np.testing.assert_array_equal(codes["compare_all"], codes["scan"])
    np.testing.assert_array_equal(codes["scan"], [np.sum(mids < v) for v in np.asarray(normalized)])


@pytest.mark.parametrize("form", ["decode", "arithmetic"])
@pytest.mark.parametrize("signed", [True, False])
def test_decode_is_the_map_for_every_code(signed, form):
    # dequantize decodes by a lookup on a CPU and by arithmetic (no gather) on an accelerator; each,
    # run here, must give every one of the 256 codes the map's value, bit for bit (the reference's
    # loop over the paper's parts, an independent form).
    codes = jnp.arange(256, dtype=jnp.uint8)
    if form == "decode":
        fn = lambda c: moments_module.decode(c, signed=signed)
    else:
        fn = lambda c: decode_with(jnp, c.astype(jnp.int32), signed)
    got = np.asarray(jax.jit(fn)(codes))
    np.testing.assert_array_equal(got.view(np.uint32), ref_map_float32(signed).view(np.uint32))


@pytest.mark.parametrize(("platform", "gathers"), [("cpu", True), ("tpu", False), ("cuda", False)])
def test_decode_looks_codes_up_on_a_cpu_only(platform, gathers):
    # an accelerator's gathers are slow (a TPU v5e: 9.6 ns an entry against 0.045 for the arithmetic)
    codes = jax.ShapeDtypeStruct((4, 256), jnp.uint8)
    traced = jax.jit(lambda c: moments_module.decode(c, signed=True)).trace(codes)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert ("stablehlo.gather" in text) == gathers, platform


def test_a_step_traces_the_codec_once_per_shape_and_format_not_once_per_leaf(monkeypatch):
    # Ten leaves of one shape (one no other test uses: JAX keeps its traces for the process), both
    # formats: quantize and dequantize, each of which splits its array in blocks once when it is
    # traced, are traced once a format (4 splits), not once a leaf (40).
    tree = {f"w{i}": jnp.full((5, 299), 0.5 + i, jnp.float32) for i in range(10)}
    splits = []
    blocks = moments_module._blocks
    monkeypatch.setattr(moments_module, "_blocks", lambda *args: splits.append(1) or blocks(*args))
    jax.make_jaxpr(lambda t: [dequantize(quantize(v, signed=s)) for v in t.values() for s in (True, False)])(tree)
    assert len(splits) == 4


def test_the_blocks_error_is_small_where_it_matters():
    x = np.random.default_rng(1).normal(size=(4, 1024)).astype(np.float32)
    back = np.asarray(dequantize(quantize(jnp.asarray(x), signed=True)))
    assert np.max(np.abs(back - x)) < 0.02 * np.max(np.abs(x))  # the coarsest step near the block's max
    assert np.array_equal(
        back[np.abs(x) == np.max(np.abs(x), axis=1, keepdims=True)],
        x[np.abs(x) == np.max(np.abs(x), axis=1, keepdims=True)],
    )


# --- memory, from XLA's memory analysis -------------------------------------------------------------

SHAPES = {"w": (1024, 1024), "b": (1024,), "v": (512, 300)}


def _bytes(tree) -> int:
    return jax.jit(lambda t: t).lower(tree).compile().memory_analysis().argument_size_in_bytes


@pytest.fixture(scope="module")
def states():
    tx = optax.adamw(1e-3)
    forms = [("float32", "float32"), ("float32", "bfloat16"), ("float32", "int8"), ("bfloat16-sr", "int8"),
             ("bfloat16-sr-kahan", "int8")]  # fmt: skip
    params = {name: jnp.zeros(shape) for name, shape in SHAPES.items()}
    return {f: leanstep.TrainState.create(params, tx, master=f[0], moments=f[1]) for f in forms}


def test_adamw_state_is_half_with_bf16_moments_and_at_most_027_with_8_bit(states):
    full = _bytes(states["float32", "float32"].opt_state)
    assert _bytes(states["float32", "bfloat16"].opt_state) / full == pytest.approx(0.50, abs=1e-4)
    ratio = _bytes(states["float32", "int8"].opt_state) / full
    assert ratio <= 0.27 and ratio == pytest.approx((1 + 4 / 256) / 4, abs=0.003)  # scales included


@pytest.mark.parametrize("master", ["bfloat16-sr", "bfloat16-sr-kahan"])
def test_the_whole_state_with_8_bit_moments_and_bf16_masters_is_at_most_8_bytes_a_parameter(states, master):
    state = states[master, "int8"]
    count = sum(int(np.prod(shape)) for shape in SHAPES.values())
    per_parameter = _bytes((state.params, state.opt_state, state.master_error)) / count
    assert per_parameter <= 8.0
    assert per_parameter == pytest.approx(2 + 2 * (1 + 4 / 256) + (2 if "kahan" in master else 0), abs=0.1)


# --- the step ------------------------------------------------------------------------------------------


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _problem(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"w1": jax.random.normal(k1, (16, 300)) * 0.1, "w2": jax.random.normal(k2, (300, 4)) * 0.1}
    rng = np.random.default_rng(seed)
    batch = {"x": rng.normal(size=(32, 16)).astype(np.float32), "y": rng.normal(size=(32, 4)).astype(np.float32)}
    return params, batch


STEP = leanstep.make_train_step(_loss, precision="compute=bfloat16", num_microbatches=2, max_grad_norm=1.0)
TX = optax.adamw(3e-3)


@pytest.mark.parametrize(
    ("master", "moments"), [("float32", "int8"), ("bfloat16-sr-kahan", "int8"), ("bfloat16-sr", "bfloat16")]
)
def test_a_skipped_step_leaves_every_compressed_leaf_bit_identical(master, moments):
    params, batch = _problem()
    state = leanstep.TrainState.create(params, TX, loss_scale="dynamic", master=master, moments=moments)
    for _ in range(3):
        state, _ = STEP(state, batch)
    before = [np.asarray(x).copy() for x in jax.tree.leaves((state.params, state.opt_state, state.master_error))]
    bad = dict(batch, x=batch["x"].copy())
    bad["x"][3, 1] = np.inf
    state, metrics = STEP(state, bad)
    assert bool(metrics.skipped)
    after = [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state, state.master_error))]
    assert len(before) == len(after) and all(a.tobytes() == b.tobytes() for a, b in zip(before, after))
    if moments == "int8":
        assert isinstance(state.opt_state[0].mu["w1"], QuantizedArray)


def test_compressed_moments_train_like_float32_ones():
    params, batch = _problem()
    losses = {}
    for moments in ("float32", "bfloat16", "int8"):
        state = leanstep.TrainState.create(params, TX, moments=moments)
        for _ in range(40):
            state, metrics = STEP(state, batch)
        losses[moments] = float(metrics.loss)
    assert losses["float32"] < 0.5 * float(_loss(params, batch))
    assert abs(losses["int8"] - losses["float32"]) < 0.05 * losses["float32"]
    assert abs(losses["bfloat16"] - losses["float32"]) < 0.05 * losses["float32"]


@pytest.mark.parametrize("name", ["adam", "lion", "adafactor"])
def test_any_optimizer_with_moment_shaped_state_and_adafactors_factors_left_alone(name):
    tx = {"adam": optax.adam(1e-3), "lion": optax.lion(1e-4), "adafactor": optax.adafactor(1e-3)}[name]
    params, batch = _problem()
    state = leanstep.TrainState.create(params, tx, moments="int8")
    state, metrics = STEP(state, batch)
    leaves = jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, QuantizedArray))
    quantized = [x for x in leaves if isinstance(x, QuantizedArray)]
    assert not bool(metrics.skipped)
    if name == "adafactor":  # factored statistics are not shaped like the parameters: kept
        assert all(x.dtype == jnp.float32 for x in leaves if not isinstance(x, QuantizedArray) and x.ndim)
    else:
        assert len(quantized) == (4 if name == "adam" else 2)


# --- bfloat16 masters ------------------------------------------------------------------------------------


def test_stochastic_rounding_is_unbiased_and_deterministic():
    x = jnp.full(200_000, 1.0 + 3 * 2.0**-10, jnp.float32)  # 3/8 of the way from 1 to the next bf16
    a = stochastic_round(x, jax.random.key(0))
    assert np.mean(np.asarray(a, np.float32)) == pytest.approx(1.0 + 3 * 2.0**-10, abs=2e-5)
    assert set(np.unique(np.asarray(a, np.float32))) == {1.0, 1.0078125}
    assert np.array_equal(np.asarray(a), np.asarray(stochastic_round(x, jax.random.key(0))))
    assert not np.array_equal(np.asarray(a), np.asarray(stochastic_round(x, jax.random.key(1))))
    special = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, -0.0])
    out = np.asarray(stochastic_round(special, jax.random.key(2)), np.float32)
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2]) and out[3] == 0 and out[4] == 0


def test_round_to_nearest_masters_are_refused_naming_why_and_what_works():
    with pytest.raises(ValueError, match=r"half an ulp.*bfloat16-sr.*bfloat16-sr-kahan.*moments='int8'"):
        leanstep.TrainState.create({"w": jnp.ones(2)}, TX, master="bfloat16")
    with pytest.raises(ValueError, match="master must be one of"):
        leanstep.TrainState.create({"w": jnp.ones(2)}, TX, master="float16")


def test_the_round_to_nearest_control_stalls_where_stochastic_rounding_moves():
    """A small, steady update: round to nearest loses all of it, stochastic rounding keeps it on average."""
    params = {"w": jnp.ones((4096,))}
    sgd = optax.sgd(1e-4)
    step = leanstep.make_train_step(lambda p, b: -jnp.mean(p["w"]) * 4096.0)  # the gradient is -1 everywhere
    moved = {}
    for master in (ROUND_TO_NEAREST_CONTROL, "bfloat16-sr"):
        state = leanstep.TrainState.create(params, sgd, master=master)
        for _ in range(20):
            state, _ = step(state, {"x": jnp.zeros(1)})
        moved[str(master)] = float(jnp.mean(state.params["w"].astype(jnp.float32))) - 1.0
    assert moved["ROUND_TO_NEAREST_CONTROL"] == 0.0
    assert moved["bfloat16-sr"] == pytest.approx(20 * 1e-4, rel=0.1)


def test_a_resumed_bf16_sr_run_rounds_as_the_uninterrupted_one(tmp_path):
    params, batch = _problem()
    new = lambda: leanstep.TrainState.create(params, TX, master="bfloat16-sr-kahan", moments="int8", seed=3)
    straight = new()
    for _ in range(4):
        straight, _ = STEP(straight, batch)
    resumed = new()
    for _ in range(2):
        resumed, _ = STEP(resumed, batch)
    with leanstep.checkpoints.Checkpointer(tmp_path / "ckpt") as checkpointer:
        checkpointer.save(2, resumed)
        resumed = checkpointer.restore(new()).state
    for _ in range(2):
        resumed, _ = STEP(resumed, batch)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


# --- the planner sizes it ----------------------------------------------------------------------------


def test_the_plan_sizes_the_state_in_its_format_and_says_what_it_saves():
    from leanstep.planning.plan_inputs import state_format_notes

    params = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in SHAPES.items()}
    count = sum(int(np.prod(shape)) for shape in SHAPES.values())
    (note,) = state_format_notes(
        params, optax.adamw(1e-3), leanstep.StepSpec(master="bfloat16-sr", moments="int8"), None
    )
    # float32: 4 (master) + 8 (moments); compressed: 2 + 2 bytes and a float32 scale per block of
    # 256 along the last axis of each moment (b: 4 blocks; w: 1024 x 4; v: 512 x 2, its tail short).
    blocks = 4 + 1024 * 4 + 512 * 2
    lean = (2 * count + 2 * (count + 4 * blocks)) / count
    assert f"{lean:.2f} bytes a parameter" in note and "against 12.00 in float32" in note
    plan = leanstep.planning.plan(
        lambda policy: _loss, _problem()[0], {"x": jnp.zeros((32, 16)), "y": jnp.zeros((32, 4))}, TX,
        leanstep.StepSpec(moments="int8"), budget_bytes="64MiB", candidates=[(1, "none", "float32")],
    )  # fmt: skip
    assert any("moments='int8'" in n for n in plan.notes)


# --- beside bitsandbytes (a benchmark extra) ----------------------------------------------------------


def test_beside_bitsandbytes_the_same_problem_the_same_bytes_and_the_same_curve():
    pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    from benchmarks.lean_state_peer import measure

    rows = measure(steps=20)["rows"]
    ours, theirs = rows["leanstep int8"], rows["bitsandbytes int8"]
    assert rows["leanstep float32"]["final_loss"] == pytest.approx(rows["torch float32"]["final_loss"], rel=1e-4)
    assert ours["bytes_per_parameter"] == pytest.approx(2 * (1 + 4 / 256), abs=0.01)
    assert ours["bytes_per_parameter"] <= theirs["bytes_per_parameter"]
    assert ours["final_loss"] == pytest.approx(theirs["final_loss"], rel=0.02)


# --- fsdp=8: the same collectives -------------------------------------------------------------------


def worker(out: Path) -> None:
    jax.config.update("jax_num_cpu_devices", 8)
    from leanstep.sharding.distributed import device_mesh

    mesh = device_mesh(shape={"fsdp": 8})
    # w1's largest dimension (fsdp's) is its last: 256 columns a device, one block each.
    params = {"w1": jnp.zeros((64, 2048)), "w2": jnp.zeros((2048, 64))}
    loss = lambda p, b: jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)
    batch = {"x": jnp.zeros((16, 64)), "y": jnp.zeros((16, 64))}
    step = leanstep.make_train_step(loss, precision="compute=bfloat16", max_grad_norm=1.0, mesh=mesh)
    rows = {}
    for master, moments in (
        ("float32", "float32"),
        ("float32", "int8"),
        ("float32", "bfloat16"),
        ("bfloat16-sr", "int8"),
    ):
        state = leanstep.TrainState.create(params, optax.adamw(1e-3), master=master, moments=moments)
        state = leanstep.step.shard_train_state(state, mesh)
        report = leanstep.inspection.collectives_report(
            step.lower(state, leanstep.sharding.shard_batch(batch, mesh)).compile(), mesh
        )
        rows[f"{master}/{moments}"] = sorted([c.kind, list(c.axes), c.payload, c.trips] for c in report.collectives)
    # A one-device checkpoint of the compressed state restored onto fsdp=8: bit for bit, split.
    one = leanstep.TrainState.create(params, optax.adamw(1e-3), master="bfloat16-sr-kahan", moments="int8")
    one, _ = leanstep.make_train_step(loss, precision="compute=bfloat16")(one, batch)
    with leanstep.checkpoints.Checkpointer(out / "ckpt") as checkpointer:
        checkpointer.save(1, one)
        template = leanstep.TrainState.create(params, optax.adamw(1e-3), master="bfloat16-sr-kahan", moments="int8")
        restored = checkpointer.restore(leanstep.step.shard_train_state(template, mesh)).state
    rows["restored"] = {
        "same": all(
            np.asarray(a).tobytes() == np.asarray(b).tobytes()
            for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(one), strict=True)
        ),
        "codes split": not restored.opt_state[0].mu["w1"].codes.sharding.is_fully_replicated,
    }
    (out / "collectives.json").write_text(json.dumps(rows))


@pytest.fixture(scope="module")
def collectives(tmp_path_factory):
    return run_worker(__file__, tmp_path_factory.mktemp("lean_fsdp"), "collectives.json")


def test_a_compressed_checkpoint_restores_onto_another_layout(collectives):
    assert collectives["restored"] == {"same": True, "codes split": True}


@pytest.mark.parametrize("form", ["float32/int8", "float32/bfloat16", "bfloat16-sr/int8"])
def test_under_fsdp_compressed_state_adds_no_collective(collectives, form):
    assert collectives[form] == collectives["float32/float32"] and collectives[form]


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(Path(sys.argv[2]))


def test_a_cluster_plan_of_a_run_gets_its_state_format(monkeypatch):
    """plan_run passes --master and --moments to the cluster planner too (0.9.0 dropped them there,
    and planned float32 state): in the run's spec, the planner's one currency since 0.12."""
    import leanstep.planning.cluster
    from leanstep.training import RunConfig
    from leanstep.training.analysis import plan_run

    seen: dict = {}
    monkeypatch.setattr(leanstep.planning.cluster, "plan_cluster", lambda *args, **kwargs: seen.update(spec=args[4]))
    config = RunConfig(size="tiny", batch_size=4, seq_len=8, master="bfloat16-sr", moments="int8")
    plan_run(config, "1GiB", num_devices=1)
    assert seen["spec"].master == "bfloat16-sr" and seen["spec"].moments == "int8"


def test_a_large_moment_is_made_a_slice_of_rows_at_a_time_to_the_same_codes(monkeypatch):
    # Past SLICE_ENTRIES a moment is made (init) under lax.map, a slice of rows a step: quantize's codes
    # and scales bit for bit (rows are independent blocks), with temporaries of a slice, not the leaf
    # (a 2.5B model's int8 moments, made whole, did not fit beside its state on a 16 GiB chip).
    x = jax.random.normal(jax.random.key(5), (6, 10, 300)) * jnp.logspace(-6, 2, 300)[None, None, :]
    x = x.at[2, 3].set(0.0)  # a row of zeros: scale 0
    whole = quantize(x, signed=True, block_size=64)
    made = lambda: jax.jit(lambda v: moments_module.quantize_in_slices(v, signed=True, block_size=64))
    whole_jaxpr = str(jax.make_jaxpr(made())(x))
    whole_temp = made().lower(x).compile().memory_analysis().temp_size_in_bytes
    monkeypatch.setattr(moments_module, "SLICE_ENTRIES", 2 * 10 * 300)
    moments_module.quantize_in_slices.clear_cache()
    sliced, sliced_jaxpr = made()(x), str(jax.make_jaxpr(made())(x))
    sliced_temp = made().lower(x).compile().memory_analysis().temp_size_in_bytes
    moments_module.quantize_in_slices.clear_cache()
    assert "length=3" not in whole_jaxpr and "length=3" in sliced_jaxpr  # lax.map: 3 slices of 2 x 10 rows
    assert sliced.codes.shape == x.shape and sliced.scales.shape == (6, 10, 5)
    np.testing.assert_array_equal(np.asarray(sliced.codes), np.asarray(whole.codes))
    np.testing.assert_array_equal(np.asarray(sliced.scales).view(np.uint32), np.asarray(whole.scales).view(np.uint32))
    assert sliced_temp < whole_temp / 2, (sliced_temp, whole_temp)
    state = leanstep.blocks.compress_moments(optax.adam(1e-3), "int8", block_size=64).init({"w": x})
    np.testing.assert_array_equal(
        np.asarray(state[0].mu["w"].codes), np.asarray(quantize(0 * x, signed=True, block_size=64).codes)
    )
