"""A whole training run: data, model, step, metrics, checkpoints, exact resume.

The CLI (``leanstep train``) parses flags into a :class:`RunConfig` and calls
:func:`train`; everything a run does lives here, none of its numerics (those are
the building blocks and :func:`leanstep.make_train_step`).

What a run does when something goes wrong::

    bad flag, data path or run directory   ValueError naming the flag, before anything is written
    non-finite gradient                     the step skips it (params, optimizer state unchanged)
                                            and the record says "skipped": true
    skipped at the minimum loss scale       RunStopped(1) after --max-consecutive-skips such steps
                                            in a row; such steps are never checkpointed, so the
                                            last good checkpoint is never pruned
    SIGINT / SIGTERM                        finish the step, save, RunStopped(128 + signal)
    SIGKILL, power loss                     --resume restores the newest verified checkpoint, drops
                                            the metrics past it and replays them bit for bit
    damaged newest checkpoint               --resume falls back to an older one, with a warning
    no good checkpoint                      RunStopped(1) naming each checkpoint's fault
    a checkpoint or metrics write fails     RunStopped(1); the checkpoints before it are intact
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from leanstep.checkpoint import CheckpointError, Checkpointer
from leanstep.data import BatchSampler, heldout_batches, load_corpus
from leanstep.distributed import device_mesh
from leanstep.loss_scale import get_loss_scale
from leanstep.models import build_model
from leanstep.precision import get_precision
from leanstep.remat import get_remat_policy
from leanstep.sharding import shard_batch, shard_train_state
from leanstep.step import TrainState, make_train_step

__all__ = ["RunConfig", "RunStopped", "train", "build_optimizer"]

SCHEDULES = ("constant", "cosine", "warmup-cosine")

# Fields that may change between a run and its resumption; every other field must match.
# (Changing ``steps`` changes the learning-rate schedule, so such a run is an extension, not a replay.)
_RESUMABLE_FIELDS = frozenset({"steps", "stop_at", "eval_every", "checkpoint_every", "keep_checkpoints", "out",
                               "max_consecutive_skips", "progress", "devices", "fsdp"})
# (``devices`` and ``fsdp`` only lay the same state out differently: a checkpoint restores into
# whatever layout the resumed run asks for.)
_MODEL_FLAGS = (("--d-model", "d_model"), ("--layers", "n_layers"), ("--heads", "n_heads"), ("--d-ff", "d_ff"))
_UNFINISHED_SAVE = ".orbax-checkpoint-tmp"  # orbax's suffix for a step directory still being written


def _is_number(value: Any, minimum: float, *, strict: bool) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and (value > minimum if strict else value >= minimum))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run; written to ``config.json``. Field names follow the CLI flags."""

    model: str = "transformer"
    size: str = "small"
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    d_ff: int | None = None
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    microbatches: int = 2
    precision: str = "params=float32,compute=bfloat16,output=float32"
    loss_scale: str = "dynamic"
    initial_loss_scale: float = 2.0**15
    remat: str = "dots"
    max_grad_norm: float | None = 1.0
    lr: float = 3e-3
    schedule: str = "warmup-cosine"
    warmup_steps: int = 30
    weight_decay: float = 0.01
    seed: int = 0
    data: str | None = None
    eval_every: int = 50
    eval_batches: int = 8
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    max_consecutive_skips: int = 100
    out: str = "runs/train"
    stop_at: int | None = None
    progress: bool = True
    devices: int | None = None
    fsdp: bool = False

    def validate(self) -> "RunConfig":
        """Checks every field, naming its flag; returns self. Raises ValueError."""
        def positive_int(name: str, value: Any, minimum: int = 1) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {minimum}, got {value!r}")

        for name in ("steps", "batch_size", "seq_len", "microbatches", "eval_every", "eval_batches",
                     "checkpoint_every", "keep_checkpoints", "max_consecutive_skips"):
            positive_int(name, getattr(self, name))
        positive_int("warmup_steps", self.warmup_steps, 0)
        positive_int("seed", self.seed, 0)
        for name in ("d_model", "n_layers", "n_heads", "d_ff", "stop_at", "devices"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.batch_size % self.microbatches:
            raise ValueError(
                f"--batch-size {self.batch_size} is not divisible by --microbatches {self.microbatches}"
            )
        if self.devices is not None and self.batch_size % (self.microbatches * self.devices):
            raise ValueError(f"--batch-size {self.batch_size} is not divisible by --microbatches "
                             f"{self.microbatches} times --devices {self.devices}")
        for name in ("lr", "initial_loss_scale"):
            if not _is_number(getattr(self, name), 0, strict=True):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive finite number, got {getattr(self, name)!r}")
        if not _is_number(self.weight_decay, 0, strict=False):
            raise ValueError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay!r}")
        if self.max_grad_norm is not None and not _is_number(self.max_grad_norm, 0, strict=True):
            raise ValueError(f"--max-grad-norm must be a positive finite number or 'none', got {self.max_grad_norm!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        for flag, value in (("--out", self.out), ("--data", self.data)):
            if not (isinstance(value, str) and value.strip()) and not (flag == "--data" and value is None):
                raise ValueError(f"{flag} must be a non-empty path, got {value!r}")
        for flag, parse, value in (("--precision", get_precision, self.precision),
                                   ("--remat", get_remat_policy, self.remat)):
            try:
                parse(value)
            except (TypeError, ValueError) as error:
                raise ValueError(f"{flag}: {error}") from None
        try:
            get_loss_scale(self.loss_scale, None if self.loss_scale == "none" else self.initial_loss_scale)
        except (TypeError, ValueError) as error:
            raise ValueError(f"--loss-scale: {error}") from None
        try:  # cheap: builds the config dataclass only, no arrays
            build_model(self.model, self.size, **_model_overrides(self))
        except (TypeError, ValueError) as error:
            flags = "".join(f" {flag} {getattr(self, name)}" for flag, name in _MODEL_FLAGS
                            if getattr(self, name) is not None)
            raise ValueError(f"--model {self.model} --size {self.size}{flags}: {error}") from None
        return self

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def mismatches(self, saved: dict[str, Any]) -> list[str]:
        """The fields (other than resumable ones) whose value differs from a saved config."""
        mine = self.to_json()
        return sorted(k for k in mine if k not in _RESUMABLE_FIELDS and saved.get(k, mine[k]) != mine[k]
                      or k not in _RESUMABLE_FIELDS and k not in saved)


class RunStopped(RuntimeError):
    """The run stopped before its last step; the message says why and how to continue."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def build_optimizer(config: RunConfig) -> tuple[optax.GradientTransformation, Callable[[int], float]]:
    """AdamW under the configured learning-rate schedule; returns it and the schedule."""
    if config.schedule == "constant":
        schedule = optax.constant_schedule(config.lr)
    elif config.schedule == "cosine":
        schedule = optax.cosine_decay_schedule(config.lr, config.steps, alpha=0.1)
    else:
        warmup = min(config.warmup_steps, max(config.steps - 1, 0))
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, config.lr, warmup, max(config.steps, warmup + 1), end_value=0.1 * config.lr
        )
    return optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay), schedule


def _model_overrides(config: RunConfig) -> dict[str, int]:
    overrides = {name: getattr(config, name) for _, name in _MODEL_FLAGS if getattr(config, name) is not None}
    if config.model == "mlp":
        overrides.pop("n_heads", None)
        if "d_ff" in overrides:
            overrides["d_hidden"] = overrides.pop("d_ff")
    overrides["seq_len"] = config.seq_len
    return overrides


def _write_json_atomic(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drops the lines a killed run wrote past its last checkpoint, so the log matches the state."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the kill
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _check_out(out: Path) -> None:
    """``--out`` must be a directory, or creatable as one, whose run files are files."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a directory")
    ancestor = out
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"--out {str(out)!r} cannot be created: {str(ancestor)!r} is not a directory")
    if not os.access(ancestor, os.W_OK):
        raise ValueError(f"--out {str(out)!r} cannot be created: {str(ancestor)!r} is not writable")
    for name in ("config.json", "metrics.jsonl"):
        if (out / name).exists() and not (out / name).is_file():
            raise ValueError(f"--out {str(out)!r} holds {name} that is not a regular file")


