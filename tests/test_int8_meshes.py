"""The int8 step on data=4 and fsdp=4 simulated devices against one device, and under every remat
policy: the tiny transformer with int8 block matmuls, bf16 compute, a dynamic loss scale and a clip
at 1, two steps.

One subprocess (``worker``) with 4 simulated CPU devices and XLA's excess precision off
(``EXACT_ROUNDING``, as ``leanstep verify`` runs its layouts: XLA:CPU may otherwise keep a bf16
value in float32 where one program's fusion lets it and another's does not: with it on, the
remat policies' gradients were 0.26% apart (a leaf's largest difference over its largest entry;
the loss bit for bit), where the model without int8 gave the same bits; a quantizer turns a value
kept wider can round to another int8 step). What holds with it off:

- ``data=4`` is the one-device step of 4 microbatches bit for bit, for both weight-gradient forms:
  a device's rows are a microbatch's, and the int8 weight gradient's per-column scales read the
  same rows either way;
- ``data=4``, ``fsdp=4`` and 4 microbatches are the one-microbatch step within bf16 rounding: each
  part of the batch's gradient is rounded to bf16 before the float32 sum (a leaf's step-1 gradient
  within 0.43% (data=4, 4 microbatches) and 0.62% (fsdp=4) of its largest entry, measured; in
  float32 compute 4 microbatches are within 3.3e-7, tests/test_int8_composition.py);
- the remat policies ``none``, ``dots`` and ``full`` give the same loss, gradient and params, bit for bit.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers.int8_models import BF16, TX, batch, bit_equal, gradient, largest_difference, model, params
from helpers.workers import run_worker

pytestmark = pytest.mark.slow  # 4 simulated devices in a child process, 8 runs compiled: the meshes are the point

STEPS = 2
#: run -> (weight_grad, microbatches, mesh shape or None, remat policy)
RUNS = {
    "one": ("compute", 1, None, "none"),
    "one-m4": ("compute", 4, None, "none"),
    "data4": ("compute", 1, {"data": 4}, "none"),
    "fsdp4": ("compute", 1, {"fsdp": 4}, "none"),
    "int8/one-m4": ("int8", 4, None, "none"),
    "int8/data4": ("int8", 1, {"data": 4}, "none"),
    "remat-dots": ("compute", 1, None, "dots"),
    "remat-full": ("compute", 1, None, "full"),
}
#: A leaf's step-1 gradient against one device's, over its largest entry: a few bf16 roundings
#: (2**-8 = 0.39%) of four partial sums. Measured: 0.43% (data=4, 4 microbatches), 0.62% (fsdp=4).
BF16_PARTS = 1e-2
#: The params after 2 steps against one device's (absolute; SGD at 0.1 moved them by up to 1.3e-2).
#: Measured: 8.5e-5 (data=4, 4 microbatches), 1.2e-4 (fsdp=4).
PARAMS_AFTER_2 = 2e-4


def _run(name: str, device_mesh) -> dict:
    import leanstep

    weight_grad, num_mb, shape, remat = RUNS[name]
    m = model(weight_grad)
    layer = None if shape is None else leanstep.step.ShardingLayer(device_mesh(4, shape=shape), rules=m.rules)
    step = leanstep.make_train_step(
        lambda p, b: m.loss(p, b, remat_policy=remat),
        precision=BF16,
        num_microbatches=num_mb,
        max_grad_norm=1.0,
        mesh=layer,
    )
    state = leanstep.TrainState.create(params(), TX, loss_scale="dynamic")
    batches = [batch(seed) for seed in range(STEPS)]
    if layer is not None:
        state = leanstep.step.shard_train_state(state, layer.mesh, fsdp=layer.fsdp, rules=m.rules)
        batches = [leanstep.sharding.shard_batch(b, layer.mesh) for b in batches]
    out: dict = {"losses": [], "gradients": []}
    for b in batches:
        state, metrics = step(state, b)
        out["losses"].append(float(metrics.loss))
        out["skipped"] = out.get("skipped", False) or bool(metrics.skipped)
        out["gradients"].append([np.asarray(g).tolist() for g in jax.tree.leaves(gradient(state))])
    out["params"] = [np.asarray(p).tolist() for p in jax.tree.leaves(state.params)]
    out["split"] = any(not p.sharding.is_fully_replicated for p in jax.tree.leaves(state.params))
    return out


def worker(out: Path) -> None:
    from leanstep.verification.mesh_check import EXACT_ROUNDING

    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {EXACT_ROUNDING}"  # before JAX starts its backend
    jax.config.update("jax_num_cpu_devices", 4)
    from leanstep.sharding.distributed import device_mesh

    results = {name: _run(name, device_mesh) for name in RUNS}
    results["devices"] = len(jax.devices())
    (out / "int8_meshes.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return run_worker(__file__, tmp_path_factory.mktemp("int8_meshes"), "int8_meshes.json")


def _tree(run: dict, what: str = "params", step: int = -1) -> list[np.ndarray]:
    leaves = run[what] if what == "params" else run[what][step]
    return [np.asarray(x, np.float32) for x in leaves]


def test_every_run_trained_and_the_meshes_split_what_they_should(runs):
    """4 devices; no step skipped; the loss of step 1 the same in every run (measured bit for bit:
    the same params, the forward quantizes per token); fsdp=4 keeps the params split, the others
    replicated."""
    assert runs["devices"] == 4
    for name in RUNS:
        assert not runs[name]["skipped"], name
        assert runs[name]["split"] == (name == "fsdp4"), name
        assert runs[name]["losses"][0] == pytest.approx(runs["one"]["losses"][0], rel=1e-6), name


@pytest.mark.parametrize("weight_grad", ["compute", "int8"])
def test_data4_is_the_four_microbatch_step_bit_for_bit(runs, weight_grad):
    """A missing or doubled reduction over the data axis, or a device's int8 scales read over other
    rows than its microbatch's, would not give it."""
    prefix = "" if weight_grad == "compute" else "int8/"
    a, b = runs[f"{prefix}data4"], runs[f"{prefix}one-m4"]
    assert a["losses"] == b["losses"]
    assert bit_equal(_tree(a), _tree(b))
    assert bit_equal(_tree(a, "gradients"), _tree(b, "gradients"))


@pytest.mark.parametrize("name", ["data4", "fsdp4", "one-m4"])
def test_meshes_and_microbatches_give_one_devices_step_within_bf16_rounding(runs, name):
    """Step 1's gradient within :data:`BF16_PARTS` of one device's (each leaf over its largest
    entry), the params after 2 steps within :data:`PARAMS_AFTER_2`. A device's own rows' gradient
    in place of the batch's is 238% off (measured), a sum of the 4 in place of their mean 300%."""
    one = runs["one"]
    got = largest_difference(_tree(one, "gradients", 0), _tree(runs[name], "gradients", 0))
    assert 0 < got <= BF16_PARTS, got
    for a, b in zip(_tree(one), _tree(runs[name]), strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=PARAMS_AFTER_2)


@pytest.mark.parametrize("policy", ["dots", "full"])
def test_remat_policies_give_the_same_loss_gradient_and_params_bit_for_bit(runs, policy):
    """The recomputed forward quantizes the same values as the saved one: a recompute that read
    other operands (or another recipe) would move the int8 products."""
    a, b = runs["one"], runs[f"remat-{policy}"]
    assert a["losses"] == b["losses"]
    assert bit_equal(_tree(a), _tree(b))
    assert bit_equal(_tree(a, "gradients"), _tree(b, "gradients"))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    worker(Path(sys.argv[2]))
