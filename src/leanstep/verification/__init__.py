"""``leanstep verify``: metamorphic checks of a training setup against itself, as a report.

.. code-block:: text

    protocol.py        VerifiableStep: what a step must offer (init, step, parts, poison); the probe
    leanstep_step.py   LeanstepStep: leanstep's own step, from the inputs leanstep.planning.plan takes and a
                       StepSpec; ModelExtras: the model's partition rules and LayerStack
    bounds.py          the tolerances, derived (unit roundoff, gamma_n, probabilistic norm bound)
    trees.py           named leaves, bitwise comparison, the worst element against a bound
    batches.py         the batches the checks build: microbatch rows, uneven token counts, poison
    gradient_checks.py accumulation, M against one, token weighting: against float64 references
    clip_check.py      clipping at half the float64 full-batch norm
    reference_check.py the step against the loss's own float32 gradient, computed without the step
    state_checks.py    a forced non-finite step, microbatch keys, FP8 state reduction
    int8_checks.py     int8 matmuls: against the step without them, M against one and meshes in float32
    program_checks.py  compute dtype of every matmul, what the remat policy saves (the audit)
    mesh_check.py      each mesh layout against one device
    in_backward_check.py  the update inside the backward pass against the standard step (a LayerStack loss)
    report.py          CheckResult, VerifyReport (table and JSON)
    runner.py          verify (leanstep inputs) and verify_step (any VerifiableStep)
"""

from leanstep.verification.leanstep_step import LeanstepStep, ModelExtras
from leanstep.verification.protocol import PARTS, ProbeState, VerifiableStep, probe_optimizer, seen_gradient
from leanstep.verification.report import CheckResult, VerifyReport
from leanstep.verification.runner import CHECKS, verify, verify_step

__all__ = [
    "CHECKS",
    "PARTS",
    "CheckResult",
    "LeanstepStep",
    "ModelExtras",
    "ProbeState",
    "VerifiableStep",
    "VerifyReport",
    "probe_optimizer",
    "seen_gradient",
    "verify",
    "verify_step",
]
