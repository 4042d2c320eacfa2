"""Reliability under bad input: one table of cases across the public API and the CLI.

Every case must end in a ValueError/TypeError raised by leanstep's own checks (never from inside
JAX or NumPy, never a silent result) whose message names the argument, or, on the command line,
in exit code 2 and exactly one line on stderr that does the same.
"""

from __future__ import annotations

import dataclasses
import json
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import leanstep
from helpers.tiny_runs import QUIET, TINY_TRANSFORMER
from leanstep import tasks
from leanstep.cli.machine_defaults import given_fields
from leanstep.cli.main import build_parser, main
from leanstep.step.train_step import TrainState, make_train_step
from leanstep.training import RunConfig, build_run, train


@dataclasses.dataclass(frozen=True)
class Case:
    """``call`` is an API call (given the paths fixture) or a CLI argv with ``{name}`` path placeholders.

    ``expected`` is the exception type (API) or the exit code (CLI); ``fragment`` must appear in
    the message.
    """

    id: str
    call: Callable[[dict[str, Path]], Any] | tuple[str, ...]
    expected: type[Exception] | int
    fragment: str


# --- API fixtures ------------------------------------------------------------------------------

SGD = optax.sgd(0.1)


def _loss(params: dict, batch: dict) -> jax.Array:
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _state() -> TrainState:
    return TrainState.create({"w": jnp.zeros(2)}, SGD, loss_scale="dynamic")


def _batch(rows: int = 4, y_rows: int | None = None) -> dict[str, jax.Array]:
    return {"x": jnp.ones((rows, 2)), "y": jnp.ones((rows if y_rows is None else y_rows,))}


def _step(batch: dict, loss_fn: Callable = _loss, state: Any = None, **kwargs: Any) -> Any:
    return make_train_step(loss_fn, **kwargs)(_state() if state is None else state, batch)


_MP = {
    "params": {"w": jnp.ones((2, 1)), "b": jnp.zeros(1)},
    "x": jnp.ones((3, 2)),
    "y": jnp.ones((3, 1)),
    "loss_scale": jnp.float32(8.0),
    "good_steps": jnp.int32(0),
    "lr": jnp.float32(0.1),
}
_MLP = {"w1": jnp.ones((2, 3)), "b1": jnp.zeros(3), "w2": jnp.ones((3, 1)), "b2": jnp.zeros(1)}
_RES = {"w1": jnp.ones((2, 3)), "b1": jnp.zeros(3), "w2": jnp.ones((3, 2)), "b2": jnp.zeros(2)}


def _mixed(growth_interval: Any = 2, **kwargs: Any) -> Any:
    step = jax.jit(tasks.mixed_precision_step, static_argnames=("growth_interval",))
    return step(**{**_MP, **kwargs}, growth_interval=growth_interval)


def _accumulate(num_microbatches: Any = 2, **kwargs: Any) -> Any:
    args = {"params": _MLP, "x": jnp.ones((4, 2)), "y": jnp.ones((4, 1)), **kwargs}
    return jax.jit(tasks.accumulate_gradients, static_argnames=("num_microbatches",))(
        **args, num_microbatches=num_microbatches
    )


def _residual(**kwargs: Any) -> Any:
    args = {"params": _RES, "x": jnp.ones((4, 2)), "y": jnp.ones((4, 2)), **kwargs}
    return jax.jit(tasks.checkpointed_residual_block)(**args)


def _as(tree: dict, dtype: Any) -> dict:
    return {k: v.astype(dtype) for k, v in tree.items()}


def _train(paths: dict[str, Path], **fields: Any) -> Any:
    config = RunConfig(**{"size": "tiny", "data": str(paths["corpus"]), "out": str(paths["tmp"] / "api-run"), **fields})
    return train(config)


