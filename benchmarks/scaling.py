"""Per-device memory and communication of the sharded step, from compiled executables only.

``python -m benchmarks.scaling`` compiles leanstep's step for 8 simulated CPU devices
(in a subprocess, when this process has fewer) on two models, an 8-layer stack of 1024x1024
tanh layers under ``lax.scan`` (Adam, float32, batch 64) and the built-in transformer at
d_model 1024, 8 layers, d_ff 4096 (101M parameters, full remat, batch 32), for data
parallelism (``data=8``), FSDP (``fsdp=8``) and hybrid sharding (``data=2, fsdp=4``) at 1
and 4 microbatches, and prints per-device temporaries and arguments (``memory_analysis``)
and bytes communicated per step (:func:`leanstep.inspection.collectives_report`) beside the minimum:

* memory: a hand-written FSDP step (:func:`reference_fsdp_step`: jit, a microbatch scan,
  ``value_and_grad``, optax; no leanstep stage) with the same model gathering each layer;
* bytes: one all-reduce of the float32 gradient for data parallelism; per microbatch, two
  all-gathers of the compute-dtype parameters (forward, and backward under remat) and one
  reduce-scatter of the float32 gradient for FSDP; both, over their groups, for hybrid.

Nothing runs: speed cannot be measured on simulated devices, which share two cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from benchmarks import child_env

DEVICES = 8
LAYOUTS = {"dp": {"data": 8}, "fsdp": {"fsdp": 8}, "hybrid": {"data": 2, "fsdp": 4}}


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model and its batch: ``loss(params, batch)``, abstract ``params`` and ``batch``, rules."""

    name: str
    loss: Callable[..., Any]
    params: Any
    batch: Any
    rules: tuple[Any, ...]
    remat: str


def mlp_stack(layers: int = 8, width: int = 1024, batch: int = 64) -> Workload:
    """``layers`` tanh layers of ``width x width`` under ``lax.scan``, a mean squared error."""
    import jax
    import jax.numpy as jnp

    from leanstep.blocks.rematerialization import remat
    from leanstep.sharding.model_sharding import constrain, gathered

    def layer(x: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
        return constrain(jnp.tanh(x @ gathered(w, "w")), "batch", None), None

    def loss(params: Any, data: Any) -> jax.Array:
        x, _ = jax.lax.scan(remat(layer, "full", prevent_cse=False), constrain(data["x"], "batch", None), params["w"])
        return jnp.mean((x - data["y"]) ** 2)

    f32 = jnp.float32
    return Workload(
        "mlp-stack",
        loss,
        {"w": jax.ShapeDtypeStruct((layers, width, width), f32)},
        {"x": jax.ShapeDtypeStruct((batch, width), f32), "y": jax.ShapeDtypeStruct((batch, width), f32)},
        (("^w$", (None, "fsdp")),),
        "full",
    )


def transformer(
    d_model: int = 1024, layers: int = 8, d_ff: int = 4096, heads: int = 16, seq_len: int = 128, batch: int = 32
) -> Workload:
    """The built-in transformer (mean loss, full remat)."""
    import jax
    import jax.numpy as jnp

    from leanstep.models import build_model

    model = build_model(
        "transformer", "small", d_model=d_model, n_layers=layers, d_ff=d_ff, n_heads=heads, seq_len=seq_len
    )
    loss = lambda params, data: model.loss(params, data, remat_policy="full")
    return Workload(
        f"transformer-d{d_model}",
        loss,
        jax.eval_shape(model.init, jax.random.key(0)),
        {"tokens": jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)},
        model.rules,
        "full",
    )


def compile_leanstep(
    work: Workload, mesh: Any, num_microbatches: int, precision: str = "float32", reduce: str = "auto"
) -> Any:
    """leanstep's step (Adam, dynamic loss scale, clipping at 1) compiled for ``mesh``."""
    import jax
    import optax

    from leanstep.sharding.meshes import batch_sharding
    from leanstep.step.sharding_layer import ShardingLayer
    from leanstep.step.spec import StepSpec
    from leanstep.step.state import TrainState
    from leanstep.step.train_step import make_train_step

    layer = ShardingLayer(mesh, rules=work.rules, reduce=reduce)
    # strided microbatches, as on every mesh: no row moves between devices
    spec = StepSpec.from_keywords(
        precision=precision, num_microbatches=num_microbatches, split="strided", max_grad_norm=1.0,
        loss_scale="dynamic",
    )  # fmt: skip
    step = make_train_step(work.loss, spec, mesh=layer)
    state = jax.eval_shape(lambda p: TrainState.create(p, optax.adam(1e-3), spec), work.params)
    shardings = layer.state_shardings(state)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
    rows = batch_sharding(mesh)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rows), work.batch)
    return step.lower(state, batch).compile()


