"""Lean optimizer state, issue 41 items 7 and 8: only moments are compressed, and 8-bit moments
run on every FSDP layout of the built-in models.

Item 7: ``compress_moments`` compressed every float subtree shaped like the parameters, so
schedule-free's ``z`` (a copy of the weights) and Prodigy's ``params0`` went into 8 bits, and
SM3's momentum and Adan's gradient-difference average (both signed) into the unsigned map. The
reference here is each optimizer in float32 whose real moments, and nothing else, are taken
through 8 bits after every update (by :func:`quantize`/:func:`dequantize`, checked against
float64 NumPy in ``test_lean_state.py``): the wrapper must equal it bit for bit. Which moments
are signed is checked against the optimizers' own float32 runs (an unsigned one never goes
negative, a signed one does).

Item 8: a parameter split along its last axis whose per-device part is not whole blocks had its
block scales split the same way, which JAX refuses (``(2, 1)`` scales over 2 devices). The scales'
layout is checked against a brute-force statement of what it must be; the step with 8-bit moments
on ``fsdp=2``, ``--devices 2 --fsdp`` and ``fsdp=2,tensor=2`` (simulated devices, a child process)
against the one-device step, on a problem whose gradients are exact in float32: codes and scales
bit-identical, parameters within the rounding of a decoded moment, the loss within its float32
summation bound of the float64 value; ``--mesh auto``'s planner on an FSDP mesh; the CLI on each
layout.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

import leanstep
from helpers.workers import child_env, run_worker
from leanstep.blocks.moments import MOMENT_FIELDS, QuantizedArray, dequantize, quantize
from leanstep.step.state_sharding import scales_sharding

# --- item 7: only moments are compressed ----------------------------------------------------------

#: name -> (optimizer, {(state type, field): signed}: the moments it has, by reading optax's update).
OPTIMIZERS = {
    "schedule_free_adamw": (
        optax.contrib.schedule_free_adamw(1e-2, warmup_steps=3),
        {("ScaleByRmsWithCountState", "nu"): False},  # z is a copy of the weights
    ),
    "adamw": (optax.adamw(1e-2), {("ScaleByAdamState", "mu"): True, ("ScaleByAdamState", "nu"): False}),
    "lion": (optax.lion(1e-3), {("ScaleByLionState", "mu"): True}),
    "sgd_momentum": (optax.sgd(1e-2, momentum=0.9), {("TraceState", "trace"): True}),
    "sm3": (optax.sm3(1e-2), {("ScaleBySM3State", "nu"): True}),  # its nu is the momentum; mu per dimension
    "adan": (
        optax.adan(1e-2),  # m: of g; v: of g - g_prev (signed); n: of a square; g: the last gradient
        {("ScaleByAdanState", "m"): True, ("ScaleByAdanState", "v"): True, ("ScaleByAdanState", "n"): False},
    ),
    "prodigy": (
        optax.contrib.prodigy(1.0),  # params0: the initial weights; grad_sum: a weighted sum
        {("ProdigyState", "exp_avg"): True, ("ProdigyState", "exp_avg_sq"): False},
    ),
    "rmsprop_centered": (
        optax.rmsprop(1e-2, centered=True),
        {("ScaleByRStdDevState", "mu"): True, ("ScaleByRStdDevState", "nu"): False},
    ),
    "adagrad": (optax.adagrad(1e-2), {("ScaleByRssState", "sum_of_squares"): False}),
    "amsgrad": (
        optax.amsgrad(1e-2),
        {("ScaleByAmsgradState", f): f == "mu" for f in ("mu", "nu", "nu_max")},
    ),
    "adabelief": (optax.adabelief(1e-2), {("ScaleByBeliefState", "mu"): True, ("ScaleByBeliefState", "nu"): False}),
}


def _params(name: str = "", seed: int = 0) -> dict:
    """Weights (a tail block of 44), a bias, and a scalar (but for SM3, which optax's sm3 cannot take)."""
    rng = np.random.default_rng(seed)
    params = {
        "w": jnp.asarray(rng.normal(size=(8, 300)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(300,)), jnp.float32),
        "s": jnp.asarray(rng.normal(), jnp.float32),
    }
    return {k: v for k, v in params.items() if not (name == "sm3" and k == "s")}


def _gradients(params: dict, steps: int, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        jax.tree.map(lambda p: jnp.asarray(rng.normal(size=np.shape(p)), jnp.float32), params) for _ in range(steps)
    ]


def _map_fields(state, fn):
    """``fn(type name, field, value)`` on every field of every NamedTuple in an optax state."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(fn(type(state).__name__, f, _map_fields(v, fn)) for f, v in zip(state._fields, state)))
    if isinstance(state, (tuple, list)):
        return type(state)(_map_fields(x, fn) for x in state)
    if isinstance(state, dict):
        return {k: _map_fields(v, fn) for k, v in state.items()}
    return state


def _through_8_bits(moments: dict):
    """The reference's state map: each listed moment (dict of leaves) quantized and decoded, the rest as is."""

    def fn(kind, field, value):
        if (kind, field) not in moments:
            return value
        signed = moments[kind, field]
        return jax.tree.map(lambda x: dequantize(quantize(x, signed=signed, block_size=256)), value)

    return lambda state: _map_fields(state, fn)


def _run(tx, params, gradients, after=lambda state: state):
    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), after(state)

    state = after(tx.init(params))
    for grads in gradients:
        params, state = step(params, state, grads)
    return params, state


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_8_bit_moments_equal_float32_with_only_its_moments_through_8_bits(name):
    tx, moments = OPTIMIZERS[name]
    params = _params(name)
    gradients = _gradients(params, 12)
    reference, reference_state = _run(tx, params, gradients, _through_8_bits(moments))
    lean, lean_state = _run(leanstep.blocks.compress_moments(tx, "int8"), params, gradients)
    for key in params:
        assert np.asarray(lean[key]).tobytes() == np.asarray(reference[key]).tobytes(), (name, key)
    widened = jax.tree.map(
        lambda x: dequantize(x) if isinstance(x, QuantizedArray) else x,
        lean_state,
        is_leaf=lambda x: isinstance(x, QuantizedArray),
    )
    for a, b in zip(jax.tree.leaves(widened), jax.tree.leaves(reference_state), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), name
    quantized = [x for x in jax.tree.leaves(lean_state, is_leaf=lambda x: isinstance(x, QuantizedArray))]
    assert sum(isinstance(x, QuantizedArray) for x in quantized) == len(moments) * len(params)


