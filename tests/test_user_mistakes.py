"""Mistakes a user makes with a loss's PRNG key and a pmap-written module, each one leanstep line
naming the argument (issue 41, item 16).

Before: a loss that takes a key without ``uses_rng`` (or ``uses_rng=True`` with a loss that takes
none) through a framework adapter got Python's bare arity ``TypeError`` from inside the adapter;
a Flax Dropout model trained without ``uses_rng`` got Flax's ``InvalidRngError``; a Linen
``nn.BatchNorm(axis_name="batch")`` applied without ``axis_name=`` (or with another name) got
JAX's "unbound axis name ... use shard_map", on one device and under a data mesh. Now each is a
``TypeError`` when the step is built (the signature) or a ``ValueError`` when it is traced,
naming ``uses_rng=``, the loss's signature or the module's ``axis_name=``.

The mesh cases run in a child process of 2 simulated CPU devices: this file is also its worker
script (``python tests/test_user_mistakes.py worker DIR``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # the worker: simulated devices before JAX starts
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import leanstep
from leanstep.frameworks import equinox as leqx
from leanstep.frameworks import linen as llinen
from leanstep.frameworks import nnx as lnnx

OPT = optax.sgd(0.1)
BATCH = {"x": jnp.arange(12.0).reshape(4, 3) / 12.0}
RAW_WORDS = ("missing 1 required positional", "positional arguments but", "InvalidRngError", "unbound axis name")


def leanstep_line(info: pytest.ExceptionInfo, kind: type) -> str:
    """The error's one line, checked: leanstep's own ``kind``, no raw error chained or quoted."""
    assert info.type is kind, info.value
    text = str(info.value)
    assert "\n" not in text and text, text
    error = info.value
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__), "raw error chained"
    assert not any(word in text for word in RAW_WORDS), text
    return text


# --- the loss's signature and uses_rng ---------------------------------------------------------------


def _linear():
    return eqx.nn.Linear(3, 1, key=jax.random.key(0))


class _NnxNet(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(3, 1, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.linear(x)


def _step_inputs(framework: str, takes_key: bool):
    """``(loss_fn, params, model_state, has_state)`` of a user's loss in ``framework``, with or without a key."""
    model_fn = (lambda m, b, key: jnp.mean(m(b["x"]) ** 2)) if takes_key else (lambda m, b: jnp.mean(m(b["x"]) ** 2))
    if framework == "equinox":
        params, static = leqx.split(_linear())
        vmapped = (
            (lambda m, b, key: model_fn(jax.vmap(m), b, key)) if takes_key else (lambda m, b: model_fn(jax.vmap(m), b))
        )
        return leqx.loss(static, vmapped), params, None, False
    if framework == "equinox_stateful":
        params, static = leqx.split(_linear())
        if takes_key:
            fn = lambda m, s, b, key: (jnp.mean(jax.vmap(m)(b["x"]) ** 2), s)
        else:
            fn = lambda m, s, b: (jnp.mean(jax.vmap(m)(b["x"]) ** 2), s)
        return leqx.stateful_loss(static, fn), params, {"count": jnp.zeros(())}, True
    if framework == "nnx":
        graphdef, params, model_state = lnnx.split(_NnxNet())
        return lnnx.loss(graphdef, model_fn), params, model_state, True
    # plain JAX
    dense = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
    loss_fn = (
        (lambda params, batch, key: dense(params, batch)) if takes_key else (lambda params, batch: dense(params, batch))
    )
    return loss_fn, {"w": jnp.ones((3, 1))}, None, False


