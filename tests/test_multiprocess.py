"""Two real processes on localhost (jax.distributed, gloo CPU collectives) train like one process.

This file is also the worker script: ``python tests/test_multiprocess.py multi PORT ID OUT`` is one
of two processes with 2 simulated CPU devices each (4 in all); ``... single OUT`` is the reference,
one process with 4 devices (and, as an independent check, the unsharded ``mesh=None`` step).
Each trains data parallel and FSDP for 4 steps, step 2 carrying a NaN in a row that only
process 1 holds, and writes its final parameters (gathered from every process) and metrics.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers.workers import child_env

pytestmark = pytest.mark.slow  # two JAX processes with gloo collectives: the processes are the point

SIZES = (3, 8, 2)
BATCH = 16  # 4 devices x 2 microbatches x 2 rows
NAN_STEP, NAN_ROW = 2, 13  # rows 8..15 live on process 1's devices
STEPS = 4
TIMEOUT_S = 180


def worker(mode: str, args: list[str]) -> None:
    from leanstep.sharding.distributed import configure_devices, device_mesh

    if mode == "multi":
        port, process_id, out = args
        configure_devices(2, f"127.0.0.1:{port}", 2, int(process_id), initialization_timeout=60)
    else:
        (out,) = args
        configure_devices(4)

    import jax
    import jax.numpy as jnp
    import optax
    from jax.experimental import multihost_utils

    from leanstep.sharding.meshes import shard_batch
    from leanstep.step.sharding_layer import ShardingLayer
    from leanstep.step.state_sharding import shard_train_state
    from leanstep.step.train_step import TrainState, make_train_step

    jax.config.update("jax_numpy_rank_promotion", "raise")

    def loss_fn(params, batch):
        hidden = jnp.tanh(batch["x"] @ params["w1"])
        return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)

    def batch_at(t: int) -> dict:
        rng = np.random.default_rng(100 + t)
        x = rng.normal(size=(BATCH, SIZES[0])).astype(np.float32)
        if t == NAN_STEP:
            x[NAN_ROW, 0] = np.nan
        return {"x": x, "y": np.cos(x[:, : SIZES[2]])}

    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=SIZES[:2]).astype(np.float32), "w2": rng.normal(size=SIZES[1:]).astype(np.float32)}
    opt = optax.adam(1e-2)
    mesh = device_mesh()
    # replica x fsdp: the data axis across the two processes, FSDP within each (hybrid sharding).
    hybrid = device_mesh(shape={"data": 2, "fsdp": 2})
    runs = {"dp": (mesh, False), "fsdp": (mesh, True), "hybrid": (hybrid, False)}
    if mode == "single":
        runs["unsharded"] = (None, False)
    result = {
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
    }
    arrays = {}
    for name, (run_mesh, fsdp) in runs.items():
        step = make_train_step(
            loss_fn,
            num_microbatches=2,
            max_grad_norm=1.0,
            mesh=None if run_mesh is None else ShardingLayer(run_mesh, fsdp=fsdp),
        )
        state = TrainState.create(params, opt, loss_scale="dynamic")
        if run_mesh is not None:
            state = shard_train_state(state, run_mesh, fsdp=fsdp)
        losses, skipped = [], []
        for t in range(STEPS):
            batch = batch_at(t) if run_mesh is None else shard_batch(batch_at(t), run_mesh)
            state, metrics = step(state, batch)
            losses.append(float(metrics.loss))  # replicated: readable on every process
            skipped.append(bool(metrics.skipped))
        result[name] = {
            "losses": losses,
            "skipped": skipped,
            "loss_scale": float(state.loss_scale.loss_scale),
            "w1_spec": str(state.params["w1"].sharding.spec) if run_mesh is not None else None,
        }
        gathered = multihost_utils.process_allgather(state.params, tiled=True) if run_mesh is not None else state.params
        arrays.update({f"{name}/{k}": np.asarray(v) for k, v in gathered.items()})
    np.savez(Path(out) / "params.npz", **arrays)
    (Path(out) / "result.json").write_text(json.dumps(result))
    if mode == "multi":
        jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _load(out: Path) -> tuple[dict, dict]:
    with np.load(out / "params.npz") as npz:
        return json.loads((out / "result.json").read_text()), dict(npz)


def test_two_processes_train_like_one(tmp_path):
    env = child_env()
    port = _free_port()
    outs = {name: tmp_path / name for name in ("p0", "p1", "single")}
    for out in outs.values():
        out.mkdir()
    commands = {
        "p0": ["multi", str(port), "0", str(outs["p0"])],
        "p1": ["multi", str(port), "1", str(outs["p1"])],
        "single": ["single", str(outs["single"])],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, __file__, *cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, cmd in commands.items()
    }
    logs = {}
    try:
        deadline = time.monotonic() + TIMEOUT_S
        for name, proc in procs.items():
            try:
                logs[name], _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} did not finish within {TIMEOUT_S} s")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{logs.get(name, '')[-6000:]}"

    (r0, a0), (r1, a1), (rs, a_single) = (_load(outs[n]) for n in ("p0", "p1", "single"))
    assert (r0["process_count"], r0["device_count"], r0["local_device_count"]) == (2, 4, 2)
    assert (rs["process_count"], rs["device_count"]) == (1, 4)
    assert r0 == r1  # both processes saw the same replicated metrics
    for name in ("dp", "fsdp", "hybrid"):
        # Every process skipped the step whose NaN only process 1 held, and only that one.
        assert r0[name]["skipped"] == [t == NAN_STEP for t in range(STEPS)]
        assert r0[name]["skipped"] == rs[name]["skipped"] == rs["unsharded"]["skipped"]
        assert r0[name]["loss_scale"] == rs[name]["loss_scale"] == 2.0**14
        np.testing.assert_allclose(r0[name]["losses"], rs[name]["losses"], rtol=1e-6)
    assert r0["fsdp"]["w1_spec"] == "P(None, 'data')" and r0["dp"]["w1_spec"] == "P()"
    assert r0["hybrid"]["w1_spec"] == "P(None, 'fsdp')"
    assert a0.keys() == a1.keys() == {k for k in a_single if not k.startswith("unsharded/")}
    for key in a0:
        assert a0[key].tobytes() == a1[key].tobytes(), key  # one global state, identical on both
        np.testing.assert_allclose(a0[key], a_single[key], rtol=1e-6, atol=1e-7, err_msg=key)
        reference = a_single["unsharded/" + key.split("/", 1)[1]]
        np.testing.assert_allclose(a0[key], reference, rtol=2e-5, atol=2e-6, err_msg=key)
    initial_w1 = np.random.default_rng(0).normal(size=SIZES[:2]).astype(np.float32)
    assert not np.allclose(a0["dp/w1"], initial_w1, rtol=1e-3)  # it did train


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2:])