def test_schedule_free_adamw_keeps_z_in_float32_and_its_second_moment_in_8_bits():
    params = _params()
    state = leanstep.TrainState.create(params, optax.contrib.schedule_free_adamw(1e-2), moments="int8").opt_state
    assert all(x.dtype == jnp.float32 and not isinstance(x, QuantizedArray) for x in jax.tree.leaves(state.z))
    assert all(isinstance(x, QuantizedArray) and not x.signed for x in state.base_optimizer_state[0].nu.values())


@pytest.mark.parametrize("name", ["adamw", "sm3", "adan", "amsgrad", "adabelief", "prodigy"])
def test_unsigned_moments_never_go_negative_and_signed_ones_do(name):
    """MOMENT_FIELDS' signs against the optimizers' own float32 runs."""
    tx, moments = OPTIMIZERS[name]
    assert all(MOMENT_FIELDS[kind][field] == signed for (kind, field), signed in moments.items())
    params = _params(name)
    state, seen = tx.init(params), {key: 0.0 for key in moments}

    def record(kind, field, value):
        if (kind, field) in moments:
            seen[kind, field] = min(seen[kind, field], min(float(jnp.min(x)) for x in jax.tree.leaves(value)))
        return value

    for grads in _gradients(params, 12):
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        _map_fields(state, record)
    for key, signed in moments.items():
        assert (seen[key] < 0) == signed, (key, seen[key])


@pytest.mark.parametrize("build", ["compress_moments", "TrainState.create"])
def test_an_optimizer_whose_only_params_shaped_state_is_weights_is_refused_naming_it(build):
    tx, params = optax.contrib.schedule_free_sgd(1e-2), _params()
    with pytest.raises(ValueError, match=r"^moments 'int8': .*ScheduleFreeState\.z.*no moment.*moments='float32'$"):
        if build == "compress_moments":
            leanstep.blocks.compress_moments(tx, "int8").init(params)
        else:
            leanstep.TrainState.create(params, tx, moments="int8")