FRAMEWORKS = ["plain", "equinox", "equinox_stateful", "nnx"]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_loss_that_takes_a_key_without_uses_rng_is_named_when_the_step_is_built(framework):
    loss_fn, _, _, has_state = _step_inputs(framework, takes_key=True)
    with pytest.raises(TypeError) as info:
        leanstep.make_train_step(loss_fn, has_state=has_state)
    text = leanstep_line(info, TypeError)
    assert "it takes a PRNG key last: pass uses_rng=True" in text, text
    assert "key) cannot be called as loss_fn(params, " in text, text  # the loss's signature, with its key


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_uses_rng_with_a_loss_that_takes_no_key_is_named_when_the_step_is_built(framework):
    loss_fn, _, _, has_state = _step_inputs(framework, takes_key=False)
    with pytest.raises(TypeError) as info:
        leanstep.make_train_step(loss_fn, has_state=has_state, uses_rng=True)
    text = leanstep_line(info, TypeError)
    assert "it takes no PRNG key: drop uses_rng=True" in text, text
    assert "batch) cannot be called as loss_fn(params, " in text and "batch, key) (uses_rng=True" in text, text


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("takes_key", [False, True])
def test_a_loss_that_fits_its_uses_rng_trains(framework, takes_key):
    """The reference: the same losses with the right setting build, trace and run."""
    loss_fn, params, model_state, has_state = _step_inputs(framework, takes_key)
    step = leanstep.make_train_step(loss_fn, has_state=has_state, uses_rng=takes_key, num_microbatches=2)
    state = leanstep.TrainState.create(params, OPT, model_state=model_state)
    _, metrics = step(state, BATCH)
    assert jnp.isfinite(metrics.loss)


def test_an_adapter_fn_that_takes_neither_form_is_named():
    _, static = leqx.split(_linear())
    with pytest.raises(TypeError) as info:
        leqx.loss(static, lambda model: 0.0)
    assert "must take (model, batch) or (model, batch, key), the model first" in leanstep_line(info, TypeError)


def test_a_key_with_a_default_fits_either_setting():
    _, static = leqx.split(_linear())
    loss_fn = leqx.loss(static, lambda m, b, key=None: jnp.mean(jax.vmap(m)(b["x"]) ** 2))
    leanstep.make_train_step(loss_fn)
    leanstep.make_train_step(loss_fn, uses_rng=True)


# --- a model that needs a key it is not handed ------------------------------------------------------


class _LinenDropout(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(2)(x))


def _linen_dropout_inputs():
    module = _LinenDropout()
    params, model_state = llinen.split(module.init(jax.random.key(0), BATCH["x"], train=False))
    return module, params, model_state


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_a_flax_dropout_model_trained_without_uses_rng_is_named(num_microbatches):
    module, params, model_state = _linen_dropout_inputs()

    def loss_fn(params, model_state, batch):  # the user forgot the key: no rngs=
        out, model_state = llinen.apply(module, params, model_state, batch["x"])
        return jnp.mean(out**2), model_state

    step = leanstep.make_train_step(loss_fn, has_state=True, num_microbatches=num_microbatches)
    state = leanstep.TrainState.create(params, OPT, model_state=model_state)
    with pytest.raises(ValueError) as info:
        step(state, BATCH)
    text = leanstep_line(info, ValueError)
    assert text.startswith('loss_fn\'s model needs a PRNG key (Dropout_0 needs PRNG for "dropout")'), text
    assert "pass uses_rng=True, so that leanstep passes loss_fn(params, model_state, batch, key)" in text, text
    assert "rngs={'dropout': key}" in text, text


def test_uses_rng_with_a_key_the_loss_does_not_hand_to_its_dropout_is_named():
    module, params, model_state = _linen_dropout_inputs()

    def loss_fn(params, model_state, batch, key):  # takes the key, forgets rngs=
        out, model_state = llinen.apply(module, params, model_state, batch["x"])
        return jnp.mean(out**2), model_state

    step = leanstep.make_train_step(loss_fn, has_state=True, uses_rng=True)
    state = leanstep.TrainState.create(params, OPT, model_state=model_state)
    with pytest.raises(ValueError) as info:
        step(state, BATCH)
    text = leanstep_line(info, ValueError)
    assert "uses_rng=True passes loss_fn one last; hand the key to the model" in text, text

    def handed(params, model_state, batch, key):  # the reference: the same loss, the key handed on
        out, model_state = llinen.apply(module, params, model_state, batch["x"], rngs={"dropout": key})
        return jnp.mean(out**2), model_state

    _, metrics = leanstep.make_train_step(handed, has_state=True, uses_rng=True)(state, BATCH)
    assert jnp.isfinite(metrics.loss)