def _saved_run(config: RunConfig, config_path: Path) -> dict[str, Any]:
    """The ``config.json`` of the run to resume; raises ValueError unless it is this config's run."""
    out = str(config_path.parent)
    if not config_path.exists():
        raise ValueError(f"--resume: {out!r} holds no run (no config.json); start it without --resume")
    try:
        saved = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"--resume: {str(config_path)!r} is not readable JSON ({error}); expected the "
                         "config.json that leanstep train writes") from None
    run = saved.get("run", saved) if isinstance(saved, dict) else None
    if not isinstance(run, dict):
        raise ValueError(f"--resume: {str(config_path)!r} holds {type(saved).__name__}; expected the JSON "
                         "object that leanstep train writes")
    different = config.mismatches(run)
    if different:
        details = ", ".join(f"{k}={run.get(k)!r} (now {getattr(config, k)!r})" for k in different)
        raise ValueError(f"--resume: {out!r} belongs to a different config: {details}")
    return saved


def _remove_unfinished_saves(directory: Path) -> list[str]:
    """Deletes the temporary directories of checkpoint writes a killed run left behind."""
    if not directory.is_dir():
        return []
    unfinished = sorted(p for p in directory.iterdir() if _UNFINISHED_SAVE in p.name)
    for path in unfinished:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return [f"removed an unfinished checkpoint write: {p.name}" for p in unfinished]


