"""Programs inspected without running them: the audit, FLOPs, residuals, HLO and collectives.

.. code-block:: text

    auditing.py       audit(step, state, batch): what a traced step does, as a report
    audit_records.py  the audit's typed findings
    flops.py          FLOPs of a traced program, loop bodies times their trip counts
    residuals.py      what reverse-mode autodiff saves for the backward pass, and its bytes
    hlo_text.py       a reader for XLA's optimized HLO text
    collectives.py    every collective of a compiled step: kind, bytes, axes, trips
    memory_spaces.py  device and host bytes of a compiled step, its transfers; offload refusals
"""

from leanstep.inspection.auditing import AuditReport, audit
from leanstep.inspection.collectives import Collective, CollectivesReport, collectives_report
from leanstep.inspection.flops import count_flops
from leanstep.inspection.memory_spaces import MemorySpaceReport, Transfers, check_offload, memory_space_report
from leanstep.inspection.residuals import ResidualReport, saved_residuals_report

__all__ = [
    "AuditReport",
    "Collective",
    "CollectivesReport",
    "MemorySpaceReport",
    "ResidualReport",
    "Transfers",
    "audit",
    "check_offload",
    "collectives_report",
    "count_flops",
    "memory_space_report",
    "saved_residuals_report",
]