API = [
    # make_train_step and its step
    Case("step/loss_fn_not_callable", lambda p: make_train_step("loss"), TypeError, "loss_fn must be callable"),
    Case(
        "step/optimizer_a_string",
        lambda p: make_train_step(_loss, "adam"),
        TypeError,
        "make_train_step takes no optimizer since leanstep 0.8",
    ),
    Case(
        "step/num_microbatches_zero",
        lambda p: make_train_step(_loss, num_microbatches=0),
        ValueError,
        "num_microbatches must be >= 1, got 0",
    ),
    Case(
        "step/num_microbatches_negative",
        lambda p: make_train_step(_loss, num_microbatches=-2),
        ValueError,
        "num_microbatches must be >= 1",
    ),
    Case(
        "step/num_microbatches_float",
        lambda p: make_train_step(_loss, num_microbatches=2.0),
        TypeError,
        "num_microbatches must be a static Python int",
    ),
    Case(
        "step/max_grad_norm_nan",
        lambda p: make_train_step(_loss, max_grad_norm=float("nan")),
        ValueError,
        "max_grad_norm must be a positive finite number or None, got nan",
    ),
    Case(
        "step/max_grad_norm_negative",
        lambda p: make_train_step(_loss, max_grad_norm=-1.0),
        ValueError,
        "max_grad_norm must be a positive finite number or None, got -1.0",
    ),
    Case(
        "step/max_grad_norm_zero",
        lambda p: make_train_step(_loss, max_grad_norm=0),
        ValueError,
        "max_grad_norm must be a positive finite number",
    ),
    Case(
        "step/max_grad_norm_bool",
        lambda p: make_train_step(_loss, max_grad_norm=True),
        TypeError,
        "max_grad_norm must be a number or None, got bool",
    ),
    Case(
        "step/precision_unknown_dtype",
        lambda p: make_train_step(_loss, precision="compute=bf17"),
        ValueError,
        "unknown dtype name 'bf17' in precision spec",
    ),
    Case(
        "step/precision_integer_dtype",
        lambda p: make_train_step(_loss, precision="compute=int8"),
        ValueError,
        "unknown dtype name 'int8'",
    ),
    Case(
        "step/precision_not_a_spec",
        lambda p: make_train_step(_loss, precision=16),
        TypeError,
        "precision must be a leanstep.Precision or its string form (e.g. 'compute=bfloat16'), got int 16",
    ),
    Case(
        "step/batch_not_divisible",
        lambda p: _step(_batch(6), num_microbatches=4),
        ValueError,
        "batch size 6 is not divisible by num_microbatches=4",
    ),
    Case(
        "step/batch_leaves_mismatched",
        lambda p: _step(_batch(4, y_rows=3)),
        ValueError,
        "batch['y'] has leading size 3 but batch['x'] has 4",
    ),
    Case("step/batch_empty_rows", lambda p: _step(_batch(0), num_microbatches=2), ValueError, "batch size is 0"),
    Case("step/batch_empty_tree", lambda p: _step({}), ValueError, "batch must have at least one array leaf"),
    Case(
        "step/batch_scalar_leaf",
        lambda p: _step({"x": jnp.ones((4, 2)), "y": jnp.float32(1)}),
        ValueError,
        "batch['y'] is a scalar",
    ),
    Case(
        "step/state_a_dict",
        lambda p: _step(_batch(), state={"params": {"w": jnp.zeros(2)}}),
        TypeError,
        "state must be a TrainState",
    ),
    Case(
        "step/loss_a_vector",
        lambda p: _step(_batch(), lambda q, b: (b["x"] @ q["w"] - b["y"]) ** 2),
        ValueError,
        "loss_fn's loss must be a scalar, got shape (4,)",
    ),
    Case(
        "step/loss_complex",
        lambda p: _step(_batch(), lambda q, b: _loss(q, b) + 0j),
        TypeError,
        "loss_fn's loss must be a real floating scalar, got dtype complex64",
    ),
    Case(
        "step/loss_integer",
        lambda p: _step(_batch(), lambda q, b: jnp.int32(3)),
        TypeError,
        "loss_fn's loss must be a real floating scalar, got dtype int32",
    ),
    Case(
        "step/has_aux_without_aux",
        lambda p: _step(_batch(), has_aux=True),
        TypeError,
        "has_aux=True: loss_fn must return (loss, aux)",
    ),
    # TrainState.create
    Case(
        "state/int_params",
        lambda p: TrainState.create({"w": jnp.zeros(2, jnp.int32)}, SGD),
        TypeError,
        "params['w'] has dtype int32; expected floating-point parameters",
    ),
    Case(
        "state/bool_params",
        lambda p: TrainState.create({"w": np.zeros(2, bool)}, SGD),
        TypeError,
        "params['w'] has dtype bool",
    ),
    Case(
        "state/complex_params",
        lambda p: TrainState.create({"w": jnp.zeros(2, jnp.complex64)}, SGD),
        TypeError,
        "params['w'] has dtype complex64",
    ),
    Case(
        "state/empty_params",
        lambda p: TrainState.create({}, SGD),
        ValueError,
        "params must have at least one array leaf",
    ),
    Case("state/string_leaf", lambda p: TrainState.create({"w": "abc"}, SGD), TypeError, "params['w'] is a str"),
    Case(
        "state/optimizer_a_string",
        lambda p: TrainState.create({"w": jnp.zeros(2)}, "sgd"),
        TypeError,
        "optimizer must be an optax.GradientTransformation",
    ),
    Case(
        "state/unknown_loss_scale",
        lambda p: TrainState.create({"w": jnp.zeros(2)}, SGD, loss_scale="bf16"),
        ValueError,
        "unknown loss scale spec 'bf16'",
    ),
    Case(
        "state/seed_float",
        lambda p: TrainState.create({"w": jnp.zeros(2)}, SGD, seed=1.5),
        TypeError,
        "seed must be an int, got float 1.5",
    ),
    # loss scales, precision, remat
    Case(
        "loss_scale/zero",
        lambda p: leanstep.blocks.get_loss_scale("dynamic", 0.0),
        ValueError,
        "initial_scale must be finite and > 0 in float32, got 0.0",
    ),
    Case(
        "loss_scale/nan",
        lambda p: leanstep.blocks.get_loss_scale("dynamic", float("nan")),
        ValueError,
        "initial_scale must be finite and > 0 in float32, got nan",
    ),
    Case(
        "loss_scale/negative_static",
        lambda p: leanstep.blocks.get_loss_scale("static", -4.0),
        ValueError,
        "loss_scale must be finite and > 0 in float32, got -4.0",
    ),
    Case(
        "loss_scale/growth_interval_zero",
        lambda p: leanstep.DynamicLossScale.create(8.0, growth_interval=0),
        ValueError,
        "growth_interval must be an int in [1, 2**31 - 1], got 0",
    ),
    Case(
        "loss_scale/backoff_above_one",
        lambda p: leanstep.DynamicLossScale.create(8.0, backoff_factor=1.5),
        ValueError,
        "backoff_factor must be in (0, 1)",
    ),
    Case(
        "loss_scale/min_above_max",
        lambda p: leanstep.DynamicLossScale.create(8.0, min_loss_scale=16.0, max_loss_scale=4.0),
        ValueError,
        "max_loss_scale must be >= min_loss_scale",
    ),
    Case(
        "loss_scale/not_a_spec",
        lambda p: leanstep.blocks.get_loss_scale(3),
        TypeError,
        "spec must be a str or a LossScale",
    ),
    Case(
        "precision/field_twice",
        lambda p: leanstep.blocks.get_precision("compute=bfloat16,compute=float16"),
        ValueError,
        "key 'compute' sets compute_dtype twice",
    ),
    Case("remat/unknown_policy", lambda p: leanstep.blocks.get_remat_policy("dot"), ValueError, "unknown policy='dot'"),
    Case("remat/fn_not_callable", lambda p: leanstep.blocks.remat(3, "dots"), TypeError, "fn must be callable"),
    # clipping, accumulation
    Case(
        "clip/negative_max_norm",
        lambda p: leanstep.blocks.clip_by_global_norm({"w": jnp.ones(2)}, -1.0),
        ValueError,
        "max_norm must be finite and > 0, got max_norm=-1.0",
    ),
    Case(
        "clip/nan_max_norm",
        lambda p: leanstep.blocks.clip_by_global_norm({"w": jnp.ones(2)}, float("nan")),
        ValueError,
        "max_norm must be finite and > 0, got max_norm=nan",
    ),
    Case(
        "clip/bool_max_norm",
        lambda p: leanstep.blocks.clip_by_global_norm({"w": jnp.ones(2)}, True),
        TypeError,
        "max_norm must be a real number",
    ),
    Case(
        "clip/vector_max_norm",
        lambda p: leanstep.blocks.clip_by_global_norm({"w": jnp.ones(2)}, jnp.ones(2)),
        ValueError,
        "max_norm must be a scalar, got shape (2,)",
    ),
    Case(
        "clip/int_leaf",
        lambda p: leanstep.blocks.clip_by_global_norm({"w": jnp.ones(2, jnp.int32)}, 1.0),
        TypeError,
        "tree['w'] has dtype int32; expected a floating dtype",
    ),
    Case(
        "clip/complex_leaf",
        lambda p: leanstep.blocks.global_norm({"w": jnp.ones(2, jnp.complex64)}),
        TypeError,
        "tree['w'] has dtype complex64",
    ),
    Case(
        "accumulate/zero_microbatches",
        lambda p: leanstep.blocks.microbatched_value_and_grad(_loss, 0),
        ValueError,
        "num_microbatches must be >= 1",
    ),
    Case(
        "accumulate/split_not_divisible",
        lambda p: leanstep.blocks.split_microbatches({"x": jnp.ones(6)}, 4),
        ValueError,
        "batch size 6 is not divisible by num_microbatches=4",
    ),
    Case(
        "accumulate/split_empty",
        lambda p: leanstep.blocks.split_microbatches({"x": jnp.ones(0)}, 2),
        ValueError,
        "batch size is 0",
    ),
    # checkpoints
    Case(
        "checkpoint/keep_zero",
        lambda p: leanstep.checkpoints.Checkpointer(p["tmp"] / "ck0", max_to_keep=0),
        ValueError,
        "max_to_keep must be an int >= 1, got 0",
    ),
    Case(
        "checkpoint/negative_step",
        lambda p: leanstep.checkpoints.Checkpointer(p["tmp"] / "ck1").save(-1, {"w": jnp.ones(2)}),
        ValueError,
        "step must be a non-negative integer, got -1",
    ),
    Case(
        "checkpoint/extra_numpy_scalar",
        lambda p: leanstep.checkpoints.Checkpointer(p["tmp"] / "ck2").save(
            1, {"w": jnp.ones(2)}, extra={"loss": np.float32(1)}
        ),
        TypeError,
        "extra['loss'] is a float32",
    ),
    Case(
        "checkpoint/string_leaf",
        lambda p: leanstep.checkpoints.Checkpointer(p["tmp"] / "ck3").save(1, {"w": "x"}),
        TypeError,
        "state['w'] is a str",
    ),
    # leanstep.tasks
    Case(
        "tasks/mixed_missing_key",
        lambda p: _mixed(params={"w": jnp.ones((2, 1))}),
        ValueError,
        "params must have exactly the keys ['w', 'b']; missing ['b']",
    ),
    Case(
        "tasks/mixed_extra_key",
        lambda p: _mixed(params={**_MP["params"], "c": jnp.zeros(1)}),
        ValueError,
        "unexpected ['c']",
    ),
    Case(
        "tasks/mixed_params_a_list",
        lambda p: _mixed(params=[jnp.ones((2, 1)), jnp.zeros(1)]),
        TypeError,
        "params must be a dict with keys ['w', 'b'], got list",
    ),
    Case(
        "tasks/mixed_x_shape", lambda p: _mixed(x=jnp.ones((3, 5))), ValueError, "x has shape (3, 5); expected (*, 2)"
    ),
    Case("tasks/mixed_y_rows", lambda p: _mixed(y=jnp.ones((2, 1))), ValueError, "y has shape (2, 1); expected (3, 1)"),
    Case(
        "tasks/mixed_loss_scale_vector",
        lambda p: _mixed(loss_scale=jnp.ones(2)),
        ValueError,
        "loss_scale has shape (2,); expected ()",
    ),
    Case("tasks/mixed_growth_interval_zero", lambda p: _mixed(0), ValueError, "growth_interval must be >= 1, got 0"),
    Case(
        "tasks/mixed_growth_interval_float",
        lambda p: _mixed(2.0),
        TypeError,
        "growth_interval must be a static Python int",
    ),
    Case(
        "tasks/mixed_int_params",
        lambda p: _mixed(params=_as(_MP["params"], jnp.int32)),
        TypeError,
        "params['b'] has dtype int32; expected a real floating-point array",
    ),
    Case(
        "tasks/mixed_bool_params",
        lambda p: _mixed(params=_as(_MP["params"], bool)),
        TypeError,
        "params['b'] has dtype bool",
    ),
    Case(
        "tasks/mixed_complex_params",
        lambda p: _mixed(params=_as(_MP["params"], jnp.complex64)),
        TypeError,
        "params['b'] has dtype complex64",
    ),
    Case(
        "tasks/mixed_complex_x",
        lambda p: _mixed(x=jnp.ones((3, 2), jnp.complex64)),
        TypeError,
        "x has dtype complex64; expected real numbers",
    ),
    Case(
        "tasks/mixed_empty_batch",
        lambda p: _mixed(x=jnp.ones((0, 2)), y=jnp.ones((0, 1))),
        ValueError,
        "x has 0 rows; expected at least one example",
    ),
    Case(
        "tasks/accumulate_not_divisible",
        lambda p: _accumulate(3),
        ValueError,
        "batch size 4 is not divisible by num_microbatches=3",
    ),
    Case("tasks/accumulate_zero_microbatches", lambda p: _accumulate(0), ValueError, "num_microbatches must be >= 1"),
    Case(
        "tasks/accumulate_w2_shape",
        lambda p: _accumulate(params={**_MLP, "w2": jnp.ones((4, 1))}),
        ValueError,
        "params['w2'] has shape (4, 1); expected (3, *)",
    ),
    Case(
        "tasks/accumulate_empty_batch",
        lambda p: _accumulate(x=jnp.ones((0, 2)), y=jnp.ones((0, 1))),
        ValueError,
        "batch size is 0",
    ),
    Case(
        "tasks/accumulate_int_params",
        lambda p: _accumulate(params=_as(_MLP, jnp.int32)),
        TypeError,
        "params['b1'] has dtype int32",
    ),
    Case(
        "tasks/clip_zero_max_norm",
        lambda p: tasks.clip_by_global_norm({"w": jnp.ones(2)}, 0.0),
        ValueError,
        "max_norm must be finite and > 0, got max_norm=0.0",
    ),
    Case(
        "tasks/clip_empty_tree",
        lambda p: tasks.clip_by_global_norm({}, 1.0),
        ValueError,
        "grads must have at least one leaf",
    ),
    Case(
        "tasks/clip_bool_leaf",
        lambda p: tasks.clip_by_global_norm({"w": jnp.ones(2, bool)}, 1.0),
        TypeError,
        "tree['w'] has dtype bool",
    ),
    Case(
        "tasks/residual_w2_not_square",
        lambda p: _residual(params={**_RES, "w2": jnp.ones((3, 1)), "b2": jnp.zeros(1)}),
        ValueError,
        "params['w2'] has shape (3, 1); expected (3, 2)",
    ),
    Case(
        "tasks/residual_missing_key",
        lambda p: _residual(params={k: v for k, v in _RES.items() if k != "b1"}),
        ValueError,
        "missing ['b1']",
    ),
    Case(
        "tasks/residual_empty_batch",
        lambda p: _residual(x=jnp.ones((0, 2)), y=jnp.ones((0, 2))),
        ValueError,
        "x has 0 rows",
    ),
    # leanstep.training
    Case(
        "trainer/lr_bool", lambda p: _train(p, lr=True), ValueError, "--lr must be a positive finite number, got True"
    ),
    Case(
        "trainer/weight_decay_text",
        lambda p: _train(p, weight_decay="0.1"),
        ValueError,
        "--weight-decay must be a finite number >= 0, got '0.1'",
    ),
    Case("trainer/out_empty", lambda p: _train(p, out=""), ValueError, "--out must be a non-empty path, got ''"),
]

