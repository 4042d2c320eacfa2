"""leanstep verify's int8 rows on the tiny transformer, and the planted int8 bugs that must fail them by name.

The rows (:mod:`leanstep.verification.int8_checks`): ``int8_agreement`` (the int8 step's gradient against the
same step's without int8, each leaf's direction and norm), ``int8_microbatches`` (M microbatches against one)
and ``int8_meshes`` (each layout against one device), the last two in float32 compute. The controls are the
int8 matmul with one thing wrong (:mod:`int8_controls`, patched in for the test, nothing the library can switch
on): a gradient's scale from the loss-scaled gradient, a scale over the microbatch's rows, a weight's column
scale from each device's shard without a ``pmax``. The mesh rows run in a child process with 2 simulated
devices (:mod:`workers`), as ``leanstep verify --devices 2`` runs them.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import leanstep
from helpers.int8_controls import LOSS_SCALE, planted
from helpers.tiny_runs import TINY_TRANSFORMER
from helpers.workers import run_worker
from leanstep.blocks.int8 import int8_matmul
from leanstep.training import RunConfig

BF16 = "params=float32,compute=bfloat16,output=float32"
#: The run the rows are checked on: its default dynamic loss scale starts at the controls' LOSS_SCALE.
CONFIG = dict(size="tiny", batch_size=8, seq_len=16, microbatches=4, precision=BF16, int8="on")
#: The layouts the mesh row is checked on here: rows over devices, and the parameters split too (fsdp).
LAYOUTS = ("data=2", "fsdp=2")
HERE = ("int8_agreement", "int8_microbatches")

#: control -> (the check that must fail, words of its diagnosis, words of where it points)
CAUGHT_BY = {
    "scale_from_loss_scaled": ("int8_agreement", "input gradient quantized to zeros", "norm ratio 0"),
    "per_microbatch_scale": ("int8_microbatches", "a scale computed over the microbatch's rows", "relative error"),
    "shard_scale_no_pmax": ("int8_meshes", "not max-reduced over them (no pmax)", "fsdp=2: "),
}


def int8_report(control: str | None = None, checks=HERE, meshes=(), **fields) -> leanstep.verification.VerifyReport:
    """verify's ``checks`` on the step of CONFIG (with ``fields``), the int8 matmuls ``control``'s if one is named."""
    from leanstep.training.verify_run import verify_setup

    config = RunConfig(**{**CONFIG, **fields})
    setup = verify_setup(config)
    with planted(control) if control else contextlib.nullcontext():  # traced, so compiled, inside
        return leanstep.verification.verify_step(
            setup, num_microbatches=config.microbatches, checks=checks, meshes=meshes, name=str(control)
        )


FLAGS = (*TINY_TRANSFORMER, "--microbatches", "4", "--precision", BF16)


def cli_rows(cli, folder: Path, checks: str, *flags: str) -> tuple[str, dict]:
    """``leanstep verify`` of CONFIG's flags ``--int8 on --checks CHECKS``: its table, and its JSON's rows by name
    (every one passed)."""
    path = folder / "report.json"
    result = cli("verify", *FLAGS, "--int8", "on", "--checks", checks, "--no-resume", *flags, "--json", path)
    assert result.code == 0, result.out + result.err
    assert "every check passed" in result.out and "--int8 on" in result.out, result.out
    rows = {c["name"]: c for c in json.loads(path.read_text())["checks"]}
    assert list(rows) == checks.split(",") and all(c["status"] == "pass" for c in rows.values()), rows
    return result.out, rows


def bound_column(table: str, name: str) -> str:
    line = next(line for line in table.splitlines() if line.strip().startswith(name + " "))
    return line.split()[3]  # check, status, largest, bound


@pytest.fixture(scope="module")
def correct(cli, tmp_path_factory) -> tuple[str, dict]:
    """``leanstep verify --int8 on`` of CONFIG, its int8 rows: the table and the rows."""
    return cli_rows(cli, tmp_path_factory.mktemp("int8_verify"), ",".join(HERE))


def test_leanstep_verify_int8_passes_its_int8_rows_and_prints_their_bounds(correct):
    table, rows = correct
    agreement, microbatches = rows["int8_agreement"], rows["int8_microbatches"]
    delta = np.sqrt(1 / 254)  # sqrt of int8's unit roundoff, above bfloat16's 2^-8
    assert (
        agreement["bound"] == pytest.approx(1 - np.sqrt(1 - delta**2)) and f"1 +- {delta:.3g}" in agreement["tolerance"]
    )
    assert 0 < agreement["largest"] < agreement["bound"] / 10, agreement  # measured 5.9e-5 against 0.00197
    assert "matmuls in bfloat16" in agreement["compared"] and "|G int8| / |G| 0.99" in agreement["compared"]
    # M=4 against M=1 in float32 compute: float32 sums only (measured 8.9e-8)
    assert microbatches["bound"] == 2.0**-14 and microbatches["largest"] < microbatches["bound"] / 100, microbatches
    assert microbatches["compared"].endswith("the int8 step in float32 compute"), microbatches
    assert bound_column(table, "int8_agreement") == "0.00197" and bound_column(table, "int8_microbatches") == "6.1e-05"


@pytest.mark.parametrize("control", ["scale_from_loss_scaled", "per_microbatch_scale"])
def test_each_planted_control_fails_its_check_by_name_and_only_it(control, correct):
    check, named, where = CAUGHT_BY[control]
    report = int8_report(control)
    result = report[check]
    assert result.status == "fail" and named in result.diagnosis and where in result.where, str(report)
    assert all(c.status == "pass" for c in report.checks if c.name != check), str(report)
    assert correct[1][check]["status"] == "pass"  # the same step with the library's int8 matmul


def test_the_loss_scaled_control_needs_the_loss_scale_it_assumes():
    """The first control divides the gradient by the step's loss scale: the run's must be it, else it tests nothing."""
    assert RunConfig().loss_scale == "dynamic" and RunConfig().initial_loss_scale == LOSS_SCALE


def test_weight_gradients_in_int8_agree_and_run_in_float32_for_the_microbatches_row():
    report = int8_report(int8="on,weight_grad=int8")
    assert report.passed, str(report)
    assert "its weight gradients in float32" in report["int8_microbatches"].compared


def test_a_step_without_int8_has_its_int8_rows_not_applicable():
    report = int8_report(int8="none", checks=(*HERE, "int8_meshes"), meshes=("data=2",))
    assert [c.status for c in report.checks] == ["n/a"] * 3, str(report)
    assert all("no int8 matmuls" in c.detail for c in report.checks)


# --- verify's own inputs: a model with int8 matmuls takes the recipe ---------------------------------


def make_int8_loss(policy, int8=None):
    """A two-layer regression whose matmuls are int8 under a recipe (``int8``), in the compute dtype without."""

    def matmul(x, w):
        return x @ w if int8 is None else int8_matmul(x, w, int8)

    return lambda p, b: jnp.mean((matmul(jnp.tanh(matmul(b["x"], p["w1"])), p["w2"]).astype(jnp.float32) - b["y"]) ** 2)


def test_verify_takes_an_int8_recipe_for_a_loss_builder_that_takes_it():
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.normal(size=(16, 4)).astype(np.float32)}
    params = {"w1": jnp.asarray(rng.normal(size=(8, 16)) * 0.3), "w2": jnp.asarray(rng.normal(size=(16, 4)) * 0.3)}
    report = leanstep.verification.verify(
        make_int8_loss, params, batch, num_microbatches=4, precision=BF16, int8="on", checks=HERE
    )
    assert report.passed and "int8 on" in report.setup, str(report)
    with pytest.raises(ValueError, match=r"^int8='on': make_loss_fn must take int8"):
        leanstep.verification.verify(lambda policy: make_int8_loss(policy), params, batch, int8="on", checks=HERE)


# --- the mesh row, in a child process with 2 simulated devices ---------------------------------------


def worker(out: Path) -> None:
    """``int8_meshes`` on LAYOUTS, for the library's int8 matmul and the shard-scale control."""
    jax.config.update("jax_num_cpu_devices", 2)
    from leanstep.compilation.cache import enable_compile_cache

    enable_compile_cache()  # the suite's: the one-device program is the in-process tests' M=4 one in float32
    results = {}
    for control in (None, "shard_scale_no_pmax"):
        report = int8_report(control, checks=("int8_meshes",), meshes=LAYOUTS)
        results[str(control)] = report["int8_meshes"].to_dict()
    (out / "int8_meshes.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def on_meshes(tmp_path_factory) -> dict:
    return run_worker(__file__, tmp_path_factory.mktemp("int8_meshes"), "int8_meshes.json")


def test_the_mesh_row_passes_and_the_unreduced_shard_scale_fails_it_by_name(on_meshes):
    correct = on_meshes["None"]
    assert correct["status"] == "pass" and correct["largest"] < correct["bound"] / 100, correct  # measured 7.2e-8
    assert correct["compared"] == "data=2; fsdp=2 vs one device, the int8 step in float32 compute", correct
    check, named, where = CAUGHT_BY["shard_scale_no_pmax"]
    failed = on_meshes["shard_scale_no_pmax"]
    assert failed["name"] == check and failed["status"] == "fail", failed
    assert named in failed["diagnosis"] and failed["where"].startswith(where), failed


# --- leanstep verify --int8 --devices 2: the mesh rows in verify's child process ------------------------


@pytest.mark.slow(reason="leanstep verify's child process with 2 simulated devices: 25 s on the 2-core Xeon")
def test_the_cli_runs_the_int8_mesh_row_beside_the_meshes_check_in_its_child(tmp_path, cli):
    table, rows = cli_rows(cli, tmp_path, "meshes,int8_meshes", "--devices", "2")
    assert rows["int8_meshes"]["compared"].startswith("data=2; fsdp=2; data=1,tensor=2 vs one device"), rows
    assert bound_column(table, "int8_meshes") == "6.1e-05"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    worker(Path(sys.argv[2]))


def test_the_reference_bound_keeps_fp8_and_bfloat16_roundoff_and_leaves_int8_out():
    """Regression: the int8 change kept only np.inexact operand dtypes, which ml_dtypes' FP8 and bfloat16 are
    not, so FP8 steps were held to float32's bound and failed the reference check (CI, 2 of the 10 configs)."""
    from leanstep.verification.bounds import unit_roundoff
    from leanstep.verification.reference_check import coarsest_of

    assert coarsest_of(["float8_e4m3fn", "float8_e5m2", "float32"]) == unit_roundoff("float8_e5m2")
    assert coarsest_of(["bfloat16", "bfloat16"]) == unit_roundoff("bfloat16") > unit_roundoff("float32")
    assert coarsest_of(["int8", "int8", "float32"]) == unit_roundoff("float32")
