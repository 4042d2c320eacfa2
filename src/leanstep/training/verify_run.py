"""verify applied to a :class:`RunConfig` (``leanstep verify``): the run's step, on the run's data.

The setup is the run's own parts (:func:`leanstep.training.build.build_run`): its model, its
step's spec (:attr:`leanstep.training.build.Run.step`: precision, loss scale, masters,
microbatch count, int8 recipe, ...) and its remat policy, on the first batch of its data. Its loss is the model's token-weighted form (``loss_sum``, with a token-weight ``mask`` of
ones added to the batch), which on such a batch equals the mean ``leanstep train`` minimises and
lets the token-weighting and non-finite checks reweight and poison rows. The built-in
transformer's loss is also given as a LayerStack (:func:`leanstep.models.transformer_stack`),
for the ``in_backward`` check.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from leanstep.blocks.int8 import Int8Recipe
from leanstep.blocks.layer_stack import LayerStack
from leanstep.models.registry import build_model
from leanstep.models.transformer import transformer_stack
from leanstep.training.build import build_run
from leanstep.training.config import RunConfig, model_overrides
from leanstep.training.data import BatchSampler, load_corpus
from leanstep.training.machine_size import choose_for_machine
from leanstep.verification import CHECKS, CheckResult, LeanstepStep, ModelExtras, VerifyReport, verify_step
from leanstep.verification.mesh_check import layouts_for

__all__ = [
    "MESH_CHECKS", "check_layouts", "check_resume", "checked_config", "meshes_in_child", "verify_run", "verify_setup",
]  # fmt: skip

#: The checks that run the step on mesh layouts: in a subprocess with simulated devices (:func:`meshes_in_child`).
MESH_CHECKS = ("meshes", "int8_meshes")


def verify_setup(config: RunConfig) -> LeanstepStep:
    """The :class:`leanstep.verification.LeanstepStep` of ``config`` (see the module doc).

    Example:
      >>> setup = verify_setup(RunConfig(model="mlp", size="tiny", batch_size=4, seq_len=8, microbatches=2))
      >>> setup.batch["tokens"].shape, setup.batch["mask"].shape, setup.mask
      ((4, 9), (4, 8), 'mask')
    """
    run = build_run(config)
    config = run.config  # --size and --precision auto resolved
    corpus = load_corpus(config.data, seq_len=config.seq_len)
    batch: dict[str, Any] = dict(BatchSampler(corpus.train, config.batch_size, config.seq_len, config.seed).batch_at(0))
    batch["mask"] = np.ones((config.batch_size, config.seq_len), np.float32)
    recipe = run.config.step.int8
    models = {recipe: run.model}  # and the model without int8 matmuls, built when the int8 checks ask

    def make_loss_fn(policy: str, int8: Int8Recipe | None = recipe) -> Any:
        if int8 not in models:
            recipes = {} if int8 is None else {"int8": int8}
            models[int8] = build_model(config.model, config.size, **model_overrides(config), **recipes)
        model = models[int8]
        return lambda params, rows: model.loss_sum(params, rows, remat_policy=policy)

    # The run's spec (its flags parsed once), its loss the token-weighted form of the mean it trains.
    spec = run.step.replace(loss=dataclasses.replace(run.step.loss, token_weighted=True))
    extras = ModelExtras(rules=run.model.rules, layer_stack=_layer_stack(run.model))
    return LeanstepStep(make_loss_fn, run.init_params(), batch, spec, remat=config.remat, mask="mask", extras=extras)


def _layer_stack(model: Any) -> LayerStack | None:
    """The model's loss as a LayerStack, for the in_backward check: the built-in transformer's, without FP8."""
    if model.name != "transformer" or model.config.fp8 is not None:
        return None
    return transformer_stack(model.config)


def checked_config(config: RunConfig) -> RunConfig:
    """``config`` validated, as the machine resolves it (``--size`` and ``--precision auto``:
    :func:`~leanstep.training.machine_size.choose_for_machine`), with 2 or more microbatches (the
    checks compare microbatches): its own count, else the smallest count that divides the batch.

    Raises:
      ValueError: an invalid config, naming the flag; a batch of one row.
    """
    config = choose_for_machine(config).config
    if config.microbatches > 1:
        return config
    if config.batch_size < 2:
        raise ValueError("--batch-size: verify needs 2 rows or more, to compare microbatches with the batch")
    smallest = next(m for m in range(2, config.batch_size + 1) if config.batch_size % m == 0)
    return dataclasses.replace(config, microbatches=smallest)


def verify_run(
    config: RunConfig,
    *,
    checks: Sequence[str] | None = None,
    num_devices: int | None = None,
    resume: bool = True,
) -> VerifyReport:
    """Runs verify's checks on the step ``config`` trains with (see :func:`checked_config`).

    Args:
      config: the run.
      checks: the names of :data:`leanstep.verification.CHECKS` to run (default: all).
      num_devices: check the mesh layouts of this many devices
        (:func:`leanstep.verification.mesh_check.layouts_for`), in a subprocess with that many
        simulated CPU devices; None or 1: no layouts.
      resume: also check that a run killed and resumed ends as an uninterrupted one does.

    Raises:
      ValueError: an invalid config, naming the flag.
    """
    config = checked_config(config)
    setup = verify_setup(config)
    microbatches = config.microbatches
    name = (
        f"leanstep train --model {config.model} --size {config.size} --batch-size {config.batch_size} "
        f"--precision {setup.precision} --microbatches {microbatches} --remat {config.remat}"
        + (f" --fp8 {config.fp8}" if config.fp8 != "none" else "")
        + (f" --int8 {setup.int8.to_string()}" if setup.int8 is not None else "")
    )
    wanted = tuple(CHECKS) if checks is None else tuple(checks)
    on_meshes = tuple(c for c in MESH_CHECKS if c in wanted)
    if on_meshes:  # before anything runs: a layout the rows do not fit is a flag error
        check_layouts(config, layouts_for(num_devices or 1), num_devices or 1)
    here = tuple(c for c in wanted if c not in MESH_CHECKS)
    report = verify_step(setup, num_microbatches=microbatches, checks=here, name=name)
    results = list(report.checks)
    if on_meshes:
        layouts = layouts_for(num_devices or 1)
        results += meshes_in_child(config, layouts, on_meshes) if layouts else check_meshes_none(num_devices, on_meshes)
    if resume:
        results.append(check_resume(config))
    return VerifyReport(name, tuple(results))


def check_layouts(config: RunConfig, layouts: list[str], num_devices: int) -> None:
    """Refuses layouts whose row axes (data, fsdp) do not split each microbatch's rows evenly.

    Raises:
      ValueError: naming ``--devices``, ``--batch-size`` and ``--microbatches``.
    """
    from leanstep.sharding.distributed import parse_mesh

    rows = config.batch_size // config.microbatches
    for layout in layouts:
        shape = parse_mesh(layout)
        split = shape.get("data", 1) * shape.get("fsdp", 1)
        if rows % split:
            raise ValueError(
                f"--devices {num_devices}: the mesh layout {layout} splits each microbatch's {rows} rows (--batch-size "
                f"{config.batch_size} / --microbatches {config.microbatches}) over {split} devices; expected a device "
                "count whose layouts divide them (or --devices 1 for none)"
            )


def check_meshes_none(num_devices: int | None, checks: Sequence[str] = ("meshes",)) -> list[CheckResult]:
    """The mesh checks when no layout has 2 devices or more."""
    detail = f"--devices {num_devices or 1}: no layout; --devices N checks data=N, fsdp=N and data=N/2,tensor=2"
    return [CheckResult(check, "n/a", "mesh layouts vs one device", 0.0, 0.0, "-", detail=detail) for check in checks]


def meshes_in_child(config: RunConfig, layouts: list[str], checks: Sequence[str] = ("meshes",)) -> list[CheckResult]:
    """The mesh checks (of :data:`MESH_CHECKS`) of ``config`` in a subprocess with enough simulated devices
    for ``layouts``, and XLA's excess precision off (:data:`~leanstep.verification.mesh_check.EXACT_ROUNDING`)."""
    import json
    import math
    import tempfile

    from leanstep.sharding.distributed import parse_mesh, run_on_simulated_cpus
    from leanstep.verification.mesh_check import EXACT_ROUNDING

    devices = max(math.prod(parse_mesh(layout).values()) for layout in layouts)
    with tempfile.TemporaryDirectory() as folder:
        spec, out = f"{folder}/spec.json", f"{folder}/check.json"
        with open(spec, "w") as f:
            body = {
                "config": config.to_json(),
                "layouts": layouts,
                "devices": devices,
                "out": out,
                "checks": list(checks),
            }
            json.dump(body, f)
        code = f"from leanstep.training.verify_run import meshes_in_child_main; meshes_in_child_main({spec!r})"
        # every bf16 result rounded as written, in one device's program and each layout's alike,
        # so that the FP8 state is compared bit for bit (mesh_check)
        child = run_on_simulated_cpus(code, xla_flags=EXACT_ROUNDING)
        if child.returncode:
            raise RuntimeError(f"the meshes check in a subprocess failed:\n{child.stderr[-3000:]}")
        with open(out) as f:
            results = json.load(f)
    for fields in results:
        for key in ("largest", "bound"):
            fields[key] = float(fields[key])
    return [CheckResult(**fields) for fields in results]


