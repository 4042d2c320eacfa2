"""``TrainState.create_from``: the step-0 state made in one program (``leanstep.step.state_init``, issue 59).

The promise is twofold: the state is ``TrainState.create(init(), ...)``'s bit for bit, and the
one program needs less memory than the eager path holds (the float32 parameters in the caller's
variable beside the state). The first is checked leaf by leaf over the state's formats, a real
model and a plain dict; the second from ``memory_analysis()`` of the compiled program, against
leaf bytes (compile only: no timing, no device).
"""

from __future__ import annotations

import functools
import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from leanstep import TrainState
from leanstep.models.transformer import TransformerConfig, init_transformer
from leanstep.sharding.distributed import run_on_simulated_cpus
from leanstep.step import state_init
from leanstep.step.state_sharding import state_shardings

TINY = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, seq_len=16)


def _dict_init(key: jax.Array, width: int = 8) -> dict:
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (width, 2 * width)) * 0.1, "w2": jax.random.normal(k2, (2 * width,)) * 0.1}


def _bits(leaf) -> np.ndarray:
    """The leaf's bytes (equal NaNs compare equal, and -0.0 differs from 0.0)."""
    return np.asarray(leaf).reshape(-1).view(np.uint8)


def assert_same_state(made, reference):
    assert jax.tree.structure(made) == jax.tree.structure(reference)
    for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(reference), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(_bits(a), _bits(b))


FORMATS = {
    "float32": {},
    "bf16-sr masters, dynamic scale": {"master": "bfloat16-sr", "loss_scale": "dynamic"},
    "bf16-sr-kahan, int8 moments": {"master": "bfloat16-sr-kahan", "moments": "int8"},
    "bfloat16 moments": {"moments": "bfloat16", "loss_scale": "dynamic"},
    "spike guard": {"spike_guard": leanstep.SpikeGuard(window=4, warmup=2), "master": "bfloat16-sr", "moments": "int8"},
}


@pytest.mark.parametrize("form", FORMATS)
def test_the_state_is_creates_of_the_built_in_transformer_bit_for_bit(form):
    init = functools.partial(init_transformer, jax.random.key(3), TINY)
    optimizer = optax.adamw(1e-3)  # one instance: it is the state's static metadata
    made = TrainState.create_from(init, optimizer, seed=7, **FORMATS[form])
    assert_same_state(made, TrainState.create(init(), optimizer, seed=7, **FORMATS[form]))


@pytest.mark.parametrize("form", FORMATS)
def test_the_state_of_a_plain_dict_model_is_creates_of_the_compiled_init_bit_for_bit(form):
    init = functools.partial(_dict_init, jax.random.key(3))
    optimizer = optax.adamw(1e-3)
    made = TrainState.create_from(init, optimizer, seed=7, **FORMATS[form])
    assert_same_state(made, TrainState.create(jax.jit(init)(), optimizer, seed=7, **FORMATS[form]))
    # Op by op, ``normal * 0.1`` rounds apart: XLA folds 0.1 into normal's own constant factor.
    eager = TrainState.create(init(), optimizer, seed=7, **FORMATS[form])
    for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(eager), strict=True):
        np.testing.assert_array_max_ulp(np.asarray(a, np.float32), np.asarray(b, np.float32), maxulp=1 << 16)


def test_a_spec_and_model_state_are_taken_as_create_takes_them():
    spec = leanstep.StepSpec(master="bfloat16-sr", moments="int8", loss_scale="dynamic")
    model_state = {"mean": np.arange(4, dtype=np.float32), "count": jnp.int32(5)}
    init, optimizer = functools.partial(init_transformer, jax.random.key(0), TINY), optax.adam(1e-2)
    made = TrainState.create_from(init, optimizer, spec, model_state=model_state)
    assert_same_state(made, TrainState.create(init(), optimizer, spec, model_state=model_state))
    assert made.model_state["count"].dtype == jnp.int32


def test_the_state_is_made_in_the_shardings_given():
    device = jax.devices()[0]
    init, optimizer = functools.partial(init_transformer, jax.random.key(0), TINY), optax.adam(1e-2)
    one = jax.sharding.SingleDeviceSharding(device)
    made = TrainState.create_from(init, optimizer, shardings=one, moments="int8")
    assert all(leaf.sharding == one for leaf in jax.tree.leaves(made))
    mesh = leanstep.sharding.data_mesh([device])
    # The shardings of the abstract state, made with the same optimizer (the state's static metadata).
    abstract = jax.eval_shape(lambda: TrainState.create_from(init, optimizer, moments="int8"))
    shardings = state_shardings(abstract, mesh, fsdp=True)
    made = TrainState.create_from(init, optimizer, shardings=shardings, moments="int8")
    assert [leaf.sharding for leaf in jax.tree.leaves(made)] == jax.tree.leaves(shardings)
    assert_same_state(made, TrainState.create(init(), optimizer, moments="int8"))


