"""The FP8 state on a mesh against one device, and verify's meshes check of it (issue 57, item 15b).

``data=2,fsdp=2`` gave the built-in transformer's FP8 state up to 1.2% off one device's, and verify's
meshes check passed it, within the gradient's bf16 tolerance (5%): a tolerance a device's own amax in
place of the batch's (no ``pmax``) fits in too. The amaxes were max-reduced over every axis; the
difference was XLA's excess precision (``--xla_allow_excess_precision``, on by default: XLA:CPU keeps
a bf16 value in float32 where a fusion lets it, and a sharded program fuses otherwise). With it off
(``EXACT_ROUNDING``, as ``leanstep verify`` runs its layouts) every layout's FP8 state is one
device's bit for bit, and the check holds it so: the missing ``pmax`` is caught.

The worker runs with 4 simulated devices and ``EXACT_ROUNDING`` in its ``XLA_FLAGS``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from unittest import mock

import jax
import numpy as np
import pytest

from helpers.workers import run_worker

pytestmark = pytest.mark.slow  # 4 simulated devices in child processes: the meshes are the point
from leanstep.training import RunConfig

BF16 = "params=float32,compute=bfloat16,output=float32"
CONFIG = dict(size="tiny", batch_size=8, seq_len=16, microbatches=2, precision=BF16, fp8="delayed")
LAYOUTS = ("data=2,fsdp=2", "data=4", "fsdp=4")


def worker(out: Path) -> None:
    from leanstep.verification.mesh_check import EXACT_ROUNDING

    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {EXACT_ROUNDING}"  # before JAX starts its backend
    jax.config.update("jax_num_cpu_devices", 4)
    from leanstep.training.verify_run import verify_setup
    from leanstep.verification.mesh_check import check_meshes, make_layout
    from leanstep.verification.runs import Runs

    def runs() -> Runs:
        setup = verify_setup(RunConfig(**CONFIG))
        made = Runs(setup, num_microbatches=2)
        made.register("batch", setup.batch)
        made.layouts = LAYOUTS
        return made

    correct = runs()
    one = correct.step("batch", 2).after["fp8"]
    states = {"one": [np.asarray(leaf).tolist() for leaf in jax.tree.leaves(one)]}
    for layout in LAYOUTS:
        got = correct.step("batch", 2, mesh=make_layout(layout)).after["fp8"]
        states[layout] = [np.asarray(leaf).tolist() for leaf in jax.tree.leaves(got)]
    results = {"states": states, "correct": check_meshes(correct, 2).to_dict()}
    # Two bugs: each device keeps its own rows' amax (no max over the data axis); the state 1%
    # low (a device's own amax can be that close to the batch's: inside the gradient's tolerance).
    pmax = jax.lax.pmax
    low = lambda x, axis_name, **_: pmax(x, axis_name) * np.float32(0.99)
    for bug, replacement in (("no_pmax", lambda x, axis_name, **_: x), ("one_percent_low", low)):
        with mock.patch.object(jax.lax, "pmax", replacement):
            results[bug] = check_meshes(runs(), 2).to_dict()
    (out / "meshes.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def meshes(tmp_path_factory) -> dict:
    return run_worker(__file__, tmp_path_factory.mktemp("fp8_meshes"), "meshes.json")


def test_every_layout_gives_one_devices_fp8_state_bit_for_bit(meshes):
    one = [np.asarray(leaf, np.float32) for leaf in meshes["states"]["one"]]
    assert len(one) == 24 and sum(np.any((leaf != 0) & (leaf != 1)) for leaf in one) >= 12  # amaxes recorded
    for layout in LAYOUTS:
        got = [np.asarray(leaf, np.float32) for leaf in meshes["states"][layout]]
        for a, b in zip(one, got, strict=True):
            assert a.tobytes() == b.tobytes(), layout


def test_the_meshes_check_passes_it_and_holds_the_fp8_state_bit_for_bit(meshes):
    correct = meshes["correct"]
    assert correct["status"] == "pass", correct
    assert "FP8 state bit for bit without a tensor axis (XLA's excess precision off)" in correct["tolerance"]


@pytest.mark.parametrize("bug", ["no_pmax", "one_percent_low"])
def test_the_meshes_check_names_the_fp8_state_a_bad_reduction_leaves(meshes, bug):
    """The amax kept per device, and (what the gradient's tolerance let through) 1% low."""
    failed = meshes[bug]
    assert failed["status"] == "fail", failed
    assert failed["where"].startswith(LAYOUTS[0] + ": fp8/") and "pmax" in failed["diagnosis"], failed
    if bug == "one_percent_low":  # inside the gradient's bf16 tolerance, which the FP8 state was held to
        assert failed["largest"] == pytest.approx(0.01, rel=1e-3) and failed["bound"] > 0.05


def test_leanstep_verify_runs_its_layouts_with_exact_rounding():
    from leanstep.training.verify_run import verify_run

    report = verify_run(RunConfig(**CONFIG), checks=("meshes",), num_devices=2, resume=False)
    (meshes,) = report.checks
    assert meshes.status == "pass", meshes
    assert "FP8 state bit for bit without a tensor axis (XLA's excess precision off)" in meshes.tolerance


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    worker(Path(sys.argv[2]))
