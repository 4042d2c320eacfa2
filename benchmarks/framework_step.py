r"""leanstep's step against a framework model's own jitted step, with the same features on.

The model is an lm1b-style Flax Linen ``TransformerLM`` (the structure of Flax's
``examples/lm1b/models.py``: a token embedding, learned positions, pre-LayerNorm decoder
blocks of causal self-attention and an MLP, the model code casting its activations with
``astype(config.dtype)``, built with ``dtype=bfloat16`` as lm1b trains it). Two pairs, each
timed round-robin (:func:`leanstep.bench.timing.time_interleaved`) in one process:

.. code-block:: text

    plain   lm1b's own train step: jax.jit(value_and_grad(loss) -> adamw -> apply_updates),
            params and optimizer state donated
            vs  make_train_step(loss) with one microbatch, no loss scale, no clipping
    full    the hand-written step of every technique (leanstep.bench.handwritten: bf16 cast of
            the float32 masters, dynamic loss scale, M microbatches in one lax.scan with a
            float32 accumulator, one unscale, finiteness, global-norm clip, a guarded update)
            vs  make_train_step(loss, precision=bf16 compute, num_microbatches=M,
                                max_grad_norm=1.0) with loss_scale="dynamic"

    ratio = median(leanstep step) / median(own step)     (and the ratio of the fastest calls)

Each pair is checked to take the same step first (the largest difference of the params after one
step), and its compiled programs' temp bytes are reported beside the times, with those of lm1b's
step plus leanstep's finiteness guard alone (``own-guarded``: the update applied only if the whole
gradient is finite), which accounts for what leanstep's plain step holds beyond lm1b's.
Run it on a quiet machine as ``python -m benchmarks.framework_step`` (``--json F`` writes the
result); the measured ratios are in docs/speedrun-and-benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import leanstep
from benchmarks import print_result
from leanstep.bench.handwritten import init_handwritten_state, make_handwritten_step
from leanstep.bench.timing import compiled_stats, time_interleaved

__all__ = ["TransformerLM", "main", "measure"]


class MlpBlock(nn.Module):
    """lm1b's MlpBlock: Dense, relu, Dense, the hidden activations cast with ``astype(dtype)``."""

    mlp_dim: int
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.relu(nn.Dense(self.mlp_dim, dtype=self.dtype)(x)).astype(self.dtype)
        return nn.Dense(x.shape[-1], dtype=self.dtype)(h)


class DecoderBlock(nn.Module):
    """lm1b's EncoderDecoder1DBlock: pre-LayerNorm causal self-attention and MLP, residuals."""

    num_heads: int
    mlp_dim: int
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.SelfAttention(num_heads=self.num_heads, dtype=self.dtype, use_bias=False)(h, mask=mask)
        x = x + h
        return x + MlpBlock(self.mlp_dim, self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


class TransformerLM(nn.Module):
    """An lm1b-style decoder-only language model (its structure, small sizes; lm1b's default
    ``logits_via_embedding=False``: a separate logits Dense in the config dtype)."""

    vocab_size: int = 256
    emb_dim: int = 256
    num_heads: int = 4
    num_layers: int = 2
    mlp_dim: int = 1024
    max_len: int = 128
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab_size, self.emb_dim, embedding_init=nn.initializers.normal(1.0))
        x = embed(tokens).astype(self.dtype)
        positions = self.param("pos_embedding", nn.initializers.normal(0.02), (1, self.max_len, self.emb_dim))
        x = x + positions[:, : tokens.shape[1]].astype(self.dtype)
        mask = nn.make_causal_mask(tokens)
        for i in range(self.num_layers):
            x = DecoderBlock(self.num_heads, self.mlp_dim, self.dtype, name=f"block_{i}")(x, mask)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        return nn.Dense(self.vocab_size, dtype=self.dtype, name="logits")(x)  # lm1b's default head


def lm_loss(model: TransformerLM) -> Callable[[Any, Any], jax.Array]:
    """The small loss adapter: next-token cross-entropy over ``batch["tokens"]``, in float32."""

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        logits = model.apply({"params": params}, batch["tokens"][:, :-1])
        labels = batch["tokens"][:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(logits, jnp.float32), labels).mean()

    return loss_fn


def own_step(loss_fn: Callable[[Any, Any], jax.Array], tx: optax.GradientTransformation) -> Any:
    """lm1b's train step: one value_and_grad, the optimizer, params and optimizer state donated."""

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def own_guarded_step(loss_fn: Callable[[Any, Any], jax.Array], tx: optax.GradientTransformation) -> Any:
    """lm1b's train step with one thing more, leanstep's guard: the update applies only if every
    gradient is finite (so the whole gradient is live until that is decided). Compiled for its
    memory, to account for what leanstep's plain step holds beyond lm1b's own."""

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        updates, new_opt_state = tx.update(grads, opt_state, params)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        return keep(optax.apply_updates(params, updates), params), keep(new_opt_state, opt_state), loss

    return jax.jit(step, donate_argnums=(0, 1))