_SHARDED = textwrap.dedent(
    """
    from leanstep.sharding.distributed import configure_devices
    configure_devices(2)
    import json, jax, numpy as np, optax, leanstep
    from leanstep.step.state_sharding import state_shardings
    init = lambda: {"w": jax.random.normal(jax.random.key(0), (8, 6)), "b": jax.random.normal(jax.random.key(1), (6,))}
    # (plain normals: compiled and op by op they agree to the bit)
    optimizer = optax.adamw(1e-3)
    mesh = leanstep.sharding.data_mesh(jax.devices())
    abstract = jax.eval_shape(lambda: leanstep.TrainState.create_from(init, optimizer, master="bfloat16-sr"))
    shardings = state_shardings(abstract, mesh, fsdp=True)
    made = leanstep.TrainState.create_from(init, optimizer, shardings=shardings, master="bfloat16-sr")
    eager = leanstep.TrainState.create(init(), optimizer, master="bfloat16-sr")
    print(json.dumps({
        "placed": [a.sharding == s for a, s in zip(jax.tree.leaves(made), jax.tree.leaves(shardings))],
        "same": [bool(np.array_equal(np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8)))
                 for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(eager))],
        "w_shard": [list(s.data.shape) for s in made.params["w"].addressable_shards],
    }))
    """
)


