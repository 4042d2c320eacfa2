"""leanstep's step as verify drives it (:class:`leanstep.verification.LeanstepStep`): built from a StepSpec.

The reference for "the step is the spec's" is the program :func:`leanstep.make_train_step` compiles
from the spec written out by hand, with what the checks set themselves (module doc of
``leanstep_step``); before issue 60 the setup re-spelled nine settings in twelve keywords.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import leanstep
from leanstep.blocks.accumulation import Accumulation
from leanstep.verification import LeanstepStep, ModelExtras, probe_optimizer, verify

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)}
BATCH = {"x": np.linspace(-1.0, 1.0, 24, dtype=np.float32).reshape(8, 3), "y": np.ones((8, 2), np.float32)}
#: A run's spec with every kind of field: what the step takes, and what the checks set themselves.
RUN = leanstep.StepSpec(
    "compute=bfloat16", accumulation=Accumulation(2, "strided"), max_grad_norm=3.0, loss_scale="dynamic",
    master="bfloat16-sr", moments="int8", spike_guard="on", update_chunk=None, donate=True,
)  # fmt: skip


def make_loss(policy):
    return lambda params, batch: jnp.mean((jnp.tanh(batch["x"] @ params["w"]) - batch["y"]) ** 2)


def test_the_setup_takes_a_spec_and_at_most_eight_parameters():
    names = list(inspect.signature(LeanstepStep).parameters)
    assert names == ["make_loss_fn", "params", "batch", "spec", "remat", "model_state", "mask", "extras"]


def test_the_step_is_the_spec_s_with_the_checks_own_settings():
    setup = LeanstepStep(make_loss, PARAMS, BATCH, RUN)
    assert (setup.precision, setup.num_microbatches, setup.split) == (RUN.precision, 2, "strided")
    bound = setup.init(probe_optimizer(), max_grad_norm=0.5, seed=0, randomness=True, mesh=None)
    state = bound.train_state
    assert state.master == "bfloat16-sr" and float(state.loss_scale.loss_scale) == 2.0**15  # the spec's
    assert state.spike is None  # no guard: every step a check compares is applied
    # The probe's record kept exact: the moments stay float32 (int8 would quantize the recorded gradient).
    assert {leaf.dtype for leaf in jax.tree.leaves(state.opt_state)} <= {jnp.dtype("float32"), jnp.dtype("int32")}
    # The program: the spec's, its clip the check's, four microbatches, not donated, no guard or int8 moments.
    expected = RUN.replace(
        accumulation=Accumulation(4, "strided"), max_grad_norm=0.5, donate=False, spike_guard=None, moments="float32"
    )
    lowered = setup.make_step(bound.settings, 4).lower(state, BATCH).as_text()
    assert lowered == leanstep.make_train_step(make_loss("none"), expected).lower(state, BATCH).as_text()
    assert (
        lowered
        != leanstep.make_train_step(make_loss("none"), expected.replace(max_grad_norm=1.0))
        .lower(state, BATCH)
        .as_text()
    )


def test_a_variant_changes_only_what_it_names():
    setup = LeanstepStep(make_loss, PARAMS, BATCH, RUN, remat="full", mask=None, extras=ModelExtras(rules=()))
    wide = setup.variant(compute_dtype="float32")
    assert wide.compute_dtype == jnp.float32 and wide.spec == setup.spec.replace(precision=wide.precision)
    assert (wide.remat, wide.rules) == ("full", ())


def test_verify_takes_the_spec_or_the_keywords_that_make_it():
    checks = ("accumulation",)
    by_spec = verify(make_loss, PARAMS, BATCH, leanstep.StepSpec(accumulation=Accumulation(4)), checks=checks)
    by_keywords = verify(make_loss, PARAMS, BATCH, num_microbatches=4, checks=checks)
    assert by_spec.setup == by_keywords.setup and ", M=4, remat none)" in by_spec.setup
    assert by_spec["accumulation"].largest == by_keywords["accumulation"].largest and by_spec.passed
    with pytest.raises(TypeError, match="verify got a spec and the keywords num_microbatches: give the step's"):
        verify(make_loss, PARAMS, BATCH, leanstep.StepSpec(), num_microbatches=4, checks=checks)
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_microbatch'; did you mean num_microbatches"):
        verify(make_loss, PARAMS, BATCH, num_microbatch=4, checks=checks)


def test_0_11_s_keywords_name_the_spec():
    with pytest.raises(TypeError, match=r"LeanstepStep\(precision=\) takes its step settings in its spec"):
        LeanstepStep(make_loss, PARAMS, BATCH, precision="float32")
    with pytest.raises(TypeError, match="spec must be a leanstep.StepSpec or None, got int"):
        LeanstepStep(make_loss, PARAMS, BATCH, 2)
    with pytest.raises(ValueError, match="expected the split 'contiguous' or 'strided', got 'presplit'"):
        LeanstepStep(make_loss, PARAMS, BATCH, leanstep.StepSpec(accumulation=Accumulation(2, "presplit")))