def test_an_nnx_or_equinox_dropout_without_its_key_is_named():
    class NnxDropout(nnx.Module):
        def __init__(self):
            self.linear, self.dropout = nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.Dropout(0.5)  # no rngs of its own

        def __call__(self, x):
            return self.dropout(self.linear(x))

    graphdef, params, model_state = lnnx.split(NnxDropout())
    loss_fn = lnnx.loss(graphdef, lambda m, b: jnp.mean(m(b["x"]) ** 2))
    state = leanstep.TrainState.create(params, OPT, model_state=model_state)
    with pytest.raises(ValueError) as info:
        leanstep.make_train_step(loss_fn, has_state=True)(state, BATCH)
    assert "no `rngs` argument was provided to Dropout) and none is handed to it: pass uses_rng=True" in (
        leanstep_line(info, ValueError)
    )

    params, static = leqx.split(eqx.nn.Sequential([_linear(), eqx.nn.Dropout(0.5)]))
    loss_fn = leqx.loss(static, lambda m, b: jnp.mean(jax.vmap(m)(b["x"]) ** 2))
    with pytest.raises(ValueError) as info:
        leanstep.make_train_step(loss_fn)(leanstep.TrainState.create(params, OPT), BATCH)
    assert "(Dropout requires a key when running in non-deterministic mode) and none is handed" in (
        leanstep_line(info, ValueError)
    )


# --- a pmap-written Linen module's axis_name --------------------------------------------------------


class _PmapNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name="batch")(nn.Dense(4)(x))


def _axis_name_errors(mesh) -> dict:
    """For axis_name= None, "data" and "batch" (the module's): the error's type and text, or "trained"."""
    module = _PmapNet()
    params, model_state = llinen.split(module.init(jax.random.key(0), BATCH["x"]))
    found = {}
    for axis_name in (None, "data", "batch"):

        def loss_fn(params, model_state, batch, axis_name=axis_name):
            out, model_state = llinen.apply(module, params, model_state, batch["x"], axis_name=axis_name)
            return jnp.mean(out**2), model_state

        state = leanstep.TrainState.create(params, OPT, model_state=model_state)
        try:
            leanstep.make_train_step(loss_fn, has_state=True, mesh=mesh, num_microbatches=2)(state, BATCH)
            found[str(axis_name)] = "trained"
        except Exception as error:  # noqa: BLE001 - judged by the test
            chained = error.__cause__ is not None or not (error.__context__ is None or error.__suppress_context__)
            found[str(axis_name)] = [type(error).__name__, str(error), chained]
    return found


def _check_axis_name_errors(found: dict) -> None:
    assert found["batch"] == "trained"
    for given in ("None", "data"):
        kind, text, chained = found[given]
        assert kind == "ValueError" and "\n" not in text and not chained, found[given]
        assert not any(word in text for word in RAW_WORDS), text
        assert text.startswith("_PmapNet reduces over the axis name 'batch'"), text
        assert "pass axis_name='batch' to leanstep.frameworks.linen.apply (the module's axis_name=)" in text, text
    assert "(axis_name='data' was given: another name)" in found["data"][1]
    assert "was given" not in found["None"][1]


def test_a_linen_batchnorm_without_its_axis_name_is_named_on_one_device():
    _check_axis_name_errors(_axis_name_errors(None))


def test_a_linen_batchnorm_without_its_axis_name_is_named_under_a_data_mesh(tmp_path):
    from helpers.workers import run_worker  # tests/helpers/workers.py: pytest puts tests/ on the path

    found = run_worker(__file__, tmp_path, "axis_names.json")
    assert found.pop("devices") == 2
    _check_axis_name_errors(found)


def test_a_pmap_written_module_applied_directly_is_named_by_the_step():
    """Without leanstep's Linen adapter (module.apply called directly), the step names it all the same."""
    module = _PmapNet()
    variables = module.init(jax.random.key(0), BATCH["x"])

    def loss_fn(params, model_state, batch):
        out, updates = module.apply({"params": params, **model_state}, batch["x"], mutable=["batch_stats"])
        return jnp.mean(out**2), {**model_state, **updates}

    state = leanstep.TrainState.create(variables["params"], OPT, model_state={"batch_stats": variables["batch_stats"]})
    with pytest.raises(ValueError) as info:
        leanstep.make_train_step(loss_fn, has_state=True)(state, BATCH)
    assert leanstep_line(info, ValueError).startswith("loss_fn reduces over the axis name 'batch'")


def worker(out: Path) -> None:
    from leanstep.sharding.meshes import data_mesh

    found = {"devices": jax.device_count(), **_axis_name_errors(data_mesh())}
    (out / "axis_names.json").write_text(json.dumps(found))


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(Path(sys.argv[2]))