def reference_fsdp_step(work: Workload, mesh: Any, num_microbatches: int) -> Any:
    """A hand-written FSDP step, compiled: params and Adam state split by the rules and kept
    split, strided microbatches in a ``lax.scan``, ``value_and_grad`` with the model
    gathering each layer (:func:`leanstep.sharding.sharding_context`), a float32 accumulator, optax."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from leanstep.sharding.model_sharding import sharding_context
    from leanstep.sharding.partition_rules import MeshAxes, param_specs

    axes = MeshAxes(mesh, (), "fsdp", None)
    specs = param_specs(work.params, axes, work.rules)
    shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    optimizer = optax.adam(1e-3)
    m = num_microbatches

    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        params_c = jax.lax.with_sharding_constraint(params, shard)
        micro = jax.tree.map(lambda v: v.reshape(v.shape[0] // m, m, *v.shape[1:]).swapaxes(0, 1), batch)
        micro = jax.lax.with_sharding_constraint(micro, NamedSharding(mesh, PartitionSpec(None, "fsdp")))
        with sharding_context(axes, specs, params):

            def body(acc: Any, mb: Any) -> Any:
                loss, grads = jax.value_and_grad(work.loss)(params_c, mb)
                return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads), loss

            zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), shard)
            grads, losses = jax.lax.scan(body, zeros, micro)
        updates, opt_state = optimizer.update(jax.tree.map(lambda g: g / m, grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jnp.mean(losses)

    opt_state = jax.eval_shape(optimizer.init, work.params)
    replicated = NamedSharding(mesh, PartitionSpec())
    adam, *rest = opt_state  # (ScaleByAdamState(count, mu, nu), EmptyState())
    opt_shard = (adam._replace(count=replicated, mu=shard, nu=shard), *jax.tree.map(lambda _: replicated, rest))
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    jitted = jax.jit(
        step, in_shardings=(shard, opt_shard, rows), out_shardings=(shard, opt_shard, None), donate_argnums=(0, 1)
    )
    return jitted.lower(work.params, opt_state, work.batch).compile()


def minimum_bytes(work: Workload, layout: str, num_microbatches: int, precision: str = "float32") -> int:
    """The least a step of this layout communicates per device group (see the module doc)."""
    import jax
    import numpy as np

    sizes = [int(np.prod(p.shape)) for p in jax.tree.leaves(work.params)]
    gradient = 4 * sum(sizes)
    compute = (2 if "bfloat16" in precision else 4) * sum(sizes)
    shape = LAYOUTS[layout]
    fsdp = shape.get("fsdp", 1)
    per_microbatch = (2 * compute + gradient) if fsdp > 1 else 0
    replica = gradient // fsdp if shape.get("data", 1) > 1 else 0
    return num_microbatches * per_microbatch + replica


def measure(work: Workload, layout: str, num_microbatches: int, precision: str = "float32") -> dict[str, Any]:
    """Memory and communication of leanstep's step for one layout."""
    import jax

    from leanstep.inspection.collectives import collectives_report
    from leanstep.sharding.distributed import device_mesh

    mesh = device_mesh(shape=LAYOUTS[layout])
    compiled = compile_leanstep(work, mesh, num_microbatches, precision)
    memory = compiled.memory_analysis()
    report = collectives_report(compiled, mesh, params=work.params)
    gradient_kinds = ("all-reduce", "reduce-scatter")
    return {
        "model": work.name,
        "layout": layout,
        "microbatches": num_microbatches,
        "precision": precision,
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "bytes_per_step": report.bytes_per_step(),
        "minimum_bytes": minimum_bytes(work, layout, num_microbatches, precision),
        "all_reduce_bytes": report.bytes_per_step("all-reduce"),
        "executions": {kind: report.executions(kind) for kind in ("all-reduce", "all-gather", "reduce-scatter")},
        # Executions per step of the most-run gradient reduction (1: once per step, after the scan).
        "reduction_trips": max(
            (c.trips for c in report.collectives if c.kind in gradient_kinds and c.bytes > 64), default=0
        ),
        "reduced_bytes": sum(c.bytes_per_step for c in report.collectives if c.kind in gradient_kinds),
        "moves_batch": len(report.moving_batch),
        "params": sum(int(p.size) for p in jax.tree.leaves(work.params)),
    }


def table(rows: list[dict[str, Any]], references: dict[str, int]) -> str:
    """The README table."""
    mib = 2**20
    lines = [
        (
            "| model | layout | M | temp MiB/device | hand-written FSDP temp | args MiB/device | MB sent/step | "
            "minimum MB | batch rows moved |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref = references[f"{r['model']}/{r['microbatches']}"]
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['microbatches']} | {r['temp_bytes'] / mib:.1f} | "
            f"{ref / mib:.1f} | {r['argument_bytes'] / mib:.1f} | {r['bytes_per_step'] / 1e6:.1f} | "
            f"{r['minimum_bytes'] / 1e6:.1f} | {r['moves_batch']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Prints the table (re-running itself on 8 simulated devices if needed)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--models", default="mlp-stack,transformer", help="comma-separated: mlp-stack, transformer")
    args = parser.parse_args(argv)
    import jax

    if jax.device_count() < DEVICES:
        if os.environ.get("LEANSTEP_SCALING_CHILD"):
            raise SystemExit(f"expected {DEVICES} devices, got {jax.device_count()}")
        env = child_env(
            {
                **os.environ,
                "LEANSTEP_SCALING_CHILD": "1",
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}",
            }
        )
        return subprocess.call([sys.executable, "-m", "benchmarks.scaling", *(argv or sys.argv[1:])], env=env)
    from leanstep.sharding.distributed import device_mesh

    works: dict[str, Callable[[], Workload]] = {"mlp-stack": mlp_stack, "transformer": transformer}
    rows, references = [], {}
    for name in args.models.split(","):
        work = works[name]()
        for m in (1, 4):
            ref = reference_fsdp_step(work, device_mesh(shape=LAYOUTS["fsdp"]), m)
            references[f"{work.name}/{m}"] = int(ref.memory_analysis().temp_size_in_bytes)
            for layout in LAYOUTS:
                rows.append(measure(work, layout, m))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(rows, references))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "references": references}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