SHAPES = {"w": (1024, 1024), "b": (1024,), "v": (512, 300)}


@pytest.mark.parametrize(
    ("name", "moments"),
    [("adamw", {"mu": True, "nu": False}), ("lion", {"mu": True}), ("sgd_momentum", {"trace": True})],
)
def test_adamw_lion_and_sgd_momentum_still_compress_every_moment_to_its_bytes(name, moments):
    """Bytes of the state from XLA, against 1 byte an element and 4 a block of 256 along the last axis."""
    tx = {"adamw": optax.adamw(1e-3), "lion": optax.lion(1e-4), "sgd_momentum": optax.sgd(1e-2, momentum=0.9)}[name]
    params = {k: jnp.zeros(shape) for k, shape in SHAPES.items()}
    size = lambda tree: jax.jit(lambda t: t).lower(tree).compile().memory_analysis().argument_size_in_bytes
    full = size(leanstep.TrainState.create(params, tx).opt_state)
    lean = size(leanstep.TrainState.create(params, tx, moments="int8").opt_state)
    elements = sum(math.prod(s) for s in SHAPES.values())
    blocks = sum(math.prod(s[:-1]) * -(-s[-1] // 256) for s in SHAPES.values())
    assert full - lean == len(moments) * (4 * elements - (elements + 4 * blocks))


def test_a_zero_size_leaf_trains_with_8_bit_moments_and_leaves_the_others_as_without_it():
    def loss(params, batch):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2) + jnp.sum(params["empty"])

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(16, 300)), jnp.float32), "empty": jnp.zeros((0, 4))}
    batch = {"x": rng.normal(size=(8, 16)).astype(np.float32), "y": rng.normal(size=(8, 300)).astype(np.float32)}
    step = leanstep.make_train_step(loss, precision="float32")
    with_it = leanstep.TrainState.create(params, optax.adamw(1e-2), moments="int8")
    without = leanstep.TrainState.create({"w": params["w"]}, optax.adamw(1e-2), moments="int8")
    plain = leanstep.make_train_step(lambda p, b: loss(dict(p, empty=jnp.zeros((0, 4))), b), precision="float32")
    for _ in range(3):
        with_it, metrics = step(with_it, batch)
        without, _ = plain(without, batch)
    assert not bool(metrics.skipped) and with_it.opt_state[0].mu["empty"].codes.shape == (0, 4)
    assert np.asarray(with_it.params["w"]).tobytes() == np.asarray(without.params["w"]).tobytes()


