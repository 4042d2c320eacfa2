"""Rich tables of a benchmark result, for the terminal."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

__all__ = ["render_benchmark"]

_MIB = 2.0**20
_GIB = 2.0**30
_NA = "n/a"  # a figure that is not defined (no peak, 0 temps over 0, a row that outran its probe)


def _fmt(value: Any, spec: str) -> str:
    return _NA if value is None else format(value, spec)


def _on_accelerator(result: dict[str, Any]) -> bool:
    return bool((result.get("platform") or {}).get("accelerator"))


def _add_row(table: Table, *cells: str) -> None:
    """Cells as plain Text: a policy or path with ``[...]`` in it is data, not rich markup."""
    table.add_row(*(Text(cell) for cell in cells))


def _percent(value: float | None) -> str:
    return _NA if value is None else f"{value:.1%}"


def _row_name(row: dict[str, Any]) -> str:
    impl = row["impl"] + (f" ({row['variant']})" if row["variant"] else "")
    return f"{impl} {row['precision']} mb {row['num_microbatches']} remat {row['remat']}"


def _rows_table(result: dict[str, Any]) -> Table:
    accelerator = _on_accelerator(result)
    if accelerator:
        title = (
            f"train step on {result['platform']['device_kind']}: time, XLA compiled memory, model FLOPs "
            "utilization (MFU: against the chip's dense bf16 peak, or the measured bf16 matmul where the "
            "chip is not in the table, see the summary)"
        )
    else:
        title = (
            "train step: time, XLA compiled memory, model FLOPs utilization (MFU: against the best-of-N "
            "matmul peak of the row's backend, XLA or torch, in its compute dtype; n/a where the row outruns "
            "that probe, see the notes; CPU peak: against the theoretical float32 peak)"
        )
    table = Table(title=title, title_justify="left")
    columns = (
        ("impl", "left"),
        ("compute", "left"),
        ("mb", "right"),
        ("remat", "left"),
        ("median ms", "right"),
        ("min ms", "right"),
        ("max ms", "right"),
        ("n", "right"),
        ("temp MiB", "right"),
        ("args MiB", "right"),
        ("out MiB", "right"),
        ("GFLOP/s", "right"),
        ("MFU", "right"),
        ("of CPU peak", "right"),
    )
    for name, justify in columns[:-1] if accelerator else columns:  # no CPU figure for a chip's step
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in result["rows"]:
        impl = row["impl"] + (f" ({row['variant']})" if row["variant"] else "")
        mib = {
            key: None if row[key] is None else row[key] / _MIB
            for key in ("temp_bytes", "argument_bytes", "output_bytes")
        }
        cells = [
            impl, row["precision"], str(row["num_microbatches"]), row["remat"],
            _fmt(row["step_ms_median"], ".4g"), _fmt(row["step_ms_min"], ".4g"), _fmt(row["step_ms_max"], ".4g"),
            str(row["repeats"]), _fmt(mib["temp_bytes"], ".2f"), _fmt(mib["argument_bytes"], ".2f"),
            _fmt(mib["output_bytes"], ".2f"), _fmt(row["achieved_gflops"], ".3g"), _percent(row["mfu"]),
        ]  # fmt: skip
        _add_row(table, *cells, *([] if accelerator else [_percent(row.get("cpu_peak_fraction"))]))
    return table


def _summary_table(result: dict[str, Any]) -> Table:
    table = Table(title="ratios, the limit, checks", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for key, value in result["ratios"].items():
        _add_row(table, key, _fmt(value, ".3f"))
    for key, value in result["peak_gflops"].items():
        measured = result["matmul"].get(key) or {}
        what = (
            (
                f" (best of {measured['repeats']}, {measured['size']}x{measured['size']} matmul; median "
                f"{measured['gflops_median']:.4g})"
            )
            if "gflops_median" in measured
            else ""
        )
        _add_row(table, f"peak GFLOP/s {key}{what}", _fmt(value, ".4g"))
    cpu = result.get("cpu_peak")
    if cpu is not None:
        if cpu["gflops"] is None:
            _add_row(table, f"theoretical float32 CPU peak GFLOP/s ({cpu['reason']})", "-")
        else:
            _add_row(
                table,
                f"theoretical float32 CPU peak GFLOP/s ({cpu['cores']:g} cores x {cpu['ghz']:.3g} GHz "
                f"[{cpu['clock_source']}] x {cpu['float32_lanes']} lanes x 2 x {cpu['fma_units']} FMA units "
                "[assumed])",
                _fmt(cpu["gflops"], ".4g"),
            )
    if _on_accelerator(result):
        _add_chip_rows(table, result["platform"])
    mfu = result["mfu"]
    if "leanstep_mfu" in mfu:
        against = mfu["leanstep_mfu_against"]
        against = "the chip's peak" if against == "chip" else against
        _add_row(table, f"MFU leanstep bf16 step (against {against})", _percent(mfu["leanstep_mfu"]))
        if not _on_accelerator(result):
            _add_row(
                table,
                "leanstep bf16 step, fraction of the CPU's float32 peak",
                _percent(mfu["leanstep_cpu_peak_fraction"]),
            )
    for key, value in result["checks"].items():
        _add_row(table, key, _fmt(value, ".6g"))
    return table


def _add_chip_rows(table: Table, platform: dict[str, Any]) -> None:
    """The chip's peak (vendor figure), the measured bf16 matmul's fraction of it, the device's memory."""
    kind = platform["device_kind"]
    known = "dense bf16, vendor figure" if platform["peak_gflops"] else "not in leanstep.bench.CHIP_PEAKS"
    _add_row(table, f"chip peak GFLOP/s ({kind}, {known})", _fmt(platform["peak_gflops"], ".6g"))
    _add_row(
        table,
        "xla bf16 matmul, fraction of the chip's peak",
        _percent(platform["xla_bfloat16_matmul_fraction_of_peak"]),
    )
    memory = platform.get("device_memory") or {}
    if memory.get("peak_bytes_in_use") is not None and memory.get("bytes_limit"):
        _add_row(
            table,
            "device memory, peak in use / limit (GiB)",
            f"{memory['peak_bytes_in_use'] / _GIB:.2f} / {memory['bytes_limit'] / _GIB:.2f}",
        )