# --- CLI ---------------------------------------------------------------------------------------

TINY = (*TINY_TRANSFORMER, "--microbatches", "2", *QUIET, "--steps", "3")


def _t(*flags: str, data: str = "{corpus}", out: str = "{tmp}/run") -> tuple[str, ...]:
    return ("train", *TINY, "--data", data, "--out", out, *flags)


def _solve(task: str, name: str) -> tuple[str, ...]:
    return ("solve", task, "--input", "{" + name + "}")


CLI = [
    # leanstep train: flags
    Case("train/steps_zero", _t("--steps", "0"), 2, "--steps must be an integer >= 1, got 0"),
    Case("train/batch_size_negative", _t("--batch-size", "-8"), 2, "--batch-size must be an integer >= 1, got -8"),
    Case(
        "train/batch_not_divisible", _t("--microbatches", "3"), 2, "--batch-size 8 is not divisible by --microbatches 3"
    ),
    Case("train/microbatches_zero", _t("--microbatches", "0"), 2, "--microbatches must be an integer >= 1, got 0"),
    Case("train/lr_nan", _t("--lr", "nan"), 2, "--lr must be a positive finite number, got nan"),
    Case("train/lr_zero", _t("--lr", "0"), 2, "--lr must be a positive finite number, got 0.0"),
    Case("train/lr_negative", _t("--lr=-1e-3"), 2, "--lr must be a positive finite number, got -0.001"),
    Case("train/lr_inf", _t("--lr", "inf"), 2, "--lr must be a positive finite number, got inf"),
    Case("train/lr_not_a_number", _t("--lr", "fast"), 2, "argument --lr: invalid float value: 'fast'"),
    Case("train/weight_decay_negative", _t("--weight-decay", "-1"), 2, "--weight-decay must be a finite number >= 0"),
    Case("train/weight_decay_nan", _t("--weight-decay", "nan"), 2, "--weight-decay must be a finite number >= 0"),
    Case(
        "train/max_grad_norm_zero",
        _t("--max-grad-norm", "0"),
        2,
        "--max-grad-norm must be a positive finite number or 'none', got 0.0",
    ),
    Case("train/max_grad_norm_nan", _t("--max-grad-norm", "nan"), 2, "--max-grad-norm must be a positive finite"),
    Case(
        "train/max_grad_norm_text",
        _t("--max-grad-norm", "big"),
        2,
        "argument --max-grad-norm: expected a positive number or 'none', got 'big'",
    ),
    Case(
        "train/precision_unknown_dtype", _t("--precision", "compute=bf17"), 2, "--precision: unknown dtype name 'bf17'"
    ),
    Case("train/precision_garbage", _t("--precision", "fast"), 2, "--precision: unknown dtype name 'fast'"),
    Case("train/precision_integer", _t("--precision", "compute=int8"), 2, "--precision: unknown dtype name 'int8'"),
    Case("train/remat_unknown", _t("--remat", "dot"), 2, "--remat: unknown policy='dot'"),
    Case("train/loss_scale_unknown", _t("--loss-scale", "bogus"), 2, "argument --loss-scale: invalid choice: 'bogus'"),
    Case(
        "train/initial_loss_scale_zero",
        _t("--initial-loss-scale", "0"),
        2,
        "--initial-loss-scale must be a positive finite number, got 0.0",
    ),
    Case(
        "train/initial_loss_scale_nan",
        _t("--initial-loss-scale", "nan"),
        2,
        "--initial-loss-scale must be a positive finite number, got nan",
    ),
    Case(
        "train/initial_loss_scale_above_max",
        _t("--initial-loss-scale", "1e30"),
        2,
        "--loss-scale: initial_scale must be in [min_loss_scale=1.0, max_loss_scale=16777216.0]",
    ),
    Case("train/schedule_unknown", _t("--schedule", "linear"), 2, "argument --schedule: invalid choice: 'linear'"),
    Case("train/warmup_negative", _t("--warmup-steps", "-1"), 2, "--warmup-steps must be an integer >= 0, got -1"),
    Case("train/seed_negative", _t("--seed", "-1"), 2, "--seed must be an integer >= 0, got -1"),
    Case("train/keep_checkpoints_zero", _t("--keep-checkpoints", "0"), 2, "--keep-checkpoints must be an integer >= 1"),
    Case(
        "train/max_consecutive_skips_zero",
        _t("--max-consecutive-skips", "0"),
        2,
        "--max-consecutive-skips must be an integer >= 1, got 0",
    ),
    Case("train/eval_every_zero", _t("--eval-every", "0"), 2, "--eval-every must be an integer >= 1, got 0"),
    Case("train/checkpoint_every_zero", _t("--checkpoint-every", "0"), 2, "--checkpoint-every must be an integer >= 1"),
    Case("train/stop_at_zero", _t("--stop-at", "0"), 2, "--stop-at must be an integer >= 1, got 0"),
    Case("train/size_unknown", _t("--size", "huge"), 2, "argument --size: invalid choice: 'huge'"),
    Case("train/model_unknown", _t("--model", "rnn"), 2, "argument --model: invalid choice: 'rnn'"),
    Case(
        "train/heads_not_dividing_width",
        _t("--heads", "3"),
        2,
        "--model transformer --size tiny --heads 3: TransformerConfig.d_model=16 must be divisible by n_heads=3",
    ),
    Case("train/d_model_zero", _t("--d-model", "0"), 2, "--d-model must be an integer >= 1, got 0"),
    Case("train/layers_fractional", _t("--layers", "2.5"), 2, "argument --layers: invalid int value: '2.5'"),
    Case("train/unknown_flag", _t("--learning-rate", "1"), 2, "unrecognized arguments: --learning-rate 1"),
    # leanstep train: data and run directory
    Case("train/data_missing", _t(data="/no/such/path"), 2, "--data path '/no/such/path' does not exist"),
    Case("train/data_empty_file", _t(data="{empty_file}"), 2, "--data file '{empty_file}' is empty"),
    Case(
        "train/data_empty_folder",
        _t(data="{empty_dir}"),
        2,
        "--data folder '{empty_dir}' holds no readable, non-empty text file",
    ),
    Case(
        "train/data_only_binary",
        _t(data="{binary_dir}"),
        2,
        "--data folder '{binary_dir}' holds no readable, non-empty text file",
    ),
    Case(
        "train/data_shorter_than_a_sequence",
        _t(data="{short_file}"),
        2,
        "--data '{short_file}': the training part has 5 bytes, fewer than the 17 needed",
    ),
    Case("train/data_unreadable", _t(data="/proc/self/mem"), 2, "--data file '/proc/self/mem' cannot be read"),
    Case("train/out_is_a_file", _t(out="{regular_file}"), 2, "--out '{regular_file}' exists and is not a directory"),
    Case(
        "train/out_under_a_file",
        _t(out="{regular_file}/run"),
        2,
        "--out '{regular_file}/run' cannot be created: '{regular_file}' is not a directory",
    ),
    Case("train/metrics_is_a_folder", _t(out="{metrics_dir_run}"), 2, "holds metrics.jsonl that is not a regular file"),
    Case(
        "train/out_already_holds_a_run",
        _t(out="{other_run}"),
        2,
        "--out '{other_run}' already holds a run; pass --resume",
    ),
    Case(
        "train/resume_without_a_run",
        _t("--resume", out="{empty_dir}"),
        2,
        "--resume: '{empty_dir}' holds no run (no config.json)",
    ),
    Case(
        "train/resume_other_config",
        _t("--resume", "--seed", "1", out="{other_run}"),
        2,
        "--resume: '{other_run}' belongs to a different config: --seed 0 (now 1)",
    ),
    Case(
        "train/resume_other_data",
        _t("--resume", out="{changed_data_run}"),
        2,
        "--resume: the data behind --data '{corpus}' changed since the run started",
    ),
    Case(
        "train/resume_malformed_config",
        _t("--resume", out="{malformed_run}"),
        2,
        "--resume: '{malformed_run}/config.json' is not readable JSON",
    ),
    Case(
        "train/resume_config_not_an_object",
        _t("--resume", out="{list_run}"),
        2,
        "--resume: '{list_run}/config.json' holds list; expected the JSON object",
    ),
    # leanstep solve
    Case("solve/unknown_task", ("solve", "bogus"), 2, "argument TASK: invalid choice: 'bogus'"),
    Case("solve/no_task", ("solve",), 2, "solve: a TASK is required"),
    Case(
        "solve/input_missing",
        ("solve", "global-norm-clipping", "--input", "/no/such.json"),
        2,
        "--input /no/such.json does not exist",
    ),
    Case(
        "solve/input_empty",
        _solve("global-norm-clipping", "empty_file"),
        2,
        "malformed JSON in {empty_file}: Expecting value",
    ),
    Case("solve/malformed_json", _solve("global-norm-clipping", "j_malformed"), 2, "malformed JSON in {j_malformed}"),
    Case(
        "solve/not_an_object",
        _solve("global-norm-clipping", "j_list"),
        2,
        "input: expected a JSON object with keys ['grads', 'max_norm'], got list",
    ),
    Case("solve/missing_key", _solve("global-norm-clipping", "j_missing"), 2, "input is missing key(s) ['max_norm']"),
    Case("solve/extra_key", _solve("global-norm-clipping", "j_extra"), 2, "input has unexpected key(s) ['z']"),
    Case(
        "solve/max_norm_zero",
        _solve("global-norm-clipping", "j_max_norm_zero"),
        2,
        "max_norm must be a positive finite number, got 0.0",
    ),
    Case(
        "solve/max_norm_nan",
        _solve("global-norm-clipping", "j_max_norm_nan"),
        2,
        "max_norm must be a positive finite number, got nan",
    ),
    Case("solve/ragged_array", _solve("global-norm-clipping", "j_ragged"), 2, "grads['w']: rows of different lengths"),
    Case(
        "solve/bool_in_array",
        _solve("global-norm-clipping", "j_bool"),
        2,
        "grads['w'][0]: expected a number or a nested list of numbers, got bool True",
    ),
    Case(
        "solve/nan_in_array",
        _solve("global-norm-clipping", "j_nan_leaf"),
        2,
        "grads['w'][0]: expected finite numbers, got nan",
    ),
    Case("solve/empty_grads", _solve("global-norm-clipping", "j_empty_grads"), 2, "grads must have at least one leaf"),
    Case(
        "solve/batch_not_divisible",
        _solve("gradient-accumulation", "j_ga_three"),
        2,
        "batch size 4 is not divisible by num_microbatches=3",
    ),
    Case(
        "solve/microbatches_fractional",
        _solve("gradient-accumulation", "j_ga_fraction"),
        2,
        "num_microbatches: expected an integer, got 1.5",
    ),
    Case("solve/x_shape", _solve("gradient-accumulation", "j_ga_shape"), 2, "x has shape (4, 2); expected (*, 1)"),
    Case(
        "solve/params_a_list",
        _solve("mixed-precision-step", "j_mp_list"),
        2,
        "params must be a dict with keys ['w', 'b'], got list",
    ),
    Case(
        "solve/growth_interval_zero",
        _solve("mixed-precision-step", "j_mp_gi0"),
        2,
        "growth_interval must be >= 1, got 0",
    ),
    Case(
        "solve/lr_nan",
        _solve("mixed-precision-step", "j_mp_lr_nan"),
        2,
        "lr must be a finite number, got nan",
    ),
    Case(
        "solve/loss_scale_zero",
        _solve("mixed-precision-step", "j_mp_ls_zero"),
        2,
        "loss_scale must be a positive finite number, got 0.0",
    ),
    Case(
        "solve/loss_scale_negative",
        _solve("mixed-precision-step", "j_mp_ls_negative"),
        2,
        "loss_scale must be a positive finite number, got -8.0",
    ),
    Case(
        "solve/loss_scale_inf",
        _solve("mixed-precision-step", "j_mp_ls_inf"),
        2,
        "loss_scale must be a positive finite number, got inf",
    ),
    Case(
        "solve/good_steps_negative",
        _solve("mixed-precision-step", "j_mp_good_negative"),
        2,
        "good_steps must be an integer >= 0, got -3",
    ),
    Case(
        "solve/example_out_of_range",
        ("solve", "global-norm-clipping", "--example", "99"),
        2,
        "--example: global-norm-clipping has examples 1 to 3, got 99",
    ),
    # leanstep report
    Case("report/missing_dir", ("report", "/no/such/run"), 2, "run directory not found: /no/such/run"),
    Case("report/a_file", ("report", "{regular_file}"), 2, "run directory not found: {regular_file}"),
    Case("report/no_metrics", ("report", "{empty_dir}"), 2, "metrics file not found: {empty_dir}/metrics.jsonl"),
    Case(
        "report/malformed_config",
        ("report", "{report_bad_config}"),
        2,
        "{report_bad_config}/config.json is not valid JSON",
    ),
    Case(
        "report/metrics_not_json",
        ("report", "{report_garbage}"),
        2,
        "{report_garbage}/metrics.jsonl:1 is not JSON: 'hello world'",
    ),
]