# --- item 8: the block scales' layout ---------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 6),
    width=st.integers(1, 2100),
    fsdp=st.sampled_from([1, 2, 4, 8]),
    tensor=st.sampled_from([1, 2]),
    block=st.sampled_from([16, 64, 256]),
    split=st.sampled_from(["fsdp", "tensor", ("tensor", "fsdp"), None]),
)
def test_scales_fit_their_shape_and_a_split_one_holds_only_its_devices_blocks(rows, width, fsdp, tensor, block, split):
    """Brute force: each device's columns and the blocks of each device's scales, by index."""
    mesh = AbstractMesh((fsdp, tensor), ("fsdp", "tensor"))
    names = () if split is None else (split if isinstance(split, tuple) else (split,))
    devices = math.prod(dict(fsdp=fsdp, tensor=tensor)[n] for n in names)
    if width % devices:
        return  # the parameter's own layout would not fit (param_specs never chooses it)
    spec = PartitionSpec(None, split)
    scales = scales_sharding(NamedSharding(mesh, spec), (rows, width), block).spec
    blocks = -(-width // block)
    entries = tuple(scales) + (None,) * (2 - len(scales))
    assert entries[0] is None and entries[1] in (None, split)
    if entries[1] is None:
        return
    assert blocks % devices == 0  # JAX's condition: the scales' last axis divides over its devices
    columns, owned = width // devices, blocks // devices
    for device in range(devices):
        own_columns = set(range(device * columns, (device + 1) * columns))
        for k in range(device * owned, (device + 1) * owned):  # the scales this device holds
            assert set(range(k * block, min((k + 1) * block, width))) <= own_columns
    assert (width // devices) % block == 0 or devices == 1


# --- item 8: the step and the CLI on FSDP layouts (simulated devices) ------------------------------

#: name -> (mesh shape, ShardingLayer options): the FSDP layouts of the CLI.
LAYOUTS = {
    "--mesh fsdp=2": ({"fsdp": 2}, {}),
    "--devices 2 --fsdp": ({"data": 2}, {"fsdp": True}),
    "--mesh fsdp=2,tensor=2": ({"fsdp": 2, "tensor": 2}, {}),
}
ROWS, STEPS = 8, 4
#: AdamW whose products by its constants are exact (b1 = b2 = 1/2, powers of two for the rest), so
#: that XLA's freedom to fuse a product into a sum changes no bit except where a decoded moment
#: meets it: with float32 moments the layouts then agree bit for bit; with optax's defaults they
#: are 1 ulp apart even so (measured: 0.11, 4 steps), whatever the moments' format.
OPTIMIZER = optax.adamw(2.0**-7, b1=0.5, b2=0.5, weight_decay=2.0**-4)


def _problem():
    """The tiny transformer's parameters, two wider leaves (whole blocks per device, and not), and
    a loss linear in them with small-integer coefficients: its gradient, a mean of small integers
    over 8 rows, is exact in float32 in any order of summation, so any layout gets the same bits."""
    from leanstep.models import build_model

    model = build_model("transformer", "tiny")
    params = dict(model.init(jax.random.key(0)), wide_whole=jnp.ones((4, 1024)), wide_split=jnp.ones((4, 768)))
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(-3, 4, size=(ROWS, *np.shape(v))).astype(np.float32) for k, v in _flat(params).items()}
    return model, params, batch


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def _linear_loss(params, batch):
    flat = _flat(params)
    return sum(jnp.mean(jnp.sum((batch[k] * flat[k][None]).reshape(ROWS, -1), axis=1)) for k in flat)


def worker(out: Path) -> None:
    jax.config.update("jax_num_cpu_devices", 8)
    from leanstep.sharding.distributed import device_mesh

    model, params, batch = _problem()
    runs = {}
    for name, (shape, options) in {"one device": (None, {}), **LAYOUTS}.items():
        layer = (
            None
            if shape is None
            else leanstep.step.ShardingLayer(
                device_mesh(math.prod(shape.values()), shape=shape), rules=model.rules, **options
            )
        )
        step = leanstep.make_train_step(_linear_loss, precision="float32", max_grad_norm=1e3, mesh=layer)
        state = leanstep.TrainState.create(params, OPTIMIZER, loss_scale="dynamic", moments="int8")
        feed = batch
        if layer is not None:
            state = leanstep.step.shard_train_state(state, layer.mesh, fsdp=layer.fsdp, rules=model.rules)
            feed = leanstep.sharding.shard_batch(batch, layer.mesh)
        run = {"losses": [], "norms": [], "params": []}
        for _ in range(STEPS):
            run["params"].append({k: np.asarray(v).tolist() for k, v in _flat(state.params).items()})
            state, metrics = step(state, feed)
            run["losses"].append(float(metrics.loss))
            run["norms"].append(float(metrics.grad_norm))
        run["params"].append({k: np.asarray(v).tolist() for k, v in _flat(state.params).items()})
        mu = state.opt_state[0].mu
        run["moments"] = {k: np.asarray(v).tobytes().hex() for k, v in _flat(jax.device_get(state.opt_state)).items()}
        run["split"] = {
            k: [not mu[k].codes.sharding.is_fully_replicated, not mu[k].scales.sharding.is_fully_replicated]
            for k in ("wide_whole", "wide_split")
        }
        run["skipped"] = bool(metrics.skipped)
        runs[name] = run
    # --mesh auto: the planner compiles the step on each mesh it tries (here, one: fsdp=2).
    from leanstep.training import RunConfig
    from leanstep.training.analysis import plan_run

    config = RunConfig(size="tiny", batch_size=8, seq_len=16, moments="int8")
    space = dict(meshes=[{"fsdp": 2}], remat_policies=["none"], microbatches=[1], reductions=["auto"])
    runs["plan"] = plan_run(config, "1GiB", num_devices=2, **space).chosen.setting.mesh
    (out / "layouts.json").write_text(json.dumps(runs))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return run_worker(__file__, tmp_path_factory.mktemp("lean_layouts"), "layouts.json")


@pytest.mark.slow  # 8 simulated devices in a child process, four layouts compiled
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_8_bit_moments_on_an_fsdp_layout_are_the_one_device_moments_bit_for_bit(layouts, layout):
    one, run = layouts["one device"], layouts[layout]
    assert run["moments"].keys() == one["moments"].keys() and not run["skipped"]
    assert [k for k in one["moments"] if run["moments"][k] != one["moments"][k]] == []
    assert run["norms"] == one["norms"]  # the gradient is exact: the same bits on every layout
    # 1024 columns over 2 FSDP devices are whole blocks each, so their scales are split too;
    # 768 columns (384 a device) are not, and their scales are kept whole.
    assert run["split"] == {"wide_whole": [True, True], "wide_split": [True, False]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_params_on_an_fsdp_layout_are_the_one_device_params_within_the_decoded_moments_rounding(layouts, layout):
    """The same gradients, codes and scales on every layout (above), and OPTIMIZER's products by
    powers of two exact: what is left is whether XLA rounds a decoded moment ``map[c] * scale``
    before the optimizer adds to it or fuses the two (programs of different layouts fuse
    differently). That moves the new moment by at most 1 ulp (2**-23 relative), Adam's direction
    ``m / sqrt(v)`` by at most 2**-22 of itself, and the sum ``w + update`` by one rounding
    (2**-24 of it) in each program. So after step t, per element,
    ``|w' - w| <= sum over steps of (2**-22 |update| + 2**-23 |w|)`` along the one-device run."""
    one, run = layouts["one device"], layouts[layout]
    for key in one["params"][0]:
        path = [np.asarray(p[key], np.float64) for p in one["params"]]
        bound = sum(2.0**-22 * np.abs(b - a) + 2.0**-23 * np.abs(b) for a, b in itertools.pairwise(path))
        difference = np.abs(np.asarray(run["params"][-1][key], np.float64) - path[-1])
        assert np.all(difference <= bound), (key, float(np.max(difference - bound)))


@pytest.mark.slow
def test_mesh_auto_plans_8_bit_moments_on_an_fsdp_mesh(layouts):
    assert layouts["plan"] == "fsdp=2"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one device", *LAYOUTS])
def test_the_loss_on_each_layout_is_the_float64_loss_within_float32_summation_error(layouts, layout):
    """The loss, a sum of N products p * c over 8, summed in any order in float32: within
    ``(N + 1) * 2**-24 * sum |p * c| / 8`` of its float64 value (the bound of recursive
    summation, which pairwise and tree orders meet too, with one rounding of each product)."""
    _, _, batch = _problem()
    for step, params in enumerate(layouts[layout]["params"][:-1]):
        terms = [batch[k].astype(np.float64) * np.asarray(v, np.float64)[None] for k, v in params.items()]
        exact = sum(float(np.sum(t)) for t in terms) / ROWS
        count = sum(t.size for t in terms)
        bound = (count + 1) * 2.0**-24 * sum(float(np.sum(np.abs(t))) for t in terms) / ROWS
        loss = layouts[layout]["losses"][step]
        assert abs(loss - exact) <= bound, (step, loss, exact, bound)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small folder of real text: a few standard-library modules."""
    import sysconfig

    root = tmp_path_factory.mktemp("corpus")
    for name in ("textwrap.py", "shlex.py", "fnmatch.py"):
        (root / name).write_bytes((Path(sysconfig.get_paths()["stdlib"]) / name).read_bytes())
    return root


@pytest.mark.slow  # simulated devices in a child process, about 40 s a layout
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_cli_trains_8_bit_moments_on_each_fsdp_layout(tmp_path, corpus, layout):
    out = tmp_path / "run"
    env = child_env()
    flags = ["--size", "tiny", "--batch-size", "8", "--seq-len", "16", "--microbatches", "2"]
    flags += ["--no-progress", "--no-chart"]
    proc = subprocess.run(
        [sys.executable, "-m", "leanstep.cli.main", "train", *flags, "--moments", "int8", *layout.split()]
        + ["--steps", "3", "--data", str(corpus), "--out", str(out), "--no-compile-cache"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in lines if r["kind"] == "train"]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert json.loads((out / "config.json").read_text())["run"]["moments"] == "int8"


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(Path(sys.argv[2]))
