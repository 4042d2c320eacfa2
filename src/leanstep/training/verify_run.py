"""verify applied to a :class:`RunConfig` (``leanstep verify``): the run's step, on the run's data.

The setup is the run's own parts (:func:`leanstep.training.build.build_run`): its model,
precision, loss scale, masters, remat policy and microbatch count, on the first batch of its
data. Its loss is the model's token-weighted form (``loss_sum``, with a token-weight ``mask`` of
ones added to the batch), which on such a batch equals the mean ``leanstep train`` minimises and
lets the token-weighting and non-finite checks reweight and poison rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from leanstep.blocks.loss_contract import LossContract
from leanstep.training.build import build_run
from leanstep.training.config import RunConfig
from leanstep.training.data import BatchSampler, load_corpus
from leanstep.verification import LeanstepStep, VerifyReport, verify_step

__all__ = ["verify_run", "verify_setup"]


def verify_setup(config: RunConfig) -> LeanstepStep:
    """The :class:`leanstep.verification.LeanstepStep` of ``config`` (see the module doc).

    Example:
      >>> setup = verify_setup(RunConfig(model="mlp", size="tiny", batch_size=4, seq_len=8, microbatches=2))
      >>> setup.batch["tokens"].shape, setup.batch["mask"].shape, setup.mask
      ((4, 9), (4, 8), 'mask')
    """
    run = build_run(config)
    corpus = load_corpus(config.data, seq_len=config.seq_len)
    batch: dict[str, Any] = dict(BatchSampler(corpus.train, config.batch_size, config.seq_len, config.seed).batch_at(0))
    batch["mask"] = np.ones((config.batch_size, config.seq_len), np.float32)
    model = run.model

    def make_loss_fn(policy: str) -> Any:
        return lambda params, rows: model.loss_sum(params, rows, remat_policy=policy)

    return LeanstepStep(
        make_loss_fn,
        run.init_params(),
        batch,
        precision=run.precision,
        num_microbatches=config.microbatches,
        remat=config.remat,
        loss=LossContract(token_weighted=True),
        loss_scale=run.loss_scale,
        master=config.master,
        moments=config.moments,
        mask="mask",
    )


def verify_run(config: RunConfig, *, checks: Sequence[str] | None = None) -> VerifyReport:
    """Runs verify's checks on the step ``config`` trains with (microbatches: the config's, at least 2).

    Raises:
      ValueError: an invalid config, naming the flag.
    """
    config.validate()
    setup = verify_setup(config)
    microbatches = config.microbatches
    if microbatches == 1:  # the checks need microbatches to compare; take the smallest count the batch allows
        microbatches = next((m for m in range(2, config.batch_size + 1) if config.batch_size % m == 0), 1)
        setup = verify_setup(dataclasses.replace(config, microbatches=microbatches))
    name = (
        f"leanstep train --model {config.model} --size {config.size} --batch-size {config.batch_size} "
        f"--precision {setup.precision} --microbatches {microbatches} --remat {config.remat}"
        + (f" --fp8 {config.fp8}" if config.fp8 != "none" else "")
    )
    return verify_step(setup, num_microbatches=microbatches, checks=checks, name=name)
