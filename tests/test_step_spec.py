"""StepSpec: one value for what a step is, built alike from the command line, JSON and keywords,
checked in one place (one line naming the argument), and compiled to the very step the short form
compiles."""

from __future__ import annotations

import inspect
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import leanstep
from leanstep import Accumulation, Fp8Recipe, LossContract, SpikeGuard, StepSpec, TrainState, make_train_step
from leanstep.blocks.masters import MASTERS
from leanstep.blocks.moments import MOMENT_DTYPES
from leanstep.step import REDUCTIONS, LossScaleSpec, MeshLayout, ShardingLayer


def _loss(params, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ params["w"]) - batch["y"]) ** 2)


def _aux_loss(params, batch):
    return _loss(params, batch), {"max": jnp.max(batch["x"] @ params["w"])}


def _params():
    return {"w": jnp.arange(6, dtype=jnp.float32).reshape(3, 2) / 10}


def _batch():
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3)
    return {"x": x, "y": np.cos(x[:, :2] * 3)}


SPECS = {
    "defaults": StepSpec(),
    "bf16_clip_dynamic": StepSpec.from_keywords(
        precision="compute=bfloat16", num_microbatches=4, max_grad_norm=1.0, loss_scale="dynamic"
    ),
    "contract_static": StepSpec.from_keywords(
        has_aux=True, token_weighted=True, split="strided", unroll=True, loss_scale=1024.0, update_chunk=None
    ),
    "lean_state": StepSpec.from_keywords(
        loss_scale=leanstep.DynamicLossScale.create(256.0, growth_interval=10),
        master="bfloat16-sr-kahan",
        moments="int8",
        spike_guard="k=4,window=50,warmup=50,watch=loss+grad_norm",
        fp8="current,margin=1",
        donate=False,
        cast_batch=False,
    ),
    "mesh_axes": StepSpec(sharding=MeshLayout("data=2,fsdp=2", reduce="step"), accumulation=Accumulation(2, "strided")),
    "stateful_layout": StepSpec.from_keywords(
        uses_rng=True,
        has_state=True,
        sharding=MeshLayout(reduce="microbatch", fsdp=True),
        update_chunk=4096,
        fp8=Fp8Recipe("delayed", history=16, amax="most_recent"),
    ),
}


@pytest.mark.parametrize("name", SPECS)
def test_json_gives_the_spec_back_exactly(name):
    spec = SPECS[name]
    text = json.dumps(spec.to_json())
    assert StepSpec.from_json(json.loads(text)) == spec == StepSpec.from_json(text)
    assert hash(StepSpec.from_json(text)) == hash(spec)


@st.composite
def specs(draw):
    has_state = draw(st.booleans())
    reduce = st.sampled_from([r for r in REDUCTIONS if not (has_state and r == "step")])
    layout = st.builds(
        MeshLayout,
        axes=st.sampled_from([None, "data=2", "data=2,fsdp=4,tensor=2", (("x", 3),)]),
        fsdp=st.booleans(),
        reduce=reduce,
    )
    dynamic = st.builds(
        LossScaleSpec,
        st.just("dynamic"),
        st.sampled_from([1.0, 2.0**15, 3.5e4]),
        st.sampled_from([(), (("growth_interval", 7),), (("backoff_factor", 0.25), ("hysteresis", 2))]),
    )
    return StepSpec.from_keywords(
        precision=draw(st.sampled_from(["float32", "compute=bfloat16", "c=f16,o=f32", "c=bf16,strict"])),
        num_microbatches=draw(st.integers(1, 64)),
        max_grad_norm=draw(st.none() | st.floats(1e-3, 1e6)),
        has_aux=draw(st.booleans()),
        token_weighted=draw(st.booleans()),
        uses_rng=draw(st.booleans()),
        has_state=has_state,
        split=draw(st.sampled_from([None, "contiguous", "strided"])),
        unroll=draw(st.integers(1, 4) | st.booleans()),
        loss_scale=draw(st.sampled_from(["none", "dynamic"]) | st.floats(1.0, 2.0**20) | dynamic),
        fp8=draw(st.sampled_from([None, "delayed", "current", "delayed,history=16,amax=most_recent,margin=2"])),
        master=draw(st.sampled_from(MASTERS)),
        moments=draw(st.sampled_from(MOMENT_DTYPES)),
        update_chunk=draw(st.sampled_from(["auto", None]) | st.integers(1, 2**30)),
        spike_guard=draw(
            st.none() | st.builds(SpikeGuard, st.integers(2, 1000), st.floats(0.5, 20.0), st.integers(2, 1000))
        ),
        cast_batch=draw(st.booleans()),
        donate=draw(st.booleans()),
        sharding=draw(st.none() | layout),
    )


