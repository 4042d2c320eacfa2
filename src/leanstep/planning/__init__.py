"""Choosing a step's settings before training: for one device, and for a cluster.

.. code-block:: text

    one_device.py    plan(): the fastest setting that fits a memory budget, by compiling
    cluster.py       plan_cluster(): mesh shapes and settings for N devices, priced
    cluster_grid.py  the cluster's search space: meshes, families, settings
    candidates.py    shared steps: abstract stand-ins, one candidate's memory, bisection
    records.py       the typed rows a plan reports
    cost_model.py    Accelerator, step_cost: a stated model of time on other hardware
"""

from leanstep.planning.cluster import plan_cluster
from leanstep.planning.cost_model import ACCELERATORS, Accelerator, get_accelerator
from leanstep.planning.one_device import BudgetError, Candidate, Plan, Setting, plan, settings_grid

__all__ = [
    "ACCELERATORS",
    "Accelerator",
    "BudgetError",
    "Candidate",
    "Plan",
    "Setting",
    "get_accelerator",
    "plan",
    "plan_cluster",
    "settings_grid",
]
