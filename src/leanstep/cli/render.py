"""Tables of training results for the terminal (rich): the CLI renders, the library reports.

:func:`render_summary` draws the dict of :func:`leanstep.training.summary.summarize` (and of
``summary.json``) as a two-column table.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

__all__ = ["render_summary"]


_LABELS = {
    "final_train_loss_window": "final train loss: steps averaged",
    "mean_tokens_per_sec": "mean tokens/sec (after compile)",
    "total_time_s": "total time",
    "ended_s": "ended at (summary and chart written)",
    "dropped_lines": "cut-off lines skipped",
    "max_grad_norm": "max_grad_norm (config)",
}


def _format(key: str, value: object) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if key in ("total_time_s", "ended_s"):
            return f"{value:.1f} s"
        if key in ("mean_tokens_per_sec", "final_loss_scale"):
            return f"{value:,.0f}"
        return f"{value:.4g}" if key in ("final_lr", "max_grad_norm") else f"{value:.4f}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def render_summary(summary: dict[str, Any]) -> Table:
    """A two-column :class:`rich.table.Table` of a run summary, for printing.

    Args:
      summary: :func:`leanstep.training.summary.summarize`'s dict (keys in display order);
        ``"run"`` becomes the title, ``None`` shows as a dash.

    Returns:
      The table: one row per key, labels with spaces for underscores. Every cell and the
      title are plain :class:`rich.text.Text`, so a run named ``a[/b]`` prints as it is.

    Example:
      >>> import io
      >>> from rich.console import Console
      >>> console = Console(width=60, record=True, file=io.StringIO())
      >>> summary = {"run": "demo", "steps": 1200, "final_train_loss": 1.23456}
      >>> console.print(render_summary(summary))
      >>> print(console.export_text().strip())
      run demo
      ┏━━━━━━━━━━━━━━━━━━┳━━━━━━━━┓
      ┃ metric           ┃  value ┃
      ┡━━━━━━━━━━━━━━━━━━╇━━━━━━━━┩
      │ steps            │  1,200 │
      │ final train loss │ 1.2346 │
      └──────────────────┴────────┘
    """
    table = Table(title=Text(f"run {summary.get('run', '?')}"))
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if key != "run":
            label = key.replace("_", " ").replace("heldout", "held-out")
            table.add_row(Text(_LABELS.get(key, label)), Text(_format(key, value)))
    return table
