"""The optimizer state in host memory (leanstep.step.update.offload) and the memory-space report
(leanstep.inspection.memory_spaces): the same bits as the state kept on the device, one chunk of
the state on the device at a time (read from the program), and the audit's refusals.

XLA:CPU compiles and runs the offloaded step but keeps every buffer in its one memory: its
``memory_analysis()`` reports no host bytes, so the device-resident bytes are read here from the
compiled entry layout (S(5): host) and the traced transfers; benchmarks/tpu_offload.py measures
them on a TPU."""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from leanstep.step.update.chunks import chunk_plan
from leanstep.step.update.offload import is_offloaded
from tests.test_chunked_update import CHUNK, FORMS, _batch, _identical, _loss, _optimizers, _params


def _trajectory(optimizer: str, form: str, update_chunk, offload: bool, steps: int = 4) -> list[np.ndarray]:
    master, moments = FORMS[form]
    state = leanstep.TrainState.create(
        _params(), _optimizers()[optimizer], loss_scale="dynamic", master=master, moments=moments
    )
    if offload:
        state = leanstep.step.offload_opt_state(state)
    step = leanstep.make_train_step(
        _loss, precision="compute=bfloat16", num_microbatches=2, max_grad_norm=1.0, update_chunk=update_chunk,
        donate=False,
    )  # fmt: skip
    leaves = []
    for i in range(steps):
        state, metrics = step(state, _batch(i))
        assert is_offloaded(state.opt_state) == offload  # the step keeps the state where it was
        leaves += [np.asarray(x) for x in jax.tree.leaves((state, metrics))]
    return leaves


@pytest.mark.parametrize(
    ("optimizer", "form", "update_chunk"),
    [
        ("adamw", "lean", CHUNK),
        ("adamw", "float32", "auto"),
        ("chain", "lean", None),
        ("sgd_momentum", "float32", CHUNK),
    ],
)
def test_an_offloaded_state_steps_bit_identically_to_one_on_the_device(optimizer, form, update_chunk):
    on_device = _trajectory(optimizer, form, update_chunk, offload=False)
    offloaded = _trajectory(optimizer, form, update_chunk, offload=True)
    assert _identical(on_device, offloaded)
    per_step = len(on_device) // 4
    assert not _identical(on_device[:per_step], on_device[-per_step:])  # the state moved


def test_offload_places_the_moments_on_the_host_and_keeps_scalars_on_the_device():
    state = leanstep.TrainState.create(_params(), optax.adam(1e-3), moments="int8")
    offloaded = leanstep.step.offload_opt_state(state)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(offloaded.opt_state) if x.ndim}
    assert kinds == {"pinned_host"}
    assert all(x.sharding.memory_kind == "device" for x in jax.tree.leaves(offloaded.opt_state) if not x.ndim)
    assert not is_offloaded(offloaded.params) and not is_offloaded(state.opt_state)
    for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(offloaded.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_offload_opt_state_refuses_what_is_not_a_state_of_arrays():
    with pytest.raises(TypeError, match="offload_opt_state takes a leanstep.TrainState, got dict"):
        leanstep.step.offload_opt_state({"w": jnp.zeros(2)})
    abstract = jax.eval_shape(lambda: leanstep.TrainState.create(_params(), optax.adam(1e-3)))
    with pytest.raises(TypeError, match="takes a state of arrays, got jax.ShapeDtypeStructs in state.opt_state"):
        leanstep.step.offload_opt_state(abstract)


def test_offload_opt_state_refuses_8_bit_moments_on_a_tpu_with_one_line():
    from leanstep.step.update import offload as update_offload

    state = leanstep.TrainState.create(_params(), optax.adam(1e-3), master="bfloat16-sr", moments="int8")
    why = update_offload._refused_on_platform(state.opt_state, "tpu")
    assert why.startswith("offload_opt_state: 8-bit moments") and "moments='bfloat16'" in why and "\n" not in why
    assert update_offload._refused_on_platform(state.opt_state, "gpu") == ""
    assert update_offload._refused_on_platform(state.opt_state) == ""  # this CPU: offloaded as before
    float32 = leanstep.TrainState.create(_params(), optax.adam(1e-3))
    assert update_offload._refused_on_platform(float32.opt_state, "tpu") == ""


# --- what the program keeps on the device -------------------------------------------------------------


def _state_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.ndim)


UPDATE_CHUNK = 70_000  # the 4 layers' stack cut in blocks, the embedding and the rest whole


@pytest.fixture(scope="module")
def transformer_reports():
    """The state and both memory-space reports (on the device, offloaded) of a 4-layer transformer
    step updated in chunks of UPDATE_CHUNK: built once for the tests that read them (about 10 s)."""
    return _transformer_reports(UPDATE_CHUNK)


