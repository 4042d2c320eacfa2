"""Choosing a step's settings before training: for one device, and for a cluster.

.. code-block:: text

    one_device.py      plan(): the fastest setting that fits a memory budget, by compiling
    one_device_grid.py the settings it tries: a SearchSpace's grid (microbatch bounds) or those given
    search_options.py  SearchSpace, SearchOptions: what a plan tries and how it searches
    cluster.py         plan_cluster(): mesh shapes and settings for N devices, priced
    cluster_grid.py    the cluster's candidates: meshes, layouts, families and their bounds
    cluster_search.py  the cluster search: a state and pure steps (next group, prune, record)
    cluster_compile.py the cluster's compiles: meshes laid out, one candidate priced
    plan_inputs.py     params and model state, or builders of them, per policy; the batch-statistics note
    eager_state.py     the note when the state fits only if made in one program (TrainState.create_from)
    fp8_sizes.py       an FP8 run: the FP8 state sized, its matmul operands counted at one byte
    candidates.py      shared steps: abstract stand-ins, one candidate's memory, bisection
    records.py         the typed rows a plan reports
    cost_model.py      Accelerator, step_cost: a stated model of time on other hardware
"""

from leanstep.planning.cluster import plan_cluster
from leanstep.planning.cost_model import ACCELERATORS, Accelerator, get_accelerator
from leanstep.planning.one_device import BudgetError, Candidate, Plan, Setting, plan, settings_grid
from leanstep.planning.search_options import SearchOptions, SearchSpace

__all__ = [
    "ACCELERATORS",
    "Accelerator",
    "BudgetError",
    "Candidate",
    "Plan",
    "SearchOptions",
    "SearchSpace",
    "Setting",
    "get_accelerator",
    "plan",
    "plan_cluster",
    "settings_grid",
]