class _StopSignals:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each step."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_StopSignals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # a second signal: stop at once
            raise KeyboardInterrupt
        self.received = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _MetricsLog:
    """Appends records to ``metrics.jsonl``: one write and flush per step, so a kill cuts at most one line."""

    def __init__(self, path: Path, describe_checkpoint: Callable[[], str]) -> None:
        self._path, self._describe = path, describe_checkpoint
        self._file: Any = None

    def _failed(self, error: OSError) -> RunStopped:
        return RunStopped(f"cannot write {self._path}: {error}; {self._describe()}", 1)

    def __enter__(self) -> "_MetricsLog":
        try:
            self._file = self._path.open("a")
        except OSError as error:
            raise self._failed(error) from None
        return self

    def write(self, *records: dict[str, Any]) -> None:
        try:
            self._file.write("".join(json.dumps(r) + "\n" for r in records))
            self._file.flush()
        except OSError as error:
            raise self._failed(error) from None

    def __exit__(self, *exc: Any) -> None:
        with contextlib.suppress(OSError):  # a failed write was reported already
            self._file.close()


def train(config: RunConfig, *, resume: bool = False, console: Any = None) -> dict[str, Any]:
    """Runs (or resumes) a training run described by ``config`` and returns its summary.

    Args:
      config: the run; checked with :meth:`RunConfig.validate` first.
      resume: continue the run in ``config.out`` from its newest intact checkpoint.
      console: a ``rich`` console for warnings, progress and the summary table; None: warnings and
        progress go to standard error and the summary is not printed.

    Returns:
      The summary written to ``summary.json``, plus ``"curves"``: the path of ``curves.png``.

    Raises:
      ValueError: bad configuration or data, or a run directory that does not fit.
      RunStopped: stopped by a signal (after saving a checkpoint), by a loss scale stuck at its
        minimum, by a failed write, or because no checkpoint to resume from is intact.
    """
    from rich.console import Console
    from rich.text import Text

    from leanstep.cli.progress import TrainProgress  # rich lives in the CLI layer

    config.validate()
    out = Path(config.out)
    _check_out(out)
    config_path, metrics_path, ckpt_dir = out / "config.json", out / "metrics.jsonl", out / "checkpoints"
    saved = _saved_run(config, config_path) if resume else None
    if not resume and any(p.exists() for p in (config_path, metrics_path, ckpt_dir)):
        raise ValueError(f"--out {str(out)!r} already holds a run; pass --resume to continue it or choose another --out")

    corpus = load_corpus(config.data, seq_len=config.seq_len)
    described = corpus.describe()
    saved_corpus = (saved or {}).get("corpus")
    saved_sha = saved_corpus.get("data_sha256") if isinstance(saved_corpus, dict) else None
    if saved_sha not in (None, described["data_sha256"]):
        raise ValueError(f"--resume: the data behind --data {config.data!r} changed since the run started "
                         f"(sha256 {saved_sha[:12]}… then, {described['data_sha256'][:12]}… now); "
                         "resuming would not replay the run")
    # --devices (or a multi-process run) shards the step over a mesh; without it, one device, as before.
    mesh = device_mesh(config.devices) if config.devices is not None or jax.process_count() > 1 else None
    if mesh is not None and config.batch_size % (config.microbatches * mesh.size):
        raise ValueError(f"--batch-size {config.batch_size} is not divisible by --microbatches {config.microbatches} "
                         f"times the {mesh.size} devices of the run's {jax.process_count()} process(es)")
    if config.fsdp and mesh is None:
        raise ValueError("--fsdp shards the state over devices; add --devices N")
    primary = jax.process_index() == 0  # one process writes config, metrics and summary
    many = jax.process_count() > 1
    model = build_model(config.model, config.size, **_model_overrides(config))
    policy = get_precision(config.precision)
    optimizer, schedule = build_optimizer(config)
    scale = None if config.loss_scale == "none" else config.initial_loss_scale
    template = TrainState.create(model.init(jax.random.key(config.seed)), optimizer,
                                 loss_scale=get_loss_scale(config.loss_scale, scale), seed=config.seed)
    if mesh is not None:  # the checkpoint restores into these shardings, whatever it was saved from
        template = shard_train_state(template, mesh, fsdp=config.fsdp)
    run_info = {"run": config.to_json(), "corpus": described, "model_config": dataclasses.asdict(model.config),
                "parameters": int(sum(x.size for x in jax.tree.leaves(template.params))),
                "flops_per_token": model.flops_per_token, "jax_version": jax.__version__,
                "backend": jax.default_backend(), "max_grad_norm": config.max_grad_norm,
                "devices": 1 if mesh is None else mesh.size, "processes": jax.process_count()}
    if many:  # every process has checked --out before process 0 writes to it
        multihost_utils.sync_global_devices("leanstep: run directory checked")
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not resume and primary:  # before the first checkpoint, so that a run killed from here on can be resumed
            _write_json_atomic(config_path, run_info)
        notes = _remove_unfinished_saves(ckpt_dir) if resume and primary else []
        if many:  # ... and cleaned it up before any process opens the checkpoints
            multihost_utils.sync_global_devices("leanstep: run directory ready")
        checkpointer = Checkpointer(ckpt_dir, max_to_keep=config.keep_checkpoints)
    except (OSError, CheckpointError) as error:
        raise RunStopped(f"cannot write the run directory --out {str(out)!r}: {error}", 1) from None

    show_summary, console = console is not None, console if console is not None else Console(stderr=True)
    eval_data = heldout_batches(corpus.heldout, config.batch_size, config.seq_len, config.eval_batches)
    loop = _Loop(config, checkpointer, metrics_path if primary else None,
                 make_train_step(lambda p, b: model.loss(p, b, remat_policy=config.remat), optimizer,
                                 precision=policy, num_microbatches=config.microbatches,
                                 max_grad_norm=config.max_grad_norm, mesh=mesh, fsdp=config.fsdp),
                 # A replicated result: one scalar every process can read.
                 jax.jit(lambda params, batch: model.loss(policy.cast_to_compute(params), batch),
                         out_shardings=None if mesh is None else NamedSharding(mesh, PartitionSpec())),
                 BatchSampler(corpus.train, config.batch_size, config.seq_len, config.seed),
                 eval_data if mesh is None else [_place_eval_batch(b, mesh) for b in eval_data], schedule, mesh)
    try:
        state, elapsed_before = template, 0.0
        if resume and checkpointer.latest_step() is not None:
            state, elapsed_before = _restore(checkpointer, template, config, notes)
        if resume and primary:
            try:
                _truncate_metrics(metrics_path, int(state.step))
                _write_json_atomic(config_path, run_info)  # a resumable field may have changed
            except OSError as error:
                raise RunStopped(f"cannot write the run directory --out {str(out)!r}: {error}", 1) from None
        for note in notes:
            console.print(Text(note, style="yellow"), soft_wrap=True)
        with TrainProgress(config.steps, int(state.step), enabled=config.progress and primary,
                           console=console) as progress:
            _run_steps(loop, state, elapsed_before, progress)
    except BaseException:
        with contextlib.suppress(CheckpointError):  # report the first failure, not a follow-on one
            checkpointer.close()
        raise
    checkpointer.close()
    if not primary:
        return {"process_index": jax.process_index(), "curves": str(out / "curves.png")}  # process 0 draws it
    from leanstep.report import plot_curves, read_metrics, render_summary, summarize  # matplotlib: only now

    metrics_record = read_metrics(metrics_path)
    plot_curves(metrics_record, out / "curves.png", max_grad_norm=config.max_grad_norm)
    summary = summarize(metrics_record, run_info)
    summary["curves"] = str(out / "curves.png")
    if show_summary:
        console.print(render_summary(summary))
    _write_json_atomic(out / "summary.json", summary)
    return summary