def test_a_sharded_state_is_made_in_its_shards_on_two_simulated_devices():
    # A child process: simulated devices are set before JAX starts.
    child = run_on_simulated_cpus(_SHARDED)
    assert child.returncode == 0, child.stderr[-2000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert all(report["placed"]) and all(report["same"]), report
    assert report["w_shard"] == [[4, 6], [4, 6]]  # split over the two devices, not replicated


_RUN_SHARDED = textwrap.dedent(
    """
    from leanstep.sharding.distributed import configure_devices
    configure_devices(2)
    import json, jax, numpy as np, leanstep
    from leanstep.training import RunConfig
    from leanstep.training.build import build_run
    from leanstep.step.state_sharding import shard_train_state
    run = build_run(RunConfig(model="transformer", size="tiny", devices=2, fsdp=True, master="bfloat16-sr", moments="int8"))
    mesh = leanstep.sharding.data_mesh(jax.devices())
    calls, create_from = [], leanstep.TrainState.create_from  # which shardings the run's state is made with
    leanstep.TrainState.create_from = classmethod(lambda cls, *a, **k: calls.append(k.get("shardings")) or create_from(*a, **k))
    made = run.initial_state(mesh)  # the config's --fsdp
    leanstep.TrainState.create_from = create_from
    placed = shard_train_state(run.init_state(), mesh, fsdp=True, rules=run.model.rules)
    print(json.dumps({
        "shardings": [a.sharding == b.sharding for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(placed))],
        "same": [bool(np.array_equal(np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8)))
                 for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(placed))],
        "split": sum(not a.sharding.is_fully_replicated for a in jax.tree.leaves(made.params)),
        "made_in_shards": calls[0] is not None and [a.sharding == s for a, s in zip(jax.tree.leaves(made), jax.tree.leaves(calls[0]))],
    }))
    """
)


def test_a_runs_state_on_a_mesh_is_made_in_its_shards_as_the_placed_whole_state_was():
    """leanstep.training.trainer's mesh path makes the state with create_from(shardings=) (made in its
    shards: the test above), with the same shardings and the same bits as the whole state made on one
    device and placed, as 0.12 made it."""
    child = run_on_simulated_cpus(_RUN_SHARDED)
    assert child.returncode == 0, child.stderr[-2000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert all(report["shardings"]) and all(report["same"]), report
    assert report["split"] > 0
    assert report["made_in_shards"] and all(report["made_in_shards"])  # (made whole and placed: False)


def _abstract_bytes(tree) -> int:
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def _peak(compiled) -> int:
    """arguments + outputs - aliased + temporaries, as the planner and benchmarks/tpu_fit.py count it."""
    memory = compiled.memory_analysis()
    return int(
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )


def _four_matrices():
    keys = jax.random.split(jax.random.key(0), 4)
    return {f"w{i}": jax.random.normal(k, (512, 512)) * 0.02 for i, k in enumerate(keys)}


def _four_layers(params, batch):
    x = batch["x"]
    for i in range(4):
        x = jnp.tanh(x @ params[f"w{i}"])
    return jnp.mean(x**2)


def test_the_one_program_state_leaves_the_first_step_the_memory_of_the_float32_params():
    # Four 512x512 float32 leaves (4 MiB), AdamW, bfloat16-sr masters and int8 moments (~4 bytes a
    # parameter). Eagerly the caller's float32 params stay live through the first step: the run's
    # peak is params + the step's. From one program the state alone is live, and the program's own
    # peak (XLA:CPU: 14.7 MB, the RNG bits and float32 zero moments before they are quantized are
    # temporaries) is below the step's (57.8 MB), so the run's peak is the step's.
    keywords = {"master": "bfloat16-sr", "moments": "int8", "loss_scale": "dynamic"}
    optimizer = optax.adamw(1e-3)
    program = jax.jit(lambda: TrainState.create_from(_four_matrices, optimizer, **keywords)).lower().compile()
    state = jax.eval_shape(lambda: TrainState.create_from(_four_matrices, optimizer, **keywords))
    state_bytes, params_bytes = _abstract_bytes(state), _abstract_bytes(jax.eval_shape(_four_matrices))
    assert params_bytes == 4 * 512 * 512 * 4 and state_bytes < 1.02 * params_bytes  # ~4 bytes a parameter
    memory = program.memory_analysis()
    assert memory.argument_size_in_bytes == 0
    assert 0 <= memory.output_size_in_bytes - state_bytes < 1024  # the state alone (small leaves padded)
    step = leanstep.make_train_step(_four_layers, precision="compute=bfloat16", max_grad_norm=1.0)
    step_peak = _peak(step.lower(state, {"x": jax.ShapeDtypeStruct((8, 512), jnp.float32)}).compile())
    assert _peak(program) < step_peak, (_peak(program), step_peak)  # never the run's high point


def _takes_a_key(key):
    return {"w": jnp.ones(2)}


@pytest.mark.parametrize(
    ("init", "kind", "words"),
    [
        (3, TypeError, "init must be a zero-argument callable, e.g. functools.partial(init_fn, key), got int 3"),
        (_takes_a_key, TypeError, "init must be a zero-argument callable, e.g. functools.partial(init_fn, key); it takes"),
        (lambda: {"w": jnp.arange(3)}, TypeError, "floating arrays: params['w'] has dtype int32"),
        (lambda: {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}, TypeError,
         "init returned a jax.ShapeDtypeStruct at params['w']"),
        (dict, ValueError, "init must return the parameters, a pytree of floating arrays: params must have"),
        (lambda: ["a"], TypeError, "params[0] is a str"),
    ],
)  # fmt: skip
def test_a_bad_init_is_one_line_naming_init(init, kind, words):
    with pytest.raises(kind) as info:
        TrainState.create_from(init, optax.sgd(0.1))
    text = str(info.value)
    assert words in text and "\n" not in text, text


def test_create_s_checks_run_before_anything_is_traced():
    calls = []
    init = lambda: calls.append(1) or {"w": jnp.ones(2)}

    class Unhashable(optax.GradientTransformation):
        __hash__ = None  # type: ignore[assignment]

    unhashable = Unhashable(optax.sgd(0.1).init, optax.sgd(0.1).update)
    refused = [
        ({"optimizer": "sgd"}, TypeError, "optimizer must be an optax.GradientTransformation"),
        ({"optimizer": unhashable}, TypeError, "optimizer must be hashable"),
        ({"seed": -1}, ValueError, "seed must be an int in"),
        ({"moments": "int4"}, ValueError, "moments"),
        ({"model_state": {"m": jax.ShapeDtypeStruct((2,), jnp.float32)}}, TypeError, "model_state['m'] is a jax."),
        ({"shardings": {"w": 1}}, TypeError, "shardings['w'] is a int; shardings must be a pytree of jax.sharding"),
    ]
    for changes, kind, words in refused:
        arguments = {"optimizer": optax.sgd(0.1), **changes}
        with pytest.raises(kind) as info:
            TrainState.create_from(init, **arguments)
        assert words in str(info.value), (changes, str(info.value))
    assert calls == []  # refused before init ran


def test_a_plan_that_fits_only_without_the_eager_params_says_to_make_the_state_in_one_program():
    from leanstep.planning import plan

    params, batch = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)}, {"x": jnp.ones((4, 256))}
    make_loss_fn = lambda policy: lambda p, b: jnp.mean(jnp.tanh(b["x"] @ p["w"]) ** 2)
    one = [(1, "none", "float32")]
    peak = plan(make_loss_fn, params, batch, optax.adamw(1e-3), budget_bytes="1GiB", candidates=one).chosen.peak_bytes
    held = 256 * 256 * 4
    tight = plan(make_loss_fn, params, batch, optax.adamw(1e-3), budget_bytes=peak + held // 2, candidates=one)
    assert tight.chosen.peak_bytes == peak  # it fits ...
    [note] = [n for n in tight.notes if "made eagerly" in n]  # ... but not beside the eager params
    assert note.startswith("the step fits with the state made in one program (TrainState.create_from(init, ...)")
    assert "256.0 KiB of parameters held beside the state" in note
    roomy = plan(make_loss_fn, params, batch, optax.adamw(1e-3), budget_bytes=peak + held, candidates=one)
    assert not any("made eagerly" in n for n in roomy.notes)


@pytest.mark.parametrize("form", FORMATS)
def test_a_state_whose_one_program_does_not_fit_is_made_a_group_of_leaves_a_program_bit_for_bit(form, monkeypatch):
    # At 2.5B parameters one program held the float32 parameters at once (18.84 GB of temporaries on
    # a 16 GiB TPU v5e, refused as it compiled); then each program keeps a group of the state's leaves.
    init = functools.partial(init_transformer, jax.random.key(3), TINY)
    optimizer = optax.adamw(1e-3)
    whole = TrainState.create_from(init, optimizer, seed=7, **FORMATS[form])
    monkeypatch.setattr(state_init, "fits_on_device", lambda compiled: False)
    monkeypatch.setattr(state_init, "STREAM_BYTES", 4 * 64 * 32)  # a d_ff x d_model leaf a program
    sizes = [leaf.size for leaf in jax.tree.leaves(whole)]
    assert len(state_init.leaf_groups(sizes, state_init.STREAM_BYTES)) > len(sizes) // 3
    programs, jit = [], jax.jit
    monkeypatch.setattr(state_init.jax, "jit", lambda f, **k: programs.append(k) or jit(f, **k))
    assert_same_state(TrainState.create_from(init, optimizer, seed=7, **FORMATS[form]), whole)
    assert len(programs) == 1 + len(state_init.leaf_groups(sizes, state_init.STREAM_BYTES))  # the one, then groups
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    made = TrainState.create_from(init, optimizer, seed=7, shardings=one, **FORMATS[form])
    assert all(leaf.sharding == one for leaf in jax.tree.leaves(made))
    assert_same_state(made, whole)
    mesh = leanstep.sharding.data_mesh(jax.devices()[:1])
    shardings = state_shardings(jax.eval_shape(lambda: whole), mesh, fsdp=True)
    made = TrainState.create_from(init, optimizer, seed=7, shardings=shardings, **FORMATS[form])
    assert [leaf.sharding for leaf in jax.tree.leaves(made)] == jax.tree.leaves(shardings)
    assert_same_state(made, whole)


def test_a_one_program_refused_as_it_compiles_is_made_in_groups(monkeypatch):
    init = functools.partial(init_transformer, jax.random.key(3), TINY)
    optimizer = optax.adamw(1e-3)
    whole = TrainState.create_from(init, optimizer, moments="int8")
    jit, calls = jax.jit, []

    class Refused:  # XLA:TPU's refusal of a program past the chip's memory, at compile time
        def lower(self, *args):
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required ...")

    monkeypatch.setattr(
        state_init.jax, "jit", lambda f, **k: Refused() if not calls.append(f) and len(calls) == 1 else jit(f, **k)
    )
    assert_same_state(TrainState.create_from(init, optimizer, moments="int8"), whole)
    assert len(calls) > 1


def test_fits_on_device_reads_the_devices_free_memory(monkeypatch):
    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    class Compiled:
        def memory_analysis(self):
            return type("Memory", (), {"output_size_in_bytes": 40, "temp_size_in_bytes": 20})()

    for stats, fits in [
        (None, True),
        ({"bytes_limit": 100, "bytes_in_use": 40}, True),
        ({"bytes_limit": 100, "bytes_in_use": 41}, False),
    ]:
        monkeypatch.setattr(state_init.jax, "local_devices", lambda stats=stats: [Device(stats)])
        assert state_init.fits_on_device(Compiled()) is fits


def test_past_one_draw_the_built_in_models_arrays_are_drawn_apart_so_a_group_computes_its_own(monkeypatch):
    # normal_arrays draws every array from one normal draw (one sampler to compile) up to 2**28 values;
    # past it each array alone, so a program of a state made in groups draws only its arrays.
    from leanstep.models import layers

    specs = {"a": ((64, 64), 1.0), "b": ((128, 96), 1.0)}
    compiled = lambda: jax.jit(lambda key: layers.normal_arrays(key, specs)["a"]).lower(jax.random.key(0)).compile()
    one_draw = compiled().as_text()
    monkeypatch.setattr(layers, "_MAX_DRAW", 64 * 64)
    apart = compiled().as_text()
    assert "f32[16384]" in one_draw  # the whole draw: 4096 + 12288 values
    assert "16384]" not in apart and "12288]" not in apart and "128,96]" not in apart and "f32[64,64]" in apart