def render_benchmark(result: dict[str, Any]) -> Group:
    """The rows table, the summary table and the notes, as one renderable for ``rich``.

    Example:
      >>> import io
      >>> from rich.console import Console
      >>> row = {"impl": "leanstep", "variant": None, "precision": "float32", "num_microbatches": 1,
      ...        "remat": "none", "step_ms_median": 2.0, "step_ms_min": 1.0, "step_ms_max": 3.0,
      ...        "repeats": 3, "temp_bytes": 2**20, "argument_bytes": 0, "output_bytes": 0,
      ...        "achieved_gflops": 1.0, "mfu": 0.5, "mfu_against": "xla_float32"}
      >>> result = {"rows": [row], "ratios": {}, "peak_gflops": {}, "matmul": {}, "mfu": {},
      ...           "checks": {}, "notes": [], "machine": {"cpu_model": "cpu", "cores_available": 2}}
      >>> console = Console(width=160, record=True, file=io.StringIO())
      >>> console.print(render_benchmark(result))
      >>> "50.0%" in console.export_text()
      True
      >>> fast = {**row, "achieved_gflops": 4.5, "mfu": None, "mfu_note": "peak meaningless: ..."}
      >>> console.print(render_benchmark({**result, "rows": [fast]}))
      >>> "note: leanstep float32 mb 1 remat none: peak meaningless" in console.export_text()
      True
    """
    machine = result["machine"]
    line = f"{machine['cpu_model']}, {machine['cores_available']} cores available"
    if _on_accelerator(result):
        platform = result["platform"]
        line = (
            f"{platform['device_kind']} ({platform['backend']}; {platform['device_count']} device(s), "
            f"the step runs on one); host: {line}"
        )
    header = Text(line, style="bold")
    notes = [Text(f"note: {note}", style="dim") for note in result["notes"]]
    notes += [
        Text(f"note: {_row_name(row)}: {row[key]}", style="dim")
        for row in result["rows"]
        for key in ("mfu_note", "cpu_peak_note")
        if row.get(key)
    ]
    return Group(header, _rows_table(result), _summary_table(result), *notes)