@settings(max_examples=60, deadline=None)
@given(specs())
def test_any_spec_survives_json(spec):
    assert StepSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


def test_a_spec_from_the_command_line_from_json_and_from_keywords_is_one_value():
    from leanstep.cli.flags import run_config
    from leanstep.cli.main import build_parser

    argv = ["train", "--steps", "10", "--precision", "compute=bf16", "--microbatches", "4", "--batch-size", "16"]
    argv += ["--max-grad-norm", "0.5", "--loss-scale", "dynamic", "--initial-loss-scale", "1024"]
    argv += ["--fp8", "delayed,history=16", "--moments", "int8", "--master", "bfloat16-sr", "--spike-guard", "on"]
    argv += ["--devices", "2", "--fsdp", "--reduce", "step"]
    from_flags = run_config(build_parser().parse_args(argv)).step
    from_json = StepSpec.from_json(json.loads(json.dumps(from_flags.to_json())))
    from_keywords = StepSpec.from_keywords(
        precision="params=float32,compute=bfloat16",
        num_microbatches=4,
        max_grad_norm=0.5,
        loss_scale=leanstep.DynamicLossScale.create(1024.0),
        fp8=Fp8Recipe("delayed", history=16),
        moments="int8",
        master="bfloat16-sr",
        spike_guard=SpikeGuard(),
        sharding=MeshLayout(fsdp=True, reduce="step"),
    )
    assert from_flags == from_json == from_keywords
    assert from_flags.accumulation.split == "strided"  # laid out over devices: no row moves between them
    changed = run_config(build_parser().parse_args([*argv, "--moments", "bfloat16"])).step
    assert changed != from_flags and changed.replace(moments="int8") == from_flags


def test_precision_auto_is_resolved_before_the_config_has_a_step():
    from leanstep.training import RunConfig, build_run

    with pytest.raises(ValueError, match="--precision auto is chosen for the device by build_run"):
        _ = RunConfig(precision="auto").step
    run = build_run(RunConfig(model="mlp", size="tiny", batch_size=4, seq_len=8, microbatches=2, steps=2))
    assert run.config.step.precision == run.precision and run.config.step.sharding is None


BAD = [
    (dict(precision="params=bfloat16"), ValueError, "precision"),
    (dict(max_grad_norm=-1.0), ValueError, "max_grad_norm must be a positive finite number"),
    (dict(max_grad_norm="1"), TypeError, "max_grad_norm must be a number"),
    (dict(loss_scale="static"), ValueError, "loss_scale='static' needs its scale"),
    (dict(loss_scale="bf16"), ValueError, "unknown loss scale spec 'bf16'"),
    (dict(loss_scale=[1]), TypeError, "loss_scale must be 'none', 'dynamic', a number"),
    (dict(fp8="delayed,history=0"), ValueError, "^fp8: history=0"),
    (dict(fp8=3), TypeError, "fp8 must be a leanstep.Fp8Recipe"),
    (dict(master="bfloat16"), ValueError, "master='bfloat16': bfloat16 masters rounded to nearest"),
    (dict(moments="int4"), ValueError, r"moments must be one of \('float32', 'bfloat16', 'int8'\), got 'int4'"),
    (dict(update_chunk=0), ValueError, "update_chunk must be 'auto', a positive int"),
    (dict(spike_guard="k=-1"), ValueError, "^spike_guard: SpikeGuard.k must be a positive number"),
    (dict(spike_guard=3), TypeError, "spike_guard must be a leanstep.SpikeGuard"),
    (dict(precision=16), TypeError, r"^precision must be a leanstep.Precision or its string form .*, got int 16$"),
    (dict(cast_batch="yes"), TypeError, "cast_batch must be a bool"),
    (dict(donate=1), TypeError, "donate must be a bool"),
    (dict(loss={"has_aux": True}), TypeError, "loss must be a leanstep.LossContract, got dict"),
    (dict(accumulation=2), TypeError, "accumulation must be a leanstep.Accumulation, got int"),
    (dict(accumulation=Accumulation(2, divide=False)), ValueError, r"Accumulation\(divide=False\)"),
    (dict(sharding="data=2"), TypeError, "sharding must be a leanstep.step.MeshLayout or None, got str"),
    (
        dict(sharding=MeshLayout(), accumulation=Accumulation(1, "presplit")),
        ValueError,
        "split='presplit' is not supported with a mesh",
    ),
    (
        dict(sharding=MeshLayout(reduce="step"), loss=LossContract(has_state=True)),
        ValueError,
        "has_state=True with reduce='step'",
    ),
]