def _transformer_reports(update_chunk: int):
    from leanstep.models.transformer import TransformerConfig, init_transformer, transformer_loss

    config = TransformerConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=2, d_ff=512, seq_len=32)
    make = lambda key: leanstep.TrainState.create(
        init_transformer(key, config), optax.adamw(1e-3), loss_scale="dynamic", master="bfloat16-sr", moments="int8"
    )
    state = jax.jit(make)(jax.random.key(0))
    loss = functools.partial(transformer_loss, config=config, remat_policy="full")
    step = leanstep.make_train_step(
        loss, precision="compute=bfloat16", num_microbatches=2, max_grad_norm=1.0, update_chunk=update_chunk
    )
    batch = {"tokens": jnp.zeros((4, 33), jnp.int32)}
    plain = leanstep.inspection.memory_space_report(step, state, batch)
    offloaded = leanstep.inspection.memory_space_report(step, leanstep.step.offload_opt_state(state), batch)
    return state, plain, offloaded


def _chunk_state_bytes(state, update_chunk: int) -> tuple[list[int], int]:
    """Each chunk's optimizer-state bytes, from the plan and the optimizer's state of each leaf
    alone; and how many stacks hold vectors (moved whole before their loop: update.chunks)."""
    wide = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), state.params)
    plan, _ = chunk_plan(state.optimizer, state.opt_state, wide, update_chunk)
    leaves = jax.tree.leaves(wide)
    per_leaf = [_state_bytes(jax.eval_shape(state.optimizer.init, leaf)) for leaf in leaves]
    chunks = [
        sum(per_leaf[u.leaf] * (1 if u.rows is None else u.rows) // (1 if u.rows is None else leaves[u.leaf].shape[0])
            for u in chunk)
        for chunk in plan.chunks
    ]  # fmt: skip
    vector_stacks = sum(c[0].start == 0 and any(leaves[u.leaf].ndim <= 2 for u in c) for c in plan.chunks)
    return chunks, vector_stacks


def test_an_offloaded_state_is_on_the_device_one_chunk_at_a_time(transformer_reports):
    update_chunk = UPDATE_CHUNK
    state, plain, offloaded = transformer_reports
    moments = _state_bytes(state.opt_state)
    chunks, vector_stacks = _chunk_state_bytes(state, update_chunk)
    assert len(chunks) > 2 and sum(chunks) == moments and vector_stacks >= 1
    # The compiled program keeps the moments in host memory, in and out; the same buffers in all.
    assert offloaded.host_argument_bytes == offloaded.host_output_bytes == moments
    assert offloaded.device_argument_bytes + offloaded.host_argument_bytes == plain.device_argument_bytes
    masters = _state_bytes(state.params)
    assert offloaded.device_argument_bytes - masters < 0.05 * masters  # masters, scalars and the batch
    # It brings them to the device a chunk at a time: one transfer each way per chunk (and a stack's
    # vectors whole, around its loop), the largest one chunk.
    assert (
        offloaded.asked_to_device
        == offloaded.asked_to_host
        == leanstep.inspection.Transfers(len(chunks) + vector_stacks, moments, max(chunks))
    )
    assert max(chunks) < moments / 2
    assert plain.asked_to_device.moves == plain.to_device.moves == 0
    # XLA:CPU: one memory, no transfers in the compiled program, no host bytes in its analysis.
    if jax.devices()[0].platform == "cpu":
        assert offloaded.to_device.moves == offloaded.reported_host_bytes == 0
    assert offloaded.device_peak_bytes < plain.device_peak_bytes
    leanstep.inspection.check_offload(offloaded, plain)


def test_check_offload_refuses_a_policy_that_moves_nothing_or_keeps_the_peak(transformer_reports):
    _, plain, offloaded = transformer_reports
    with pytest.raises(ValueError, match="the offload policy moves nothing"):
        leanstep.inspection.check_offload(plain, plain)
    higher = offloaded._replace(temp_bytes=offloaded.temp_bytes + plain.device_peak_bytes)
    with pytest.raises(ValueError, match="does not lower the step's device peak: .* bytes offloaded against"):
        leanstep.inspection.check_offload(higher, plain)