CATALOGUE = API + CLI


# --- files the cases point at -------------------------------------------------------------------

_GA = {
    "params": {"w1": [[1.0, 1.0]], "b1": [0.0, 0.0], "w2": [[1.0], [1.0]], "b2": [0.0]},
    "x": [[1.0], [2.0], [3.0], [4.0]],
    "y": [[0.0]] * 4,
    "num_microbatches": 2,
}
_MPJ = {
    "params": {"w": [[0.5], [-1.25]], "b": [0.1]},
    "x": [[1.0, 2.0], [0.5, -1.0]],
    "y": [[-1.9], [1.5]],
    "loss_scale": 1024.0,
    "good_steps": 0,
    "lr": 0.1,
    "growth_interval": 2,
}
_GRADS = {"grads": {"w": [1.0, 2.0]}, "max_norm": 1.0}
# Python's json writes NaN and Infinity tokens (and reads them back): the tokens bad input arrives as.
_JSON_INPUTS = {
    "j_malformed": '{"grads": {"w": [1, 2]}, ',
    "j_list": [1, 2],
    "j_missing": {"grads": {"w": [1.0]}},
    "j_extra": {**_GRADS, "z": 1},
    "j_max_norm_zero": {**_GRADS, "max_norm": 0},
    "j_max_norm_nan": {**_GRADS, "max_norm": float("nan")},
    "j_ragged": {**_GRADS, "grads": {"w": [[1.0], [1.0, 2.0]]}},
    "j_bool": {**_GRADS, "grads": {"w": [True]}},
    "j_nan_leaf": {**_GRADS, "grads": {"w": [float("nan")]}},
    "j_empty_grads": {**_GRADS, "grads": {}},
    "j_ga_three": {**_GA, "num_microbatches": 3},
    "j_ga_fraction": {**_GA, "num_microbatches": 1.5},
    "j_ga_shape": {**_GA, "x": [[1.0, 2.0]] * 4},
    "j_mp_list": {**_MPJ, "params": [{"w": [[0.5], [-1.25]]}, {"b": [0.1]}]},
    "j_mp_gi0": {**_MPJ, "growth_interval": 0},
    "j_mp_lr_nan": {**_MPJ, "lr": float("nan")},
    "j_mp_ls_zero": {**_MPJ, "loss_scale": 0.0},
    "j_mp_ls_negative": {**_MPJ, "loss_scale": -8.0},
    "j_mp_ls_inf": {**_MPJ, "loss_scale": float("inf")},
    "j_mp_good_negative": {**_MPJ, "good_steps": -3},
}


