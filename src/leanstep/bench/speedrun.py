r"""``leanstep bench --speedrun``: held-out bits per byte at equal wall-clock, against gzip and xz.

Three contenders compress the same held-out bytes (the files :func:`load_corpus` holds out):

- leanstep: :func:`leanstep.training.train` of the :class:`RunConfig` with ``time_budget``
  seconds and ``steps=None``, so the run sizes itself to the budget after compiling;
- the PyTorch peer (:mod:`leanstep.bench.speedrun_torch`): the same model, bytes, recipe and
  budget, written as a PyTorch user writes it (optional: torch is a benchmark extra);
- ``gzip -9`` and ``xz -9e``, the general-purpose compressors a model of bytes should beat.

A model's held-out bits per byte are its mean next-byte cross-entropy over :math:`\ln 2` (what
``leanstep train`` reports); a compressor's are

.. math:: \text{bpb} = \frac{8 \cdot \text{compressed bytes}}{\text{input bytes}}

During its budget each model is evaluated, as ``leanstep train`` does, on ``eval_batches``
batches of windows spread evenly over the held-out files (:func:`heldout_batches`); once the
budget is spent, each model's final weights are scored again on every window of every held-out
file (``heldout_bits_per_byte_all``), the bytes gzip and xz compress, outside the budget.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import lzma
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from leanstep.bench.torch_step import torch_available
from leanstep.blocks.precision import get_precision
from leanstep.training.config import RunConfig
from leanstep.training.data import heldout_batches, load_corpus
from leanstep.training.machine_size import choose_for_machine

__all__ = ["compression_references", "run_speedrun"]


def _bits_per_byte(compressed: bytes, size: int) -> float:
    return 8.0 * len(compressed) / size


def compression_references(heldout: bytes | np.ndarray) -> dict[str, Any]:
    """Bits per byte of ``gzip -9`` and ``xz -9e`` on ``heldout``: ``8 * compressed / len(heldout)``.

    ``gzip -9`` is :func:`gzip.compress` at level 9 with ``mtime=0`` (the gzip container
    included, as ``gzip -9 -c < file`` writes it; zlib's deflate, within a fraction of a percent
    of GNU gzip's); ``xz -9e`` is :func:`lzma.compress` in the xz container at preset
    ``9 | PRESET_EXTREME`` (liblzma, as the ``xz`` tool).

    Args:
      heldout: the bytes, or a 1-D ``uint8`` array of them (``Corpus.heldout``).

    Returns:
      ``{"bytes": n, "gzip": {...}, "xz": {...}}``, each compressor with ``"command"``,
      ``"compressed_bytes"`` and ``"bits_per_byte"``.

    Raises:
      ValueError: ``heldout`` is empty or an array of another dtype or rank.
      TypeError: ``heldout`` is neither bytes-like nor an array.

    Example:
      >>> refs = compression_references(b"the quick brown fox jumps over the lazy dog. " * 40)
      >>> refs["bytes"], refs["gzip"]["compressed_bytes"], refs["xz"]["compressed_bytes"]
      (1800, 80, 124)
      >>> refs["gzip"]["bits_per_byte"], round(refs["xz"]["bits_per_byte"], 4)  # 8 * 80 / 1800
      (0.35555555555555557, 0.5511)
    """
    if isinstance(heldout, np.ndarray):
        if heldout.ndim != 1 or heldout.dtype != np.uint8:
            raise ValueError(f"heldout must be a 1-D uint8 array; got shape {heldout.shape}, dtype {heldout.dtype}")
        data = heldout.tobytes()
    elif isinstance(heldout, (bytes, bytearray, memoryview)):
        data = bytes(heldout)
    else:
        raise TypeError(f"heldout must be bytes or a uint8 array; got {type(heldout).__name__}")
    if not data:
        raise ValueError("heldout is empty: there is nothing to compress")
    gzipped = gzip.compress(data, compresslevel=9, mtime=0)
    xzipped = lzma.compress(data, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)
    return {
        "bytes": len(data),
        "gzip": {
            "command": "gzip -9",
            "library": f"zlib {zlib.ZLIB_RUNTIME_VERSION}",
            "compressed_bytes": len(gzipped),
            "bits_per_byte": _bits_per_byte(gzipped, len(data)),
        },
        "xz": {
            "command": "xz -9e",
            "library": "liblzma",
            "compressed_bytes": len(xzipped),
            "bits_per_byte": _bits_per_byte(xzipped, len(data)),
        },
    }


def _ignore(message: str) -> None:
    del message


def _leanstep_row(summary: dict[str, Any], out: Path, wall_s: float, notes: list[str]) -> dict[str, Any]:
    """The leanstep contender's numbers, from its summary and ``config.json``."""
    info = json.loads((out / "config.json").read_text())
    run, plan = info["run"], info.get("time_budget_plan") or {}
    steps = int(summary["steps"])
    return {
        "contender": "leanstep",
        "heldout_bits_per_byte": summary["final_heldout_bits_per_byte"],
        "heldout_loss": summary["final_heldout_loss"],
        "final_train_loss": summary["final_train_loss"],
        "steps": steps,
        "planned_steps": run["steps"],
        "tokens": steps * run["batch_size"] * run["seq_len"],
        "budget_s": run["time_budget"],
        "wall_s": wall_s,
        "total_time_s": summary["total_time_s"],
        "stopped_at_budget": steps < run["steps"],
        **{key: plan.get(key) for key in ("planned_at_s", "compile_s", "step_s", "step_times_s", "eval_s")},
        # "hit": leanstep's step came from the compilation cache (a second run), "miss": compiled.
        "compile_cache": ((info.get("compile_cache") or {}).get("step") or {}).get("cache"),
        "precision": np.dtype(get_precision(run["precision"]).compute_dtype).name,
        "precision_policy": run["precision"],
        "precision_reason": info.get("precision_reason") or f"--precision {run['precision']}",
        "remat": run["remat"],
        "skipped_steps": summary["skipped_steps"],
        "out": str(out),
        "notes": notes,
    }


#: Why the peer runs eager on a CPU unless asked to compile (measured on the 2-core machine:
#: a cold Inductor compile of the default ``mini`` transformer took 21-40 s for a 3-12% faster
#: step, 96-99 ms against 101-109 ms eager, which does not pay for itself in three minutes).
EAGER_ON_CPU = (
    "eager, as on a CPU torch.compile's cold compile takes tens of seconds of a minutes-long budget "
    "for a few percent (--torch-compile tries it)"
)


def _torch_row(
    config: RunConfig, torch_compile: bool | None, every_window: list[dict[str, np.ndarray]]
) -> dict[str, Any]:
    """The PyTorch peer's numbers (``wall_s`` around the whole call), or why there are none."""
    import torch  # imported before the clock starts, as jax is before leanstep's

    from leanstep.bench import speedrun_torch

    compile_it = torch.cuda.is_available() if torch_compile is None else torch_compile
    initial = _initial_params(config)  # before the peer's clock: leanstep computed them inside its own
    began = time.perf_counter()
    try:
        peer = speedrun_torch.train_torch_peer(config, torch_compile=compile_it, initial_params=initial)
    except ValueError as error:  # the budget left no step after compiling: say so, keep leanstep's numbers
        return {"contender": "pytorch", "skipped": str(error), "wall_s": time.perf_counter() - began}
    wall_s = time.perf_counter() - began
    every = speedrun_torch.torch_heldout_bits_per_byte(
        peer.model, every_window, bfloat16=peer.result.get("precision") == "bfloat16"
    )
    row = {**peer.result, "wall_s": wall_s, "heldout_bits_per_byte_all": every}
    if torch_compile is None and not compile_it:
        row["torch_compile_reason"] = EAGER_ON_CPU
    return row


def _initial_params(config: RunConfig) -> Any:
    """The parameters leanstep's run started from (its ``init_state``), as NumPy arrays."""
    import jax

    from leanstep.training.build import build_run

    return jax.device_get(build_run(config).init_state().params)


def _leanstep_every_window(config: RunConfig, every_window: list[dict[str, np.ndarray]]) -> float:
    """Bits per byte of leanstep's final checkpoint on ``every_window`` (as its run evaluates)."""
    import jax

    from leanstep.checkpoints.checkpointer import Checkpointer
    from leanstep.training.build import build_run
    from leanstep.training.legacy_state import restore_state

    saved = json.loads((Path(config.out) / "config.json").read_text())["run"]
    run = build_run(dataclasses.replace(config, steps=saved["steps"], precision=saved["precision"]))
    with Checkpointer(Path(config.out) / "checkpoints") as checkpointer:
        params = restore_state(checkpointer, run.init_state()).state.params
    loss = jax.jit(lambda p, batch: run.model.loss(run.precision.cast_to_compute(p), batch))
    return float(np.mean([float(loss(params, batch)) for batch in every_window])) / np.log(2)


def _machine() -> dict[str, Any]:
    from leanstep.bench.runner import machine_info

    info = machine_info()
    if torch_available():
        import torch

        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    return info


def run_speedrun(
    budget_s: float,
    *,
    config: RunConfig | None = None,
    out: str | Path = "runs/speedrun",
    data: str | Path | None = None,
    torch_peer: bool = True,
    torch_compile: bool | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """leanstep, then its PyTorch peer, each for ``budget_s`` seconds of wall-clock; then gzip and xz.

    Args:
      budget_s: each contender's budget, in seconds (:func:`leanstep.training.budget.parse_duration`
        reads ``"3m"``).
      config: the run (default: ``RunConfig()``, what ``leanstep train`` runs); its ``steps``,
        ``time_budget``, ``out`` and ``progress`` are replaced.
      out: leanstep's run goes to ``out/leanstep`` (which must not hold a run).
      data: ``--data`` (default: the config's, else the standard library's source).
      torch_peer: run the PyTorch peer (skipped, with a note, when torch is not installed).
      torch_compile: let the peer try ``torch.compile``; None: on a GPU, not on a CPU
        (:data:`EAGER_ON_CPU`).
      log: called with a line of progress now and then.

    Returns:
      A JSON-ready dict: ``"contenders"`` (``"leanstep"``, ``"pytorch"``: held-out bits per byte
      and loss, steps, tokens, ``wall_s`` measured around the call, the budget plan with
      ``compile_s``, precision and its reason, torch.compile and why), ``"references"``
      (:func:`compression_references` of the held-out bytes; ``"windows_bytes"``: the bytes
      the models' every-window score covers), ``"config"``, ``"corpus"`` and ``"machine"``.

    Raises:
      ValueError: an invalid config or budget (naming its flag), a model the peer cannot build,
        an ``out`` that holds a run, or a budget leanstep cannot fit one step into.
      leanstep.training.RunStopped: leanstep's run was stopped (a signal, a failed write).
    """
    from leanstep.training import Note, train

    log = _ignore if log is None else log
    base = RunConfig() if config is None else config
    requested = dataclasses.replace(
        base,
        steps=None,
        time_budget=budget_s,
        out=str(Path(out) / "leanstep"),
        progress=False,
        data=base.data if data is None else str(data),
    )
    config = choose_for_machine(requested).config  # the run train() makes of it: --size and --precision auto resolved
    if torch_peer and config.model != "transformer":
        raise ValueError(f"--model {config.model}: the PyTorch peer is leanstep's transformer only")
    if any((Path(config.out) / name).exists() for name in ("config.json", "metrics.jsonl", "checkpoints")):
        raise ValueError(
            f"--out {str(out)!r} holds a speedrun already (leanstep's run in {config.out!r}); choose another --out"
        )
    notes: list[str] = []

    def on_record(*records: Any) -> None:
        notes.extend(record.message for record in records if isinstance(record, Note))

    corpus = load_corpus(config.data, seq_len=config.seq_len)
    every_window = heldout_batches(corpus.heldout, config.batch_size, config.seq_len)
    log(f"leanstep: training for {budget_s:g} s into {config.out}")
    began = time.perf_counter()
    summary = train(requested, on_record=on_record)  # its config.json says why auto chose so
    contenders = {"leanstep": _leanstep_row(summary, Path(config.out), time.perf_counter() - began, notes)}
    log(f"leanstep: scoring its final weights on all {len(every_window) * config.batch_size:,} held-out windows")
    contenders["leanstep"]["heldout_bits_per_byte_all"] = _leanstep_every_window(config, every_window)
    if not torch_peer:
        contenders["pytorch"] = {"contender": "pytorch", "skipped": "not asked for (torch_peer=False)"}
    elif not torch_available():
        contenders["pytorch"] = {
            "contender": "pytorch",
            "skipped": "torch is not installed; it is the benchmark "
            "extra: pip install torch==2.13.0 (or pip install 'leanstep[bench]')",
        }
    else:
        log(f"pytorch: training for {budget_s:g} s")
        # The peer computes in the dtype leanstep's run chose (``auto`` resolved once, by
        # leanstep), so that the two train the same function at the same precision.
        same_precision = dataclasses.replace(config, precision=contenders["leanstep"]["precision_policy"])
        contenders["pytorch"] = _torch_row(same_precision, torch_compile, every_window)
    log("gzip -9 and xz -9e on the held-out bytes")
    references = compression_references(corpus.heldout)
    references["windows_bytes"] = 1 + config.seq_len * len(every_window) * config.batch_size
    return {
        "budget_s": float(budget_s),
        "contenders": contenders,
        "references": references,
        "config": config.to_json(),
        "corpus": corpus.describe(),
        "machine": _machine(),
        "definitions": {
            "model": "mean held-out next-byte cross-entropy in nats / ln 2",
            "compressor": "8 * compressed bytes / input bytes",
        },
    }