def meshes_in_child_main(spec_path: str) -> None:
    """The subprocess side of :func:`meshes_in_child`: sets up the devices, checks, writes the result."""
    import json

    from leanstep.compilation.cache import enable_compile_cache
    from leanstep.sharding.distributed import configure_devices

    with open(spec_path) as f:
        spec = json.load(f)
    configure_devices(spec["devices"])
    enable_compile_cache()
    config = RunConfig(**spec["config"])
    setup = verify_setup(config)
    checks = spec.get("checks", ["meshes"])
    report = verify_step(setup, num_microbatches=config.microbatches, checks=checks, meshes=spec["layouts"])
    with open(spec["out"], "w") as f:
        json.dump([check.to_dict() for check in report.checks], f)


#: The uninterrupted run of the resume check: steps, and a checkpoint every 2.
RESUME_STEPS = 6


def check_resume(config: RunConfig) -> CheckResult:
    """A run killed after its step-4 checkpoint and resumed ends bit-identical to an uninterrupted one.

    Three short runs of ``config`` (6 steps, a checkpoint every 2, no evaluation until the
    end): one straight; one stopped at step 5, its step-5 checkpoint then deleted, as a kill
    before that save committed would leave it (the run restarts from step 4); and its resume.
    The final states (every array of the step-6 checkpoint) and the metrics lines (timings
    aside) must be equal.
    """
    import json
    import tempfile
    import time
    from pathlib import Path

    import jax

    from leanstep.checkpoints.checkpointer import Checkpointer
    from leanstep.checkpoints.layout import STAGING
    from leanstep.training.loop_state import RunStopped
    from leanstep.training.trainer import train
    from leanstep.verification.trees import first_difference

    started = time.perf_counter()
    compared = f"killed after step 4 of {RESUME_STEPS} and resumed vs straight"
    with tempfile.TemporaryDirectory() as folder:
        base = dataclasses.replace(
            config,
            steps=RESUME_STEPS,
            time_budget=None,
            checkpoint_every=2,
            eval_every=RESUME_STEPS,
            eval_batches=1,
            progress=False,
            stop_at=None,
            out=str(Path(folder) / "straight"),
        )
        killed = dataclasses.replace(base, out=str(Path(folder) / "killed"))
        train(base)
        try:
            train(dataclasses.replace(killed, stop_at=RESUME_STEPS - 1))
        except RunStopped:
            pass
        checkpoints = Path(killed.out) / "checkpoints"  # step 5 back to staging: written, never committed
        (checkpoints / STAGING).mkdir(exist_ok=True)
        os.rename(checkpoints / str(RESUME_STEPS - 1), checkpoints / STAGING / str(RESUME_STEPS - 1))
        train(killed, resume=True)
        template = build_run(base).init_state()
        states = []
        for out in (base.out, killed.out):
            with Checkpointer(Path(out) / "checkpoints") as checkpointer:
                states.append(jax.device_get(checkpointer.restore(template, step=RESUME_STEPS).state))
        timing = ("tokens_per_sec", "elapsed_s", "step_s", "seconds")

        def lines(out: str) -> list[dict[str, Any]]:
            text = (Path(out) / "metrics.jsonl").read_text().splitlines()
            return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in text]

        found = first_difference(states[1], states[0])
        metrics_equal = lines(base.out) == lines(killed.out)
    elapsed = time.perf_counter() - started
    if found is None and metrics_equal:
        return CheckResult("resume", "pass", compared, 0.0, 0.0, "bit for bit", seconds=elapsed)
    where = f"state/{found[0]}[{found[1]}]" if found is not None else "metrics.jsonl"
    diagnosis = "the resumed run is not the uninterrupted run: state or data position not restored exactly"
    return CheckResult("resume", "fail", compared, float("inf"), 0.0, "bit for bit", where, diagnosis, seconds=elapsed)
