"""A training step written by hand with optax (no leanstep inside), and the peers' bugs, one at a time.

The model has every feature the named bugs need: bf16 compute, a token-weight mask, dropout,
a batch statistic (each microbatch's hidden units centred by their mean over the microbatch's
rows, a running mean kept as model state) and an FP8-style amax history (its new value is the
max |h| a step saw, written by the step, never by the optimizer). The step runs the microbatches
in a ``lax.scan`` inside ``jax.shard_map`` over the devices of the mesh it is given (one device
without), each device its rows; rows are split into microbatches strided, so that microbatch
``j`` is the same rows on any device count.

``HandwrittenStep(bug=None)`` is correct. Each name of :data:`BUGS` re-creates one bug that
peers shipped:

.. code-block:: text

    fp8_last_microbatch    the amax history keeps the last microbatch's amax (marin#7659)
    fp8_clipped            the FP8 state rides the gradients into the norm and the clip (maxtext#672)
    bf16_norm              the clip's norm is summed in bf16; a float32 norm is reported (maxtext#5143)
    bf16_accumulation      the microbatch gradients are summed in bf16 (DeepSpeed#1800)
    guard_per_microbatch   a non-finite microbatch is dropped, the step goes on (apply_if_finite in MultiSteps)
    loss_per_microbatch    each microbatch's loss is its own token mean; the step averages the means
    float32_layer          the second layer computes in float32 (a framework layer built with dtype=float32)
    keys_reused            every microbatch draws its dropout with the same key
    batch_stat_per_device  the batch statistic is each device's own rows' mean, not the microbatch's
    loss_scale_twice       the loss scale is divided out of the gradient twice
    divided_by_m_twice     the token-weighted gradient is divided by M once more, as if a mean of means

``batch_stat="shared"`` centres every microbatch by the whole batch's mean (one statistic a step,
as a model whose BatchNorm sees the whole batch), a correct design as much as the per-microbatch
one; ``padded_batch`` makes token weights of unequal counts with an empty microbatch.
:meth:`HandwrittenStep.reference_loss` is the model's unscaled loss, written once more without
the step, for verify's ``reference`` check.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

#: Not a peer's bug: the scan runs every microbatch but the last (a shape off by one).
DROPPED = "last_microbatch_dropped"

BUGS = (
    "fp8_last_microbatch",
    "fp8_clipped",
    "bf16_norm",
    "bf16_accumulation",
    "guard_per_microbatch",
    "loss_per_microbatch",
    "float32_layer",
    "keys_reused",
    "batch_stat_per_device",
    "loss_scale_twice",
    "divided_by_m_twice",
)

LOSS_SCALE = 2.0**10
KEEP = 0.75  # dropout keeps this fraction of the hidden units
HISTORY = 4  # amax history length


@functools.partial(jax.tree_util.register_dataclass, data_fields=["arrays"], meta_fields=["settings"])
@dataclasses.dataclass(frozen=True)
class State:
    arrays: dict
    settings: tuple


def make_batch(rows: int = 16, tokens: int = 4, features: int = 6, outputs: int = 3, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, tokens, features)).astype(np.float32)
    x[: rows // 2] *= 3.0  # the first rows' activations are the largest (an FP8 amax that is not the last's)
    return {
        "x": x,
        "y": rng.normal(size=(rows, tokens, outputs)).astype(np.float32),
        "mask": np.ones((rows, tokens), np.float32),
    }


def padded_batch(
    num_microbatches: int, *, empty: int | None = 1, rows: int = 16, tokens: int = 6, seed: int = 0
) -> dict:
    """:func:`make_batch` with token weights of random lengths (padding), microbatch ``empty`` (of a
    strided split into ``num_microbatches``) without any token; None: every row keeps a token."""
    batch = make_batch(rows=rows, tokens=tokens, seed=seed)
    rng = np.random.default_rng(seed + 1)
    lengths = rng.integers(1, tokens + 1, size=rows)
    mask = (np.arange(tokens)[None, :] < lengths[:, None]).astype(np.float32)
    if empty is not None:
        mask[empty::num_microbatches] = 0
    return {**batch, "mask": mask}


@dataclasses.dataclass
class HandwrittenStep:
    """The protocol of :class:`leanstep.verification.VerifiableStep`, for the step of the module doc."""

    bug: str | None = None
    batch: dict = dataclasses.field(default_factory=make_batch)
    hidden: int = 8
    split: str = "strided"
    mask: str | None = "mask"
    compute_dtype: Any = jnp.bfloat16
    batch_stat: bool | str = True  # False: no batch statistic and no model state; "shared": the whole batch's

    def __post_init__(self) -> None:
        if self.bug is not None and self.bug not in (*BUGS, DROPPED):
            raise ValueError(f"bug: expected one of {BUGS}, got {self.bug!r}")
        if self.batch_stat not in (True, False, "shared"):
            raise ValueError(f"batch_stat: expected True, False or 'shared', got {self.batch_stat!r}")
        features, outputs = self.batch["x"].shape[-1], self.batch["y"].shape[-1]
        k1, k2 = jax.random.split(jax.random.key(0))
        self.params = {
            "w1": jax.random.normal(k1, (features, self.hidden)) / np.sqrt(features),
            "w2": jax.random.normal(k2, (self.hidden, outputs)) / np.sqrt(self.hidden),
        }
        self._steps: dict = {}
        self._meshes: dict = {}

    # --- the protocol ----------------------------------------------------------------------------

    def init(self, optimizer, *, max_grad_norm, seed, randomness, mesh):
        if mesh is None:
            mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
        self._meshes[id(mesh)] = mesh
        arrays = {
            "params": self.params,
            "opt_state": optimizer.init(self.params),
            "model_state": {"running_mean": jnp.zeros(self.hidden)} if self.batch_stat else None,
            "fp8": {"amax_history": jnp.zeros(HISTORY)},
            "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.PRNGKey(seed),
        }
        return State(arrays, (max_grad_norm, randomness, id(mesh), optimizer))

    def step(self, state, batch, num_microbatches):
        key = (state.settings, num_microbatches)
        if key not in self._steps:
            max_grad_norm, randomness, mesh_id, optimizer = state.settings
            self._steps[key] = jax.jit(
                functools.partial(
                    self._step,
                    optimizer=optimizer,
                    max_grad_norm=max_grad_norm,
                    randomness=randomness,
                    mesh=self._meshes[mesh_id],
                    num_microbatches=num_microbatches,
                )
            )
        arrays, metrics = self._steps[key](state.arrays, batch)
        return State(arrays, state.settings), metrics

    def parts(self, state):
        a = state.arrays
        return {"params": a["params"], "opt_state": a["opt_state"], "model_state": a["model_state"], "fp8": a["fp8"]}

    def poison(self, batch, row):
        x = np.array(batch["x"], copy=True)
        x[row] = np.nan
        return {**batch, "x": x}

    def reference_loss(self, params, parts, batch):
        """The unscaled token-weighted mean loss of ``batch``, in float32, no dropout, and the model state after."""
        h = jnp.asarray(batch["x"]) @ params["w1"]
        mean = jnp.mean(jax.lax.stop_gradient(h), axis=(0, 1))
        if self.batch_stat:
            h = h - mean[None, None, :]
        out = jnp.tanh(h) @ params["w2"]
        error = jnp.sum((out - batch["y"]) ** 2, axis=-1)
        loss = jnp.sum(error * batch["mask"]) / jnp.sum(batch["mask"])
        state = parts["model_state"]
        return loss, None if state is None else {"running_mean": 0.9 * state["running_mean"] + 0.1 * mean}

    # --- the step ----------------------------------------------------------------------------------

    def _loss(self, params, rows, key, shared_mean, *, randomness):
        """This device's rows of a microbatch: ``(S * loss_sum, (loss_sum, count, amax, mean))``.

        The count, the amax and the batch mean are the microbatch's over every device (forward
        values, not differentiated); the loss is this device's rows' share.
        """
        dtype = self.compute_dtype
        x = rows["x"].astype(dtype)
        h = x @ params["w1"].astype(dtype)
        mean = jnp.mean(jax.lax.stop_gradient(h).astype(jnp.float32), axis=(0, 1))
        if self.bug != "batch_stat_per_device":
            mean = jax.lax.pmean(mean, "data")  # the microbatch's rows are spread over the devices
        if shared_mean is not None:
            mean = shared_mean
        if self.batch_stat:
            h = h - mean.astype(dtype)[None, None, :]
        amax = jax.lax.pmax(jnp.max(jnp.abs(jax.lax.stop_gradient(h).astype(jnp.float32))), "data")
        if randomness:
            keep = jax.random.bernoulli(key, KEEP, h.shape)
            h = jnp.where(keep, h / KEEP, 0).astype(dtype)
        a = jnp.tanh(h)
        if self.bug == "float32_layer":
            out = a.astype(jnp.float32) @ params["w2"]
        else:
            out = a @ params["w2"].astype(dtype)
        error = jnp.sum((out.astype(jnp.float32) - rows["y"]) ** 2, axis=-1)
        loss_sum = jnp.sum(error * rows["mask"])
        count = jax.lax.psum(jnp.sum(rows["mask"]), "data")
        return LOSS_SCALE * loss_sum, (loss_sum, count, amax, mean)

    def _step(self, arrays, batch, *, optimizer, max_grad_norm, randomness, mesh, num_microbatches):
        devices = mesh.devices.size
        spec = PartitionSpec("data")

        def local(arrays, batch):
            return self._local_step(arrays, batch, optimizer, max_grad_norm, randomness, num_microbatches, devices)

        replicated = jax.tree.map(lambda _: PartitionSpec(), arrays)
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(replicated, jax.tree.map(lambda _: spec, batch)),
            out_specs=(replicated, dict.fromkeys(("loss", "grad_norm", "skipped", "loss_scale"), PartitionSpec())),
            check_vma=False,
        )(arrays, batch)

    def _local_step(self, arrays, batch, optimizer, max_grad_norm, randomness, num_microbatches, devices):
        params, fp8 = arrays["params"], arrays["fp8"]
        rows = batch["x"].shape[0]
        # strided: microbatch j is local rows j, j + M, ... (the same global rows on any device count)
        microbatches = jax.tree.map(
            lambda v: v.reshape(rows // num_microbatches, num_microbatches, *v.shape[1:]).swapaxes(0, 1), batch
        )
        step_key = jax.random.fold_in(arrays["rng"], arrays["step"])
        accumulate = jnp.bfloat16 if self.bug == "bf16_accumulation" else jnp.float32
        grad_fn = jax.grad(functools.partial(self._loss, randomness=randomness), has_aux=True)

        def body(carry, xs):
            j, rows_j = xs
            total, tokens, running, amax = carry
            key = step_key if self.bug == "keys_reused" else jax.random.fold_in(step_key, j)
            grads, (loss_sum, count, amax_j, mean_j) = grad_fn(params, rows_j, key, shared_mean)
            grads = jax.tree.map(lambda g: jax.lax.psum(g, "data"), grads)
            loss_sum = jax.lax.psum(loss_sum, "data")
            if self.bug == "loss_per_microbatch":
                grads = jax.tree.map(lambda g: g / count, grads)
                loss_sum = loss_sum / count
            if self.bug == "guard_per_microbatch":
                finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
                grads = jax.tree.map(lambda g: jnp.where(finite, g, 0), grads)
                loss_sum, count = jnp.where(finite, loss_sum, 0), jnp.where(finite, count, 0)
            if self.bug == DROPPED:
                grads = jax.tree.map(lambda g: jnp.where(j == num_microbatches - 1, 0, g), grads)
            total = jax.tree.map(lambda t, g: (t + g.astype(accumulate)).astype(accumulate), total, grads)
            if running is not None and shared_mean is None:
                running = 0.9 * running + 0.1 * mean_j
            amax = amax_j if self.bug == "fp8_last_microbatch" else jnp.maximum(amax, amax_j)
            return (total, tokens + count, running, amax), loss_sum

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, accumulate), params)
        running = None if arrays["model_state"] is None else arrays["model_state"]["running_mean"]
        shared_mean = None
        if self.batch_stat == "shared":  # the whole batch's mean, one statistic for every microbatch
            h = batch["x"].astype(self.compute_dtype) @ params["w1"].astype(self.compute_dtype)
            shared_mean = jax.lax.pmean(jnp.mean(h.astype(jnp.float32), axis=(0, 1)), "data")
            running = 0.9 * running + 0.1 * shared_mean
        init = (zeros, jnp.zeros(()), running, jnp.zeros(()))
        (total, tokens, running, amax), losses = jax.lax.scan(body, init, (jnp.arange(num_microbatches), microbatches))
        denominator = num_microbatches if self.bug == "loss_per_microbatch" else tokens
        grads = jax.tree.map(lambda t: t.astype(jnp.float32) / denominator / LOSS_SCALE, total)
        if self.bug == "loss_scale_twice":
            grads = jax.tree.map(lambda g: g / LOSS_SCALE, grads)
        if self.bug == "divided_by_m_twice":
            grads = jax.tree.map(lambda g: g / num_microbatches, grads)
        new_fp8 = {"amax_history": jnp.roll(fp8["amax_history"], 1).at[0].set(amax)}
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        clipped_tree = {"grads": grads, "fp8": new_fp8} if self.bug == "fp8_clipped" else {"grads": grads}
        norm = optax.tree.norm(clipped_tree)
        if self.bug == "bf16_norm":
            clip_norm = jnp.sqrt(
                sum(
                    jnp.sum(jnp.square(g.astype(jnp.bfloat16)), dtype=jnp.bfloat16)
                    for g in jax.tree.leaves(clipped_tree)
                )
            ).astype(jnp.float32)
        else:
            clip_norm = norm
        if max_grad_norm is not None:
            factor = jnp.minimum(1.0, max_grad_norm / clip_norm)
            clipped_tree = jax.tree.map(lambda g: g * factor, clipped_tree)
        grads = clipped_tree["grads"]
        new_fp8 = clipped_tree.get("fp8", new_fp8)
        updates, opt_state = optimizer.update(grads, arrays["opt_state"], params)
        applied = {
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
            "model_state": None if running is None else {"running_mean": running},
            "fp8": new_fp8,
        }
        kept = {k: arrays[k] for k in applied}
        out = jax.tree.map(lambda new, old: jnp.where(finite, new, old), applied, kept)
        out["step"] = arrays["step"] + 1
        out["rng"] = arrays["rng"]
        metrics = {
            "loss": jnp.sum(losses) / denominator,
            "grad_norm": norm,
            "skipped": ~finite,
            "loss_scale": jnp.float32(LOSS_SCALE),
        }
        return out, metrics
