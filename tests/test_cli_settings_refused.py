"""Settings that would be ignored are refused, and every message names the flag or argument that fixes it.

A catalogue in the form of tests/test_reliability_input.py: each CLI case ends in exit code 2 and
one stderr line naming the flag (and nothing written for a run that never started); each API case
in a ValueError/TypeError of leanstep's own naming the argument.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from leanstep.cli.main import build_parser, main
from leanstep.step.train_step import TrainState, make_train_step
from leanstep.training import RunConfig
from test_reliability_input import Case

_TRAIN = ("train", "--model", "mlp", "--size", "tiny", "--batch-size", "8", "--seq-len", "16")
_TRAIN += ("--no-progress", "--no-chart")
_PLAN = ("plan", "--model", "mlp", "--size", "tiny", "--batch-size", "8", "--seq-len", "16", "--budget", "1GiB")
_CLUSTER = ("plan", "--accelerator", "a100", "--reductions", "step", "--peak-flops", "1e15", "--bandwidth", "1e11")


def _t(*flags: str, data: str = "{corpus}") -> tuple[str, ...]:
    return (*_TRAIN, "--data", data, "--out", "{tmp}/refused", *flags)


def _p(*flags: str) -> tuple[str, ...]:
    return (*_PLAN, *flags)


_IGNORED = "add --devices N (or --mesh AXES), or drop it"

CLI = [
    # leanstep train: a flag that only matters with another flag
    Case(
        "train/resume_with_time_budget",
        _t("--resume", "--time-budget", "30s"),
        2,
        "--resume and --time-budget: a resumed run keeps the steps its --time-budget chose",
    ),
    Case("train/resume_with_time_budget_1h", _t("--resume", "--time-budget", "1h"), 2, "drop --time-budget"),
    Case(
        "train/reduce_step_without_mesh",
        _t("--steps", "2", "--reduce", "step"),
        2,
        "--reduce step reduces gradients over a mesh; add --mesh AXES or --devices N",
    ),
    Case("train/reduce_microbatch_without_mesh", _t("--steps", "2", "--reduce", "microbatch"), 2, "--reduce micro"),
    Case(
        "train/accelerator_without_mesh_auto",
        _t("--steps", "2", "--accelerator", "a100"),
        2,
        "--accelerator a100 prices only the plan of --mesh auto; add --mesh auto or drop it",
    ),
    Case(
        "train/accelerator_with_a_fixed_mesh",
        _t("--steps", "2", "--mesh", "data=1", "--accelerator", "a100"),
        2,
        "--accelerator a100 prices only the plan of --mesh auto",
    ),
    Case(
        "train/initial_loss_scale_without_a_scale",
        _t("--steps", "2", "--loss-scale", "none", "--initial-loss-scale", "8"),
        2,
        "--initial-loss-scale with --loss-scale none",
    ),
    *[
        Case(
            f"train/warmup_with_{schedule}",
            _t("--steps", "2", "--schedule", schedule, "--warmup-steps", "5"),
            2,
            f"--warmup-steps with --schedule {schedule}: that schedule has no warmup",
        )
        for schedule in ("constant", "cosine")
    ],
    Case("train/fsdp_without_devices", _t("--steps", "2", "--fsdp"), 2, "--fsdp shards the state over devices"),
    # leanstep train: the mesh against the devices
    Case(
        "train/mesh_past_any_device_count",
        _t("--steps", "2", "--mesh", "data=65536,fsdp=65536"),
        2,
        "--mesh data=65536,fsdp=65536 needs 4294967296 devices, more than 1024 per process",
    ),
    Case("train/mesh_past_the_simulated_cap", _t("--steps", "2", "--mesh", "data=2048"), 2, "--mesh data=2048 needs"),
    Case(
        "train/mesh_not_the_devices",
        _t("--steps", "2", "--mesh", "data=2", "--devices", "4"),
        2,
        "--mesh data=2 needs 2 devices; --devices 4 gives 4",
    ),
    Case(
        "train/mesh_not_the_devices_of_every_process",
        _t(
            "--steps",
            "2",
            "--mesh",
            "data=2",
            "--devices",
            "1",
            "--coordinator",
            "localhost:1234",
            "--num-processes",
            "4",
            "--process-id",
            "0",
        ),
        2,
        "--mesh data=2 needs 2 devices; --devices 1 times --num-processes 4 gives 4",
    ),
    Case("train/mesh_unknown_axis", _t("--steps", "2", "--mesh", "pipe=2"), 2, "--mesh must be name=size pairs"),
    Case("train/mesh_size_zero", _t("--steps", "2", "--mesh", "tensor=0"), 2, "--mesh must be name=size pairs"),
    Case(
        "train/devices_past_the_cap",
        _t("--steps", "2", "--devices", "4096"),
        2,
        "--devices must be an integer in [1, 1024] (devices per process), got 4096",
    ),
    # leanstep train: messages that name the flag
    Case(
        "train/precision_auto_with_strict",
        _t("--steps", "2", "--precision", "auto,strict"),
        2,
        "--precision: 'auto' stands alone (it picks every dtype), got 'auto,strict'",
    ),
    Case(
        "train/precision_unknown_names_its_forms",
        _t("--steps", "2", "--precision", "fast"),
        2,
        "--precision takes auto, or params=DTYPE,compute=DTYPE,output=DTYPE[,strict]",
    ),
    Case(
        "train/data_file_name_not_utf8",
        _t("--steps", "2", data="{bad_name_dir}"),
        2,
        "--data folder '{bad_name_dir}' holds a file whose name is not UTF-8: 'bad\\udcff.txt'",
    ),
    # leanstep plan
    *[
        Case(f"plan/{flag[2:]}_without_devices", _p(flag, value), 2, f"{flag} prices or searches a cluster plan only")
        for flag, value in (
            ("--accelerator", "a100"),
            ("--reductions", "step"),
            ("--peak-flops", "1e15"),
            ("--bandwidth", "1e11"),
            ("--inter-bandwidth", "1e10"),
            ("--node-size", "4"),
            ("--efficiency", "0.4"),
        )
    ],
    *[
        Case(
            f"plan/efficiency_{name}",
            _p("--devices", "2", "--efficiency", value),
            2,
            f"--efficiency must be a fraction of peak FLOP/s in (0, 1], got {shown}",
        )
        for name, value, shown in (("2", "2", "2.0"), ("zero", "0", "0.0"), ("negative", "-0.5", "-0.5"))
    ],
    Case("plan/microbatch_counts_empty", _p("--microbatch-counts", ","), 2, "--microbatch-counts is empty"),
    Case("plan/remat_policies_empty", _p("--remat-policies", ","), 2, "--remat-policies is empty"),
    Case("plan/reductions_empty", _p("--devices", "2", "--reductions", " , "), 2, "--reductions is empty"),
    Case(
        "plan/mesh_past_any_device_count",
        _p("--mesh", "data=65536,fsdp=65536"),
        2,
        "--mesh data=65536,fsdp=65536 needs 4294967296 devices, more than 1024 per process",
    ),
    Case(
        "plan/mesh_past_the_devices",
        _p("--devices", "2", "--mesh", "data=4"),
        2,
        "--mesh data=4 needs 4 devices; --devices 2 gives 2",
    ),
    Case("plan/mesh_unknown_axis", _p("--mesh", "pipe=2"), 2, "--mesh must be name=size pairs"),
    Case("plan/precision_auto_with_strict", _p("--precision", "auto,strict"), 2, "--precision: 'auto' stands alone"),
    # leanstep solve and report
    Case(
        "solve/duplicate_key",
        ("solve", "global-norm-clipping", "--input", "{dup_top}"),
        2,
        "the JSON key 'max_norm' appears twice in one object",
    ),
    Case(
        "solve/duplicate_nested_key",
        ("solve", "global-norm-clipping", "--input", "{dup_nested}"),
        2,
        "{dup_nested}: the JSON key 'w' appears twice",
    ),
    Case(
        "report/negative_step",
        ("report", "{negative_step_run}"),
        2,
        "{negative_step_run}/metrics.jsonl:1 field 'step' is -3; expected an integer >= 0",
    ),
    Case(
        "report/negative_consecutive_skips",
        ("report", "{negative_skips_run}"),
        2,
        "{negative_skips_run}/metrics.jsonl:2 field 'consecutive_skips' is -1",
    ),
]


# --- API cases ---------------------------------------------------------------------------------


def _one_device_mesh() -> Any:
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))


_FOUR_DEVICE_HLO = """HloModule m, num_partitions=4
ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %r = f32[8]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
}"""


def _aux_step(aux: Any) -> Any:
    def loss(params: dict, batch: dict) -> Any:
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2), aux

    state = TrainState.create({"w": jnp.zeros(2)}, optax.sgd(0.1))
    return make_train_step(loss, has_aux=True)(state, {"x": jnp.ones((4, 2)), "y": jnp.ones(4)})


API = [
    Case(
        "collectives/not_hlo",
        lambda p: leanstep.inspection.collectives_report("hello world"),
        ValueError,
        "compiled must be a jax.stages.Compiled or HLO text with an ENTRY computation",
    ),
    Case(
        "collectives/empty_text",
        lambda p: leanstep.inspection.collectives_report(""),
        ValueError,
        "HLO text with an ENTRY computation",
    ),
    Case(
        "collectives/an_int",
        lambda p: leanstep.inspection.collectives_report(5),
        TypeError,
        "compiled must be a jax.stages.Compiled (jitted.lower(...).compile()) or HLO text (str), got int",
    ),
    Case("collectives/none", lambda p: leanstep.inspection.collectives_report(None), TypeError, "got NoneType"),
    Case(
        "collectives/wrong_mesh",
        lambda p: leanstep.inspection.collectives_report(_FOUR_DEVICE_HLO, _one_device_mesh()),
        ValueError,
        "mesh has 1 devices but the HLO's collectives span 4",
    ),
    Case(
        "loss/aux_a_string",
        lambda p: _aux_step("hi"),
        TypeError,
        "has_aux=True: loss_fn's aux must be a pytree of arrays and numbers (it is stacked over microbatches), got a str",
    ),
    Case("loss/aux_leaf_a_string", lambda p: _aux_step({"name": "hi"}), TypeError, "got a str leaf: 'hi'"),
]

CATALOGUE = CLI + API


# --- files the cases point at ------------------------------------------------------------------

_RECORD = {
    "kind": "train",
    "step": 1,
    "loss": 1.0,
    "grad_norm": 1.0,
    "loss_scale": 1.0,
    "skipped": False,
    "clipped": False,
    "consecutive_skips": 0,
    "tokens_per_sec": 1.0,
    "elapsed_s": 1.0,
    "lr": 1.0,
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("refused")
    p: dict[str, Path] = {"tmp": root, "corpus": root / "corpus", "bad_name_dir": root / "bad_name_dir"}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for folder in (p["corpus"], p["bad_name_dir"]):
        folder.mkdir()
        (folder / "textwrap.py").write_bytes((stdlib / "textwrap.py").read_bytes())
    with open(os.fsencode(p["bad_name_dir"]) + b"/bad\xff.txt", "wb") as file:  # a name that is not UTF-8
        file.write(b"some text " * 50)
    for name, text in (
        ("dup_top", '{"grads": {"w": [1.0]}, "max_norm": 1.0, "max_norm": 2.0}'),
        ("dup_nested", '{"grads": {"w": [1.0], "w": [2.0]}, "max_norm": 1.0}'),
    ):
        p[name] = root / f"{name}.json"
        p[name].write_text(text)
    for name, records in (
        ("negative_step_run", [{**_RECORD, "step": -3}]),
        ("negative_skips_run", [_RECORD, {**_RECORD, "step": 2, "consecutive_skips": -1}]),
    ):
        p[name] = root / name
        p[name].mkdir()
        (p[name] / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return p


def test_the_catalogue_is_big_and_its_ids_unique():
    assert len(CATALOGUE) >= 40 and len({c.id for c in CATALOGUE}) == len(CATALOGUE)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CATALOGUE])
def test_a_setting_that_would_be_ignored_is_refused(case: Case, paths: dict[str, Path], capsys):
    named = {k: str(v) for k, v in paths.items()}
    fragment = case.fragment.format(**named)
    if isinstance(case.call, tuple):
        argv = [a.format(**named) for a in case.call]
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's own errors
            code = exit_.code
        captured = capsys.readouterr()
        assert (code, captured.out) == (case.expected, "")
        assert captured.err.count("\n") == 1 and captured.err.startswith("leanstep"), captured.err
        assert fragment in captured.err, captured.err
        if argv[0] == "train":
            out = Path(argv[argv.index("--out") + 1])
            assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    else:
        with pytest.raises(case.expected) as info:  # type: ignore[arg-type]
            case.call(paths)  # type: ignore[operator]
        assert fragment in str(info.value)
        assert "/leanstep/" in traceback.extract_tb(info.tb)[-1].filename


@pytest.mark.parametrize("spec", ["AUTO", "Auto", " auto ", "COMPUTE=BF16,PARAMS=F32,OUTPUT=F32"])
def test_precision_is_read_case_insensitively(spec):
    assert RunConfig(precision=spec).validate().precision == spec.strip().lower()


@pytest.mark.parametrize("command", ["train", "plan", "audit"])
def test_help_does_not_give_an_on_off_flag_a_default(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: True)" not in text and "(default: False)" not in text
    assert "(default: 64)" in text or "(default: " in text  # other flags keep theirs


def test_a_partition_rule_that_the_mesh_breaks_names_mesh(tmp_path):
    """A tensor axis that does not divide a weight: one line naming --mesh (3 devices: a child process)."""
    argv = [*_TRAIN, "--d-ff", "4", "--steps", "1", "--mesh", "tensor=3", "--out", str(tmp_path / "run")]
    argv += ["--data", sysconfig.get_paths()["stdlib"] + "/textwrap.py"]
    code = "import sys; from leanstep.cli.main import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("leanstep train: error: --mesh tensor=3: "), (
        done.stderr
    )
