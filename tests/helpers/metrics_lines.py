"""Helpers for the metrics tests: ``metrics.jsonl`` lines as the trainer writes them, and runs."""

from __future__ import annotations

import json
import math
import pathlib
import struct

from leanstep.training.metrics_log import RunMetrics, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def train_line(step: int, loss: float = 2.0, **overrides: object) -> dict:
    line = dict(
        kind="train",
        step=step,
        loss=loss,
        grad_norm=0.5,
        loss_scale=2.0**15,
        skipped=False,
        clipped=False,
        consecutive_skips=0,
        tokens_per_sec=1000.0,
        elapsed_s=float(step),
        lr=1e-3,
    )
    line.update(overrides)
    return line


def eval_line(step: int, loss: float) -> dict:
    bits = loss / math.log(2)
    return dict(kind="eval", step=step, heldout_loss=loss, heldout_bits_per_byte=bits)


def write(path: pathlib.Path, lines: list[dict | str], tail: str = "\n") -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines)
    path.write_text(text + tail, encoding="utf-8")
    return path


def png_size(path: pathlib.Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def hand_run(tmp_path: pathlib.Path) -> RunMetrics:
    nan, inf = float("nan"), float("inf")
    rows = [  # step, loss, skipped, clipped, consecutive_skips, tokens/sec, elapsed, scale
        (1, 5.0, False, True, 0, 10.0, 30.0, 65536.0),
        (2, inf, True, False, 1, 100.0, 31.0, 32768.0),
        (3, nan, True, False, 2, 110.0, 32.0, 16384.0),
        (4, 3.0, False, True, 0, 120.0, 33.0, 16384.0),
        (5, 2.0, False, False, 0, 130.0, 34.0, 16384.0),
        (6, 1.5, False, True, 0, nan, 35.0, 16384.0),
    ]
    lines = [
        train_line(s, loss=lo, skipped=sk, clipped=c, consecutive_skips=k, tokens_per_sec=t, elapsed_s=e, loss_scale=ls)
        for s, lo, sk, c, k, t, e, ls in rows
    ]
    lines += [eval_line(2, 4.0), eval_line(4, 2.5), eval_line(6, 2.75)]
    # Resumed from step 4: step 5 recompiles (20 tok/s) and logs a new loss.
    lines += [
        train_line(5, loss=2.5, tokens_per_sec=20.0, elapsed_s=40.0, clipped=True),
        train_line(6, loss=1.0, tokens_per_sec=140.0, elapsed_s=41.0, lr=5e-4),
        eval_line(6, 2.25),
        '{"kind": "eval", "st',
    ]
    return read_metrics(write(tmp_path / "hand" / "metrics.jsonl", lines, tail=""))


def realistic_lines(steps: int = 300) -> list[dict]:
    lines = []
    for s in range(1, steps + 1):
        skipped = s <= 2 or s % 97 == 0
        loss = 1.2 + 4.3 * math.exp(-s / 60) + 0.05 * math.sin(s)
        grad = math.inf if skipped else 0.4 + 3 * math.exp(-s / 40) + (5 if s % 31 == 0 else 0)
        lines.append(
            train_line(
                s,
                loss=math.nan if s <= 2 else loss,
                grad_norm=grad,
                skipped=skipped,
                clipped=not skipped and grad > 1.0,
                loss_scale=2.0 ** (15 - (s <= 2) - (s > 97) - (s > 194)),
                tokens_per_sec=50.0 if s == 1 else 5e4 + 100 * math.cos(s),
            )
        )
        if s % 50 == 0:
            lines.append(eval_line(s, 1.25 + 4.2 * math.exp(-s / 60)))
    return lines