@pytest.mark.parametrize(("fields", "error", "pattern"), BAD, ids=lambda v: str(v)[:40])
def test_a_bad_field_is_one_line_naming_it(fields, error, pattern):
    with pytest.raises(error, match=pattern) as raised:
        StepSpec(**fields)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("make", "error", "pattern"),
    [
        (lambda: MeshLayout(reduce="sometimes"), ValueError, "sharding.reduce must be one of"),
        (lambda: MeshLayout("data=2,pipe=2"), ValueError, "--mesh must be name=size pairs"),
        (lambda: MeshLayout((("data", 0),)), ValueError, r"sharding.axes must be \(name, size\) pairs"),
        (lambda: MeshLayout(fsdp="yes"), TypeError, "sharding.fsdp must be a bool"),
        (lambda: LossScaleSpec("dynamic", 0.5), ValueError, "initial_scale"),
        (lambda: LossScaleSpec("none", settings=(("hysteresis", 2),)), ValueError, "apply only to a dynamic"),
        (lambda: StepSpec.from_json({"precision": "float32", "clip": 1.0}), ValueError, r"unknown step spec field"),
        (lambda: StepSpec.from_json({"loss": {"aux": True}}), ValueError, r"^step spec field 'loss': unknown key"),
        (lambda: StepSpec.from_keywords(num_microbatches=2, accumulation=Accumulation(2)), ValueError, "inside"),
        (lambda: StepSpec.from_keywords(has_aux=True, loss=LossContract()), ValueError, "inside loss="),
        (lambda: StepSpec.from_keywords(num_microbatch=2), TypeError, "did you mean num_microbatches=[?]$"),
    ],
)
def test_a_bad_part_is_one_line_naming_it(make, error, pattern):
    with pytest.raises(error, match=pattern) as raised:
        make()
    assert "\n" not in str(raised.value)


_OBJECT = "must be an object of the fields"


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"accumulation": 2}, f"'accumulation' {_OBJECT} num_microbatches, split, unroll .*, got int 2$"),
        ({"loss": None}, f"'loss' {_OBJECT} has_aux, token_weighted, uses_rng, has_state .*, got NoneType None$"),
        ({"sharding": "data=2"}, "'sharding' must be null or an object of the fields axes, .*, got str 'data=2'$"),
        ({"precision": 16}, "'precision' must be a string such as \"compute=bfloat16\" .*, got int 16$"),
        ({"spike_guard": 5}, "'spike_guard' must be null, a string such as \"on\" .*, got int 5$"),
        ({"fp8": ["delayed"]}, "'fp8' must be null or a recipe string .*, got list"),
        ({"loss_scale": True}, '\'loss_scale\' must be "none", "dynamic", a number .*, got bool True$'),
    ],
)
def test_a_json_part_of_another_type_is_one_line_naming_the_field_and_its_forms(fields, pattern):
    with pytest.raises(TypeError, match="^step spec field " + pattern) as raised:
        StepSpec.from_json(fields)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("fields", "short"),
    [
        ({"spike_guard": "on"}, {"spike_guard": "on"}),
        ({"spike_guard": "k=5,window=50"}, {"spike_guard": SpikeGuard(k=5.0, window=50)}),
        ({"spike_guard": "none"}, {"spike_guard": None}),
        ({"loss_scale": 1024}, {"loss_scale": LossScaleSpec("static", 1024.0)}),
        ({"loss_scale": "dynamic"}, {"loss_scale": "dynamic"}),
        ({"fp8": "delayed"}, {"fp8": "delayed"}),
        ({"sharding": {"axes": "data=2"}}, {"sharding": MeshLayout((("data", 2),))}),
    ],
)
def test_json_takes_the_short_forms_the_constructor_takes(fields, short):
    spec = StepSpec.from_json(json.loads(json.dumps(fields)))
    assert spec == StepSpec(**short) and StepSpec.from_json(spec.to_json()) == spec