def _restore(checkpointer: Checkpointer, template: TrainState, config: RunConfig,
             notes: list[str]) -> tuple[TrainState, float]:
    """The newest intact checkpoint that belongs to this config; notes say what was passed over."""
    try:
        restored = checkpointer.restore(template)
    except CheckpointError as error:
        raise RunStopped(f"--resume: no checkpoint of the run can be restored, so it cannot continue: {error}. "
                         f"Start again with a new --out (or move {checkpointer.directory} away)", 1) from None
    notes.extend(f"warning: skipped damaged checkpoint {reason}" for reason in restored.skipped)
    if restored.skipped:
        notes.append(f"warning: resuming from step {restored.step}, the newest intact checkpoint")
    if restored.extra.get("config_sha256", _config_hash(config)) != _config_hash(config):
        raise ValueError(f"--resume: checkpoint step {restored.step} in {checkpointer.directory} was written by "
                         "a different config than this one")
    if restored.step > config.steps:
        raise ValueError(f"--steps {config.steps} is below step {restored.step}, which the run has reached; "
                         f"pass --steps {restored.step} or more")
    checkpointer.delete_newer_than(restored.step)
    return restored.state, float(restored.extra.get("elapsed_s", 0.0))


@dataclasses.dataclass(frozen=True)
class _Loop:
    """What the step loop works with; built by :func:`train`."""

    config: RunConfig
    checkpointer: Checkpointer
    metrics_path: Path
    step_fn: Callable[[TrainState, Any], tuple[TrainState, Any]]
    eval_fn: Callable[[Any, Any], jax.Array]
    sampler: BatchSampler
    eval_data: list[Any]
    schedule: Callable[[int], float]
    mesh: Mesh | None = None  # shard each batch over it (None: one device, unsharded)