def _saved_run(root: Path, name: str, argv: tuple[str, ...], corpus_sha: str | None = None) -> Path:
    """A run directory holding only the config.json that ``leanstep train argv`` would write."""
    args = build_parser().parse_args(list(argv))
    run = root / name
    run.mkdir()
    config = RunConfig(**given_fields(args))  # the flags not given at RunConfig's defaults, as train reads them
    saved: dict[str, Any] = {"run": build_run(config).config.to_json()}  # --precision auto resolved, as train does
    if corpus_sha is not None:
        saved["corpus"] = {"data_sha256": corpus_sha}
    (run / "config.json").write_text(json.dumps(saved))
    return run


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-input")
    p: dict[str, Path] = {"tmp": root}
    p["corpus"] = root / "corpus"
    p["corpus"].mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "shlex.py", "fnmatch.py"):
        (p["corpus"] / name).write_bytes((stdlib / name).read_bytes())
    for name in ("empty_dir", "binary_dir", "metrics_dir_run"):
        p[name] = root / name
        p[name].mkdir()
    (p["binary_dir"] / "a.bin").write_bytes(b"\0\1\2")
    (p["metrics_dir_run"] / "metrics.jsonl").mkdir()
    for name, text in (("empty_file", ""), ("short_file", "abcd\n"), ("regular_file", "x")):
        p[name] = root / name
        p[name].write_text(text)
    for name, value in _JSON_INPUTS.items():
        p[name] = root / f"{name}.json"
        p[name].write_text(value if isinstance(value, str) else json.dumps(value))
    argv = tuple(a.format(**p) for a in _t(out="unused"))
    p["other_run"] = _saved_run(root, "other_run", argv)
    p["changed_data_run"] = _saved_run(root, "changed_data_run", argv, corpus_sha="0" * 64)
    for name, text in (("malformed_run", "{not json"), ("list_run", "[1, 2]")):
        p[name] = root / name
        p[name].mkdir()
        (p[name] / "config.json").write_text(text)
    record = {
        "kind": "train",
        "step": 1,
        "loss": 1.0,
        "grad_norm": 1.0,
        "loss_scale": 1.0,
        "skipped": False,
        "clipped": False,
        "consecutive_skips": 0,
        "tokens_per_sec": 1.0,
        "elapsed_s": 1.0,
        "lr": 1.0,
    }
    for name, metrics, config in (
        ("report_bad_config", json.dumps(record) + "\n", "{bad"),
        ("report_garbage", "hello world\n", None),
    ):
        p[name] = root / name
        p[name].mkdir()
        (p[name] / "metrics.jsonl").write_text(metrics)
        if config is not None:
            (p[name] / "config.json").write_text(config)
    return p


