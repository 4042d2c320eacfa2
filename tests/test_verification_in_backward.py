"""leanstep verify's in_backward row (:mod:`leanstep.verification.in_backward_check`) on the tiny transformer, and
the planted bugs of the update inside the backward pass that must fail it by name.

The controls are :mod:`leanstep.step.layerwise` with one thing wrong, patched in for the test (nothing in the
library can switch one on):

.. code-block:: text

    unclipped_layers   each layer's rows given to the optimizer unclipped (the top's clipped): the layer
                       loop's run_chunk calls get the unscaled gradient, not the clipped one
    rows_reversed      each layer's new rows written into the mirrored row (L - 1 - l): the loop runs from
                       the last layer down and its row index is counted from the wrong end
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import jax
import pytest

import leanstep
from helpers.tiny_runs import TINY_TRANSFORMER
from leanstep.step import layerwise
from leanstep.step.update.chunks import prepare_grads, row_put, run_chunk
from leanstep.training import RunConfig

#: The run the row is checked on: the tiny transformer, its default dynamic loss scale, 4 microbatches.
CONFIG = dict(size="tiny", batch_size=8, seq_len=16, microbatches=4)
FLAGS = (*TINY_TRANSFORMER, "--microbatches", "4")


class _Prepare:
    """The step's ``prepare`` (unscaled and clipped), carrying the unscaled-only one beside it."""

    def __init__(self, loss_scale, norm, max_grad_norm):
        self.clipped = prepare_grads(loss_scale, norm, max_grad_norm)
        self.unclipped = prepare_grads(loss_scale, norm, None)

    def __call__(self, leaves):
        return self.clipped(leaves)


def _layer_unclipped(inputs, owned, rows):
    """The bug: a call for a layer's rows (a row index given) prepares its gradient without the clip."""
    if any(row is not None for row in rows.values()):
        inputs = inputs._replace(prepare=inputs.prepare.unclipped)
    return run_chunk(inputs, owned, rows)


def _mirrored_row(tree, piece, start):
    """The bug: a layer's new rows written at ``L - 1 - start``."""
    return row_put(tree, piece, jax.tree.leaves(tree)[0].shape[0] - 1 - start)


@contextlib.contextmanager
def planted(name: str | None) -> Iterator[None]:
    """The layerwise step traced with the control ``name`` (None: as the library has it)."""
    with contextlib.ExitStack() as stack:
        if name == "unclipped_layers":
            stack.enter_context(mock.patch.object(layerwise, "prepare_grads", _Prepare))
            stack.enter_context(mock.patch.object(layerwise, "run_chunk", _layer_unclipped))
        elif name == "rows_reversed":
            stack.enter_context(mock.patch.object(layerwise, "row_put", _mirrored_row))
        yield


def in_backward(control: str | None = None, **fields) -> leanstep.verification.CheckResult:
    """verify's in_backward row on CONFIG's step (with ``fields``), the layerwise step ``control``'s if one is named."""
    from leanstep.training.verify_run import verify_setup

    config = RunConfig(**{**CONFIG, **fields})
    with planted(control):
        report = leanstep.verification.verify_step(
            verify_setup(config), num_microbatches=config.microbatches, checks=("in_backward",)
        )
    return report["in_backward"]


def test_leanstep_verify_checks_in_backward_on_the_transformer(cli, tmp_path: Path):
    path = tmp_path / "report.json"
    result = cli("verify", *FLAGS, "--checks", "in_backward", "--no-resume", "--json", path)
    assert result.code == 0 and "every check passed" in result.out, result.out + result.err
    (row,) = json.loads(path.read_text())["checks"]
    assert row["name"] == "in_backward" and row["status"] == "pass", row
    # measured 3.3e-7 against 2^-14: float32 roundoff of two programs over 3 steps
    assert row["bound"] == 2.0**-14 and row["largest"] < row["bound"] / 20, row
    assert "3 steps, M=4, float32" in row["compared"], row
    assert row["detail"].endswith("steps clipped (the standard step): 1, 2, 3"), row  # the clip acts in each


@pytest.mark.parametrize(
    ("control", "named", "where"),
    [
        ("unclipped_layers", "a layer updated with its unclipped gradient", "blocks/"),
        ("rows_reversed", "written into another layer's row", "blocks/"),
    ],
)
def test_each_planted_control_fails_it_by_name(control, named, where):
    result = in_backward(control)
    assert result.status == "fail" and named in result.diagnosis, result
    assert where in result.where and result.largest > 0.1, result
    if control == "unclipped_layers":
        assert "twice the standard step's" in result.diagnosis, result


def test_a_model_without_a_layer_stack_has_it_not_applicable():
    result = in_backward(model="mlp")
    assert result.status == "n/a" and "not given as a leanstep.LayerStack" in result.detail, result
    assert "no other model's" in result.detail, result


def test_importing_verify_run_leaves_the_device_count_settable():
    """Regression: layerwise.py made an array at import, which started JAX's backend, so verify's mesh child
    (and the int8 mesh worker) could no longer set its simulated device count."""
    code = (
        "import jax, leanstep.training.verify_run, leanstep.step.layerwise\n"
        "jax.config.update('jax_num_cpu_devices', 2)\n"
        "print(len(jax.devices()))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0 and done.stdout.split()[-1] == "2", done.stderr[-3000:]