def test_a_spec_with_no_json_form_says_which_field():
    with pytest.raises(TypeError, match="accumulation.split .* has no JSON form"):
        StepSpec(accumulation=Accumulation(2, split=lambda batch, m: batch)).to_json()


# The spec form against the short form: the same program, the same numbers.
SHORT_AND_SPEC = {
    "plain": (dict(), {}, StepSpec()),
    "bf16_clip_dynamic": (
        dict(precision="compute=bfloat16", num_microbatches=2, max_grad_norm=0.5),
        dict(loss_scale="dynamic"),
        StepSpec(
            leanstep.Precision(jnp.float32, jnp.bfloat16, jnp.bfloat16),
            accumulation=Accumulation(2),
            max_grad_norm=0.5,
            loss_scale=LossScaleSpec("dynamic", 2.0**15),
        ),
    ),
    "aux_spike_lean": (
        dict(has_aux=True, num_microbatches=4, spike_guard=SpikeGuard(window=4, warmup=2), update_chunk=2),
        dict(spike_guard=SpikeGuard(window=4, warmup=2), moments="bfloat16", master="bfloat16-sr"),
        StepSpec(
            loss=LossContract(has_aux=True),
            accumulation=Accumulation(4),
            spike_guard=SpikeGuard(window=4, warmup=2),
            update_chunk=2,
            moments="bfloat16",
            master="bfloat16-sr",
        ),
    ),
    "mesh": (
        dict(num_microbatches=2, max_grad_norm=1.0),
        dict(),
        StepSpec(accumulation=Accumulation(2, "strided"), max_grad_norm=1.0, sharding=MeshLayout((("data", 1),))),
    ),
}