def _param(case: Case) -> Any:
    return pytest.param(case, id=case.id)


def test_the_catalogue_is_big_and_its_ids_unique():
    assert len(CATALOGUE) >= 40 and len({c.id for c in CATALOGUE}) == len(CATALOGUE)


@pytest.mark.parametrize("case", [_param(c) for c in CATALOGUE])
def test_bad_input_gets_a_clear_error(case: Case, paths: dict[str, Path], capsys):
    fragment = case.fragment.format(**{k: str(v) for k, v in paths.items()})
    if isinstance(case.call, tuple):
        argv = [a.format(**{k: str(v) for k, v in paths.items()}) for a in case.call]
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's own errors
            code = exit_.code
        captured = capsys.readouterr()
        assert (code, captured.out) == (case.expected, "")
        assert captured.err.count("\n") == 1 and captured.err.startswith("leanstep"), captured.err
        assert fragment in captured.err
        if case.call[0] == "train":  # nothing written for a run that never started
            out = Path(argv[argv.index("--out") + 1])
            assert not (out / "checkpoints").exists() and not (out.is_dir() and (out / "curves.png").exists())
    else:
        with pytest.raises(case.expected) as info:
            case.call(paths)
        assert fragment in str(info.value)
        # Raised by a leanstep check, not by JAX, NumPy or optax failing further in.
        assert "/leanstep/" in traceback.extract_tb(info.tb)[-1].filename