@pytest.mark.slow  # a whole benchmark script's dry run: the run is the point
def test_tpu_offload_dry_run(tmp_path):
    from benchmarks.tpu_offload import main

    out = tmp_path / "offload.json"
    report = main(["--tiny", "--formats", "bf16-sr + int8", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    entry = report["formats"]["bf16-sr + int8"]
    assert entry["bit_identical"] is True and entry["check_offload"] == "accepted"
    assert entry["offloaded"]["host_argument_bytes"] > 0 and entry["plain"]["host_argument_bytes"] == 0


def test_cli_audit_offload_reports_both_steps_and_refuses_an_offload_that_moves_nothing(cli, monkeypatch):
    argv = ["audit", "--size", "tiny", "--batch-size", "4", "--microbatches", "2", "--offload", "opt_state"]
    result = cli(*argv)
    assert result.code == 0, result.err
    out = result.out
    assert "state on the device: memory spaces" in out and "optimizer state offloaded: memory spaces" in out
    assert re.search(r"offloaded: memory spaces \(cpu\):\n.*\n  host    arguments [1-9][0-9.]* KiB", out)
    assert out.rstrip().endswith("offload (--offload opt_state): ok")
    from leanstep.training import analysis
    from leanstep.training.config import RunConfig

    plain, _ = analysis.offload_audit_run(RunConfig(size="tiny", batch_size=4, microbatches=2))
    monkeypatch.setattr(analysis, "offload_audit_run", lambda config: (plain, plain))
    result = cli(*argv)
    assert result.code == 1
    assert "offload (--offload opt_state): REFUSED: the offload policy moves nothing" in result.out


def test_an_offloaded_state_compiles_the_step_once():
    from leanstep.compilation.count import CompileCount

    state = leanstep.step.offload_opt_state(
        leanstep.TrainState.create(_params(), optax.adamw(1e-2), loss_scale="dynamic")
    )
    step = leanstep.make_train_step(_loss, update_chunk=CHUNK, donate=False)
    batches = [_batch(i) for i in range(3)]
    state, _ = step(state, batches[0])
    with CompileCount() as count:
        for batch in batches[1:]:  # the state the step returns: committed arrays, as offload_opt_state's
            state, _ = step(state, batch)
        jax.block_until_ready(state)
    assert count.compiled == 0


# Shaped as XLA:TPU writes it (from a v5e): a host buffer's row sliced to the device, updated, and
# written back into it; a copy into VMEM (S(1)) in between is no host transfer.
_TPU_HLO = """HloModule jit_B, input_output_alias={ {0}: (0, {}, may-alias) }, entry_computation_layout={(f32[8,512,1024]{2,1,0:T(8,128)S(5)}, f32[8,512,1024]{2,1,0:T(8,128)})->f32[8,512,1024]{2,1,0:T(8,128)S(5)}}

ENTRY %main.1 (m.1: f32[8,512,1024], g.1: f32[8,512,1024]) -> f32[8,512,1024] {
  %m.1 = f32[8,512,1024]{2,1,0:T(8,128)S(5)} parameter(0)
  %g.1 = f32[8,512,1024]{2,1,0:T(8,128)} parameter(1)
  %c = s32[] constant(0)
  %dynamic-slice-start = ((f32[8,512,1024]{2,1,0:T(8,128)S(5)}, s32[], s32[], s32[]), f32[1,512,1024]{2,1,0:T(8,128)}, u32[]{:S(2)}) dynamic-slice-start(%m.1, %c, %c, %c), dynamic_slice_sizes={1,512,1024}
  %dynamic-slice-done = f32[1,512,1024]{2,1,0:T(8,128)} dynamic-slice-done(%dynamic-slice-start)
  %copy-start = (f32[1,512,1024]{2,1,0:T(8,128)S(1)}, f32[1,512,1024]{2,1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%dynamic-slice-done)
  %copy-done = f32[1,512,1024]{2,1,0:T(8,128)S(1)} copy-done(%copy-start)
  %fusion = f32[1,512,1024]{2,1,0:T(8,128)} fusion(%copy-done), kind=kLoop, calls=%fused
  %dynamic-update-slice-start = ((f32[8,512,1024]{2,1,0:T(8,128)S(5)}, f32[1,512,1024]{2,1,0:T(8,128)}, s32[]{:T(128)}, s32[]{:T(128)}, s32[]{:T(128)}), f32[8,512,1024]{2,1,0:T(8,128)S(5)}, u32[]{:S(2)}) dynamic-update-slice-start(%m.1, %fusion, %c, %c, %c)
  ROOT %dynamic-update-slice-done = f32[8,512,1024]{2,1,0:T(8,128)S(5)} dynamic-update-slice-done(%dynamic-update-slice-start)
}
"""


def test_the_hlo_reader_counts_a_tpu_programs_host_slices_and_layout():
    from leanstep.inspection.memory_spaces import entry_layout, hlo_transfers

    row = 512 * 1024 * 4
    assert hlo_transfers(_TPU_HLO) == (leanstep.inspection.Transfers(1, row, row),) * 2
    whole = 8 * row
    assert entry_layout(_TPU_HLO) == ([(whole, True), (whole, False)], [(whole, True)], {0: 0})