@pytest.mark.parametrize("case", SHORT_AND_SPEC)
def test_the_spec_form_compiles_the_step_the_short_form_compiles(case):
    step_keywords, state_keywords, spec = SHORT_AND_SPEC[case]
    mesh = leanstep.sharding.data_mesh(jax.devices()[:1]) if case == "mesh" else None
    loss = _aux_loss if spec.loss.has_aux else _loss
    optimizer = optax.adam(0.1)
    short_state = TrainState.create(_params(), optimizer, **state_keywords)
    spec_state = TrainState.create(_params(), optimizer, spec)
    assert short_state.master == spec_state.master
    for a, b in zip(jax.tree.leaves(short_state), jax.tree.leaves(spec_state), strict=True):
        np.testing.assert_array_equal(a, b)
    short_step = make_train_step(loss, **step_keywords, mesh=mesh)
    spec_step = make_train_step(loss, spec, mesh=mesh)
    assert spec_step.lower(spec_state, _batch()).as_text() == short_step.lower(short_state, _batch()).as_text()
    (s1, m1), (s2, m2) = short_step(short_state, _batch()), spec_step(spec_state, _batch())
    for a, b in zip(jax.tree.leaves((s1, m1)), jax.tree.leaves((s2, m2)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(s2.params["w"], _params()["w"])  # the step moved the weights


def test_the_program_comparison_tells_one_setting_apart():
    state = TrainState.create(_params(), optax.adam(0.1))
    one = make_train_step(_loss, StepSpec(max_grad_norm=1.0)).lower(state, _batch()).as_text()
    other = make_train_step(_loss, StepSpec(max_grad_norm=2.0)).lower(state, _batch()).as_text()
    assert one != other


def test_the_spec_form_takes_at_most_six_parameters():
    named = [p for p in inspect.signature(make_train_step).parameters.values() if p.kind is not p.VAR_KEYWORD]
    assert [p.name for p in named] == ["loss_fn", "spec", "mesh", "jit"]


def test_a_spec_and_short_keywords_together_are_refused():
    with pytest.raises(TypeError, match="got a spec and the keywords num_microbatches"):
        make_train_step(_loss, StepSpec(), num_microbatches=2)
    with pytest.raises(TypeError, match="got a spec and the keywords loss_scale"):
        TrainState.create(_params(), optax.sgd(0.1), StepSpec(), loss_scale="dynamic")
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_microbatches'"):
        TrainState.create(_params(), optax.sgd(0.1), num_microbatches=2)


def test_the_state_takes_the_spike_guard_from_the_spec_the_step_is_built_from():
    spec = StepSpec(spike_guard=SpikeGuard(window=8, warmup=2))
    state = TrainState.create(_params(), optax.sgd(0.1), spec)
    assert state.spike is not None and state.spike.values.shape == SpikeGuard(window=8).init().values.shape
    _, metrics = make_train_step(_loss, spec)(state, _batch())
    assert not bool(metrics.spiked)


def test_a_mesh_that_differs_from_the_spec_s_layout_is_named():
    mesh = leanstep.sharding.data_mesh(jax.devices()[:1])
    with pytest.raises(ValueError, match="sharding.axes is data=2 but the mesh given has data=1"):
        make_train_step(_loss, StepSpec(sharding=MeshLayout("data=2")), mesh=mesh)
    with pytest.raises(ValueError, match="give the layout once"):
        make_train_step(_loss, StepSpec(sharding=MeshLayout(reduce="step")), mesh=ShardingLayer(mesh))
    layer = ShardingLayer(mesh, reduce="step")
    assert callable(make_train_step(_loss, StepSpec(sharding=MeshLayout(reduce="step")), mesh=layer))


# --- the planner takes the spec ------------------------------------------------------------------


def _plan(spec=None, **keywords):
    def make_loss_fn(policy):
        return lambda p, b: jnp.mean(jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] ** 2)

    params = {"w1": jax.ShapeDtypeStruct((32, 64), jnp.float32), "w2": jax.ShapeDtypeStruct((64, 8), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((8, 32), jnp.float32)}
    candidates = leanstep.planning.SearchSpace(remat_policies=("none", "full"), microbatches=(1, 2))
    return leanstep.planning.plan(
        make_loss_fn, params, batch, optax.adamw(1e-3), spec, budget_bytes="64MiB", candidates=candidates,
        search=leanstep.planning.SearchOptions(exhaustive=True), **keywords,
    )  # fmt: skip


def test_a_plan_plans_its_spec():
    spec = StepSpec(
        "compute=bfloat16", max_grad_norm=1.0, loss_scale="dynamic", master="bfloat16-sr", moments="int8",
        accumulation=Accumulation(4, "strided"),
    )  # fmt: skip
    # the user's keyword form is the same value, planned the same way
    assert spec == StepSpec.from_keywords(
        precision="compute=bfloat16", max_grad_norm=1.0, loss_scale="dynamic", master="bfloat16-sr", moments="int8",
        num_microbatches=4, split="strided",
    )  # fmt: skip
    planned = _plan(spec)
    assert len(planned.candidates) == 4  # its microbatch count searched: 1 and 2, under two policies
    assert {StepSpec(c.setting.precision).precision for c in planned.candidates} == {spec.precision}
    # the spec's formats reached the state: the plan's note on the state's bytes a parameter
    assert any("4.30 bytes a parameter" in n for n in planned.notes)
    assert not any("bytes a parameter" in n for n in _plan(StepSpec("compute=bfloat16")).notes)
    # and its clip the step: the chosen executable's program is the one make_train_step builds from the spec
    clipped, plain = _plan(spec), _plan(spec.replace(max_grad_norm=None))
    assert clipped.chosen.flops != plain.chosen.flops


def test_a_plan_of_a_guarded_spec_gives_the_state_its_window():
    # The guard goes to the step and to the state (its window), as TrainState.create(spec) gives it.
    guarded = _plan(StepSpec(spike_guard="on"))
    assert guarded.chosen.fits and guarded.chosen.peak_bytes > _plan(StepSpec()).chosen.peak_bytes


def test_leanstep_plan_of_a_guarded_run_plans_from_its_spec(cli):
    result = cli("plan", "--size", "tiny", "--batch-size", "8", "--seq-len", "16", "--budget", "64MiB",
                 "--spike-guard", "on", "--microbatch-counts", "1")  # fmt: skip
    assert result.code == 0 and "chosen: --microbatches 1" in result.out, result.err


def test_a_plan_given_0_11_s_step_keywords_is_refused_naming_the_spec():
    with pytest.raises(TypeError) as refused:
        _plan(StepSpec(), max_grad_norm=1.0, loss_scale="dynamic")
    assert str(refused.value) == (
        "plan(loss_scale=, max_grad_norm=) takes its step settings in its spec since leanstep 0.12: pass "
        "spec=leanstep.StepSpec.from_keywords(loss_scale=..., max_grad_norm=...)"
    )
    with pytest.raises(TypeError, match="spec must be a leanstep.StepSpec or None, got dict"):
        _plan({"precision": "float32"})
