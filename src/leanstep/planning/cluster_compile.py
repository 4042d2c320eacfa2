"""What a cluster plan traces and compiles: each mesh laid out, the step's FLOPs, one candidate priced.

:func:`place_meshes` lays the abstract state and batch out on every mesh (the exact argument
bytes and collective sizes of :mod:`leanstep.planning.cluster_grid`, without compiling);
:func:`step_flops` traces the whole step once per remat policy for the compute bound;
:class:`ClusterCompiler` traces, compiles and prices one candidate
(:func:`leanstep.planning.cost_model.step_cost`), the only step of the search that compiles.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from leanstep.common.memory_sizes import format_bytes
from leanstep.inspection.collectives import collectives_report
from leanstep.inspection.flops import count_flops
from leanstep.inspection.hlo_text import dot_flops
from leanstep.planning.candidates import compile_candidate
from leanstep.planning.cluster_grid import Layout, argument_bytes, format_seconds, layout_sizes, mesh_text
from leanstep.planning.cluster_search import Compiled
from leanstep.planning.cost_model import Accelerator, StepCost, step_cost
from leanstep.planning.fp8_sizes import fp8_flops
from leanstep.planning.plan_inputs import candidate_spec
from leanstep.planning.records import Candidate, known
from leanstep.sharding.meshes import batch_sharding
from leanstep.step.sharding_layer import ShardingLayer
from leanstep.step.spec import StepSpec
from leanstep.step.train_step import make_train_step

__all__ = ["ClusterCompiler", "Placed", "place_meshes", "priced", "step_flops"]


@dataclasses.dataclass(frozen=True)
class Placed:
    """One mesh with the state and batch laid out on it (``jax.ShapeDtypeStruct`` with shardings)."""

    mesh: Mesh
    state: Any
    batch: Any
    layout: Layout


def place_meshes(
    shapes: Sequence[dict[str, int]],
    devices: Sequence[Any],
    params: Any,
    state: Any,
    batch: Any,
    rules: Any,
    compute_dtype: Any,
) -> tuple[dict[str, Placed], dict[str, str]]:
    """Every mesh of ``shapes`` over ``devices``, by its text (``"data=2,fsdp=4"``), and, apart,
    the meshes the partition ``rules`` do not fit, with the reason."""
    placed: dict[str, Placed] = {}
    errors: dict[str, str] = {}
    batch_size = next(int(np.shape(leaf)[0]) for leaf in jax.tree.leaves(batch))
    for shape in shapes:
        text = mesh_text(shape)
        mesh = Mesh(np.asarray(devices).reshape(tuple(shape.values())), tuple(shape))
        layer = ShardingLayer(mesh, rules=rules)
        try:
            shardings = layer.state_shardings(state)
            specs = layer.param_specs(params)
        except ValueError as error:  # the rules do not fit this mesh (e.g. heads not divisible by tensor)
            errors[text] = str(error)
            continue
        rows = batch_sharding(mesh)
        placed_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
        placed_batch = jax.tree.map(lambda a, r=rows: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=r), batch)
        per_device_rows = batch_size // (shape.get("data", 1) * shape.get("fsdp", 1))
        layout = Layout(
            shape,
            per_device_rows,
            argument_bytes(state, shardings, batch, rows),
            layout_sizes(params, specs, shape, compute_dtype),
        )
        placed[text] = Placed(mesh, placed_state, placed_batch, layout)
    return placed, errors


def step_flops(loss_fns: Mapping[str, Callable[..., Any]], state: Any, batch: Any, spec: StepSpec) -> dict[str, float]:
    """By policy, the dot FLOPs of the whole step of ``spec`` on one device (traced, not compiled)."""
    flops = {}
    for policy, loss_fn in loss_fns.items():
        step = make_train_step(loss_fn, spec)
        flops[policy] = count_flops(step.trace(state, batch).jaxpr, dots_only=True)
    return flops


def priced(candidate: Candidate, cost: StepCost, compile_seconds: float) -> Candidate:
    """A compiled candidate's row with the cost model's figures and its compile time."""
    return dataclasses.replace(
        candidate,
        flops=cost.flops,
        bytes_per_step=cost.bytes,
        collectives=cost.collectives,
        compute_seconds=cost.compute_seconds,
        communication_seconds=cost.communication_seconds,
        predicted_seconds=cost.seconds,
        compile_seconds=compile_seconds,
    )


@dataclasses.dataclass(frozen=True)
class ClusterCompiler:
    """Traces, compiles and prices one candidate: ``compiler(candidate) -> Compiled``.

    Attributes:
      loss_fns: by remat policy, the loss.
      placed: by mesh text, the laid-out mesh (:func:`place_meshes`).
      params: the state's parameters, abstract (to tell parameter traffic from batch traffic).
      rules: the partition rules.
      budget: per-device bytes (sets ``fits``).
      accelerator, compute_dtype: what the cost model prices with.
      compiler_options: passed to ``compile()``.
      spec: the run's :class:`leanstep.StepSpec`, laid out by no mesh (each candidate's is its own).
      progress: called with a line after each compile, or None.
    """

    loss_fns: Mapping[str, Callable[..., Any]]
    placed: Mapping[str, Placed]
    params: Any
    rules: Any
    budget: int
    accelerator: Accelerator
    compute_dtype: Any
    compiler_options: dict[str, Any] | None
    spec: StepSpec
    progress: Callable[[str], None] | None = None

    def __call__(self, candidate: Candidate) -> Compiled:
        s, t0 = candidate.setting, time.perf_counter()
        placed = self.placed[s.mesh]
        layer = ShardingLayer(placed.mesh, rules=self.rules, reduce=s.reduce)
        step = make_train_step(self.loss_fns[s.remat], candidate_spec(self.spec, s), mesh=layer)
        traced = step.trace(placed.state, placed.batch)
        fp8 = fp8_flops(traced.jaxpr)
        fp8_fraction = fp8 / (count_flops(traced.jaxpr, dots_only=True) or 1.0) if fp8 else 0.0
        c = dataclasses.replace(candidate, trace_seconds=time.perf_counter() - t0)
        c = compile_candidate(c, traced, self.budget, self.compiler_options)
        hlo = c.executable.as_text()  # once: printing a large module takes seconds
        report = collectives_report(hlo, placed.mesh, params=self.params)
        cpu = placed.mesh.devices.flat[0].platform == "cpu"
        cost = step_cost(
            dot_flops(hlo),
            report,
            dict(placed.mesh.shape),
            self.accelerator,
            self.compute_dtype,
            promoted_to_float32=cpu,
            fp8_fraction=fp8_fraction,
        )
        c = priced(c, cost, time.perf_counter() - t0 - (c.trace_seconds or 0.0))
        if self.progress is not None:
            self.progress(
                f"compiled {s.describe()}: peak {format_bytes(c.peak_bytes)}, predicted "
                f"{format_seconds(cost.seconds)} (bound {format_seconds(known(c.bound_seconds))}), "
                f"{c.compile_seconds:.1f} s"
            )
        return Compiled(c, cost.by_axes.get(("tensor",), 0.0))