def _fresh(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _largest_difference(a: Any, b: Any) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


class _Runner:
    """A step and its state; each call runs one step to completion and keeps the new state."""

    def __init__(self, call: Callable[[Any], tuple[Any, jax.Array]], state: Any):
        self.call, self.state = call, state

    def __call__(self) -> None:
        self.state, loss = self.call(self.state)
        jax.block_until_ready(loss)


def _pairs(model: TransformerLM, batch: Any, microbatches: int) -> dict[str, dict[str, Any]]:
    """The two pairs' steps, compiled, with a fresh state each, and their first step compared."""
    params = TransformerLM(**{**_sizes(model), "dtype": jnp.float32}).init(jax.random.key(0), batch["tokens"][:, :-1])
    params = params["params"]
    tx = optax.adamw(1e-3)
    loss_fn = lm_loss(model)
    own = own_step(loss_fn, tx)
    plain = leanstep.make_train_step(loss_fn)
    precision = "params=float32,compute=bfloat16,output=float32"
    hand = make_handwritten_step(loss_fn, tx, num_microbatches=microbatches, max_grad_norm=1.0)
    spec = leanstep.StepSpec.from_keywords(
        precision=precision, num_microbatches=microbatches, max_grad_norm=1.0, loss_scale="dynamic"
    )
    full = leanstep.make_train_step(loss_fn, spec)

    def own_call(state: Any) -> tuple[Any, jax.Array]:
        params, opt_state, loss = own(state[0], state[1], batch)
        return (params, opt_state), loss

    def leanstep_call(step: Any) -> Callable[[Any], tuple[Any, jax.Array]]:
        def call(state: Any) -> tuple[Any, jax.Array]:
            new, metrics = step(state, batch)
            return new, metrics.loss

        return call

    def hand_call(state: Any) -> tuple[Any, jax.Array]:
        new, metrics = hand(state, batch)
        return new, metrics["loss"]

    calls = {"own": own_call, "leanstep": leanstep_call(plain), "hand-written": hand_call}
    calls["leanstep-full"] = leanstep_call(full)
    states: dict[str, Callable[[], Any]] = {
        "own": lambda: (_fresh(params), tx.init(_fresh(params))),
        "leanstep": lambda: leanstep.TrainState.create(_fresh(params), tx),
        "hand-written": lambda: init_handwritten_state(_fresh(params), tx),
        "leanstep-full": lambda: leanstep.TrainState.create(_fresh(params), tx, spec),
    }
    compiled = {
        "own": own.lower(*states["own"](), batch).compile(),
        "leanstep": plain.lower(states["leanstep"](), batch).compile(),
        "hand-written": hand.lower(states["hand-written"](), batch).compile(),
        "leanstep-full": full.lower(states["leanstep-full"](), batch).compile(),
    }
    compiled["own-guarded"] = own_guarded_step(loss_fn, tx).lower(*states["own"](), batch).compile()
    after = {name: calls[name](states[name]())[0] for name in calls}
    same = {
        "plain": _largest_difference(after["own"][0], after["leanstep"].params),
        "full": _largest_difference(after["hand-written"].params, after["leanstep-full"].params),
    }
    runners = {name: _Runner(calls[name], states[name]()) for name in calls}
    return {"runners": runners, "compiled": compiled, "first_step_max_abs_difference": same}


def _sizes(model: TransformerLM) -> dict[str, Any]:
    return {f: getattr(model, f) for f in ("vocab_size", "emb_dim", "num_heads", "num_layers", "mlp_dim", "max_len")}


def measure(
    *, batch_size: int = 16, seq_len: int = 128, microbatches: int = 4, repeats: int = 30, rounds: int = 3, **sizes: Any
) -> dict[str, Any]:
    """Times the two pairs; returns their ratios, per-call times and compiled stats.

    Example:
      >>> result = measure(batch_size=4, seq_len=8, microbatches=2, repeats=2, rounds=1,
      ...                  emb_dim=16, mlp_dim=32, num_layers=1, max_len=8)
      >>> sorted(result["ratios"]), result["first_step_max_abs_difference"]["plain"] < 1e-6
      (['full', 'plain'], True)
    """
    model = TransformerLM(**{**sizes, "max_len": max(seq_len, sizes.get("max_len", seq_len))})
    tokens = np.random.default_rng(0).integers(1, model.vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
    batch = {"tokens": jnp.asarray(tokens)}
    pairs = _pairs(model, batch, microbatches)
    best: dict[str, list[float]] = {name: [] for name in pairs["runners"]}
    medians: dict[str, list[float]] = {name: [] for name in pairs["runners"]}
    for _ in range(rounds):  # the machine is shared: best of several interleaved rounds
        times = time_interleaved(pairs["runners"], repeats=repeats, warmup=2)
        for name, seconds in times.items():
            best[name].append(min(seconds))
            medians[name].append(statistics.median(seconds))
    ms = {name: {"median": 1e3 * min(medians[name]), "min": 1e3 * min(best[name])} for name in best}
    ratio = lambda ours, theirs, kind: ms[ours][kind] / ms[theirs][kind]
    return {
        "model": {**_sizes(model), "batch_size": batch_size, "seq_len": seq_len, "microbatches": microbatches},
        "step_ms": ms,
        "ratios": {
            "plain": {"median": ratio("leanstep", "own", "median"), "min": ratio("leanstep", "own", "min")},
            "full": {
                "median": ratio("leanstep-full", "hand-written", "median"),
                "min": ratio("leanstep-full", "hand-written", "min"),
            },
        },
        "temp_bytes": {name: compiled_stats(c).get("temp_bytes") for name, c in pairs["compiled"].items()},
        "first_step_max_abs_difference": pairs["first_step_max_abs_difference"],
        "machine": {"backend": jax.default_backend(), "devices": str(jax.devices()[0])},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.framework_step", description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    result = measure(
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        microbatches=args.microbatches,
        repeats=args.repeats,
        rounds=args.rounds,
        num_layers=args.layers,
    )
    return print_result(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
