"""A near miss is named with what was meant (issue 57, item 12): a misspelt ``make_train_step``
keyword, ``optax.MultiSteps`` given whole, ``--data @PYTHON``, and a mean loss given
``token_weighted=True``. Before, each got a message that named none of it: ``StepSpec.from_keywords()
got an unexpected keyword argument``, ``got MultiSteps``, ``--data path '@PYTHON' does not exist``
and ``got LinearizeTracer``."""

from __future__ import annotations

import traceback

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from leanstep import TrainState, make_train_step
from leanstep.training.data import load_corpus

PARAMS = {"w": jnp.zeros((2, 1))}
BATCH = {"x": jnp.ones((4, 2)), "mask": jnp.ones((4, 1))}


def _mean_loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - 1.0) ** 2)


def _raised_by_leanstep(info: pytest.ExceptionInfo) -> bool:
    return "/leanstep/" in traceback.extract_tb(info.tb)[-1].filename and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("keyword", "said"),
    [
        ("num_microbatche", "did you mean num_microbatches=?"),
        ("tokenweighted", "did you mean token_weighted=?"),
        ("max_norm", "did you mean max_grad_norm=?"),
        ("optimizer", "make_train_step takes no optimizer since leanstep 0.8: give it once, to TrainState.create"),
        ("colour", "it takes precision=, num_microbatches=, "),
    ],
)
def test_a_keyword_make_train_step_does_not_take_is_named_with_the_nearest_it_takes(keyword, said):
    with pytest.raises(TypeError) as info:
        make_train_step(_mean_loss, **{keyword: 2})
    assert str(info.value).startswith(f"make_train_step() got an unexpected keyword argument {keyword!r}; {said}")
    assert _raised_by_leanstep(info)


def test_optax_multisteps_given_whole_names_its_gradient_transformation():
    accumulating = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    with pytest.raises(TypeError, match=r"got MultiSteps; pass its \.gradient_transformation\(\)") as info:
        TrainState.create(PARAMS, accumulating)
    assert _raised_by_leanstep(info)
    # What it names works: the second call applies the two calls' mean gradient.
    state = TrainState.create(PARAMS, accumulating.gradient_transformation())
    step = make_train_step(_mean_loss)
    state, _ = step(state, BATCH)
    np.testing.assert_array_equal(state.params["w"], PARAMS["w"])  # the first call only accumulates
    state, _ = step(state, BATCH)
    # d/dw mean((x @ w - 1)^2) at w = 0 is 2 * mean(x * -1) = -2 per entry; sgd(0.1) moves w by +0.2.
    np.testing.assert_allclose(state.params["w"], np.full((2, 1), 0.2), rtol=1e-6)


@pytest.mark.parametrize("data", ["@PYTHON", "@Python", "@pyhton"])
def test_an_at_name_that_is_not_python_names_at_python(data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no file of that name here
    with pytest.raises(ValueError) as info:
        load_corpus(data)
    assert str(info.value) == (
        f"--data path {data!r} does not exist; the one corpus named with @ is @python, in lower case (the "
        "installed packages' Python source), else expected a text file or a folder of text files"
    )


def test_a_path_that_starts_with_at_and_exists_is_read_as_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "@PYTHON").write_bytes(b"print('a file of that name')\n" * 40)
    assert load_corpus("@PYTHON").source.endswith("@PYTHON")


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_a_mean_loss_given_token_weighted_is_named_a_scalar_a_mean(num_microbatches):
    step = make_train_step(_mean_loss, token_weighted=True, num_microbatches=num_microbatches)
    with pytest.raises(TypeError) as info:
        step(TrainState.create(PARAMS, optax.sgd(0.1)), BATCH)
    assert str(info.value) == (
        "token_weighted=True: loss_fn must return (loss_sum, count), got a scalar (a mean? return "
        "(jnp.sum(losses * mask), jnp.sum(mask)))"
    )
    assert _raised_by_leanstep(info)


def test_a_loss_of_another_shape_is_said_in_words_not_by_its_tracer():
    step = make_train_step(lambda params, batch: batch["x"] @ params["w"], has_aux=True)
    with pytest.raises(TypeError) as info:
        step(TrainState.create(PARAMS, optax.sgd(0.1)), BATCH)
    assert str(info.value) == "has_aux=True: loss_fn must return (loss, aux), got an array of shape (4, 1)"