def _run_steps(loop: _Loop, state: TrainState, elapsed_before: float, progress: Any) -> None:
    """Steps from ``state`` to ``config.steps``, logging every step and checkpointing as configured."""
    config, checkpointer, out = loop.config, loop.checkpointer, Path(loop.config.out)
    last_saved = int(state.step)
    # A static or absent loss scale cannot back off, so it is always at its minimum.
    minimum = getattr(state.loss_scale, "min_loss_scale", math.inf)
    skips_at_minimum = 0  # skipped steps in a row at the minimum loss scale: lowering it cannot help

    def where_saved() -> str:
        return (f"the last checkpoint (step {last_saved}) is intact in {checkpointer.directory}"
                if last_saved else "no checkpoint was written yet")

    def save(state: TrainState, elapsed: float) -> None:
        step = int(state.step)
        try:
            checkpointer.save(step, state, extra={"data_position": step, "elapsed_s": elapsed,
                                                  "config_sha256": _config_hash(config)})
        except CheckpointError as error:
            raise RunStopped(f"stopped at step {step}: its checkpoint could not be written ({error}); "
                             f"{where_saved()}. Free space or fix the directory, then continue with "
                             f"--resume --out {out}", 1) from None

    tokens_per_step = config.batch_size * config.seq_len
    applied_updates = _applied_updates(state.opt_state)
    t_start = time.perf_counter()
    many = jax.process_count() > 1
    with (_MetricsLog(loop.metrics_path, where_saved) if loop.metrics_path else _NoLog()) as log, \
            _StopSignals() as stop:
        while int(state.step) < config.steps:
            t0 = time.perf_counter()
            batch = loop.sampler.batch_at(int(state.step))
            state, metrics = loop.step_fn(state, batch if loop.mesh is None else shard_batch(batch, loop.mesh))
            metrics = jax.device_get(metrics)
            dt = time.perf_counter() - t0
            step = int(state.step)
            record = {"kind": "train", "step": step, "loss": float(metrics.loss),
                      "grad_norm": float(metrics.grad_norm), "loss_scale": float(metrics.loss_scale),
                      "skipped": bool(metrics.skipped), "clipped": bool(metrics.clipped),
                      "consecutive_skips": int(metrics.consecutive_skips),
                      "tokens_per_sec": tokens_per_step / dt,
                      "elapsed_s": elapsed_before + time.perf_counter() - t_start,
                      "lr": float(loop.schedule(applied_updates))}
            applied_updates += not record["skipped"]
            eval_record = None
            if step % config.eval_every == 0 or step == config.steps:
                heldout = float(np.mean([float(loop.eval_fn(state.params, batch)) for batch in loop.eval_data]))
                eval_record = {"kind": "eval", "step": step, "heldout_loss": heldout,
                               "heldout_bits_per_byte": heldout / math.log(2)}
            log.write(record, *([eval_record] if eval_record else []))
            progress.update(step, record, eval_record)
            at_minimum = record["skipped"] and record["loss_scale"] <= minimum
            skips_at_minimum = skips_at_minimum + 1 if at_minimum else 0
            if skips_at_minimum >= config.max_consecutive_skips:
                raise RunStopped(
                    f"stopped at step {step}: the loss scale sat at its minimum ({record['loss_scale']:g}) for "
                    f"{skips_at_minimum} skipped steps in a row (non-finite gradients); {where_saved()}. "
                    "Lower --lr, check the data, or raise --max-consecutive-skips.", 1)
            signalled = stop.received  # read once: a signal arriving later is handled after the next step
            if many:  # a signal to any process stops all of them after the same step (saving is collective)
                signalled = int(np.max(multihost_utils.process_allgather(np.int32(signalled or 0)))) or None
            stop_here = config.stop_at is not None and config.stop_at <= step < config.steps
            # A state stuck at the minimum scale is not worth keeping, and saving it could prune a good one.
            if skips_at_minimum == 0 and (step % config.checkpoint_every == 0 or step == config.steps
                                          or signalled or stop_here):
                save(state, record["elapsed_s"])
                last_saved = step
            saved_now = "after saving a checkpoint" if last_saved == step else f"({where_saved()})"
            if stop_here:
                raise RunStopped(f"stopped at step {step} as --stop-at asked, {saved_now}; "
                                 f"continue with --resume --out {out}", 0)
            if signalled:
                raise RunStopped(f"{signal.Signals(signalled).name} received: stopped at step {step} {saved_now}; "
                                 f"continue with --resume --out {out}", 128 + signalled)


class _NoLog:
    """Where a process other than 0 of a multi-process run writes its metrics: nowhere."""

    def __enter__(self) -> "_NoLog":
        return self

    def write(self, *records: dict[str, Any]) -> None:
        pass

    def __exit__(self, *exc: Any) -> None:
        pass


def _place_eval_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> Any:
    """Rows split over the mesh when they divide evenly, else (a short heldout set) replicated."""
    if len(next(iter(batch.values()))) % mesh.size == 0:
        return shard_batch(batch, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    return {k: jax.make_array_from_callback(v.shape, replicated, lambda index, v=v: v[index]) for k, v in batch.items()}


def _applied_updates(opt_state: Any) -> int:
    """The optimizer's update count (it does not advance on skipped steps), which drives the schedule."""
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    return int(counts[0][1]) if counts else 0


def _config_hash(config: RunConfig) -> str:
    identity = {k: v for k, v in config.to_json().items() if k not in _RESUMABLE_FIELDS}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
