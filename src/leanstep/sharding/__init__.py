"""Meshes and where arrays live on them: axis roles, partition rules, the batch, processes.

.. code-block:: text

    meshes.py           mesh_axes (roles by name), data_mesh, batch_sharding, shard_batch
    partition_rules.py  MeshAxes, param_specs: which parameter dimension splits over which axis
    model_sharding.py   constrain, gathered, sharding_context: layouts inside a model
    distributed.py      devices and processes, set up before JAX starts its backend

The train state's layout and the step's sharding layer are the step's
(:mod:`leanstep.step.state_sharding`, :mod:`leanstep.step.sharding_layer`): this package
knows meshes and arrays, not the step.
"""

from leanstep.sharding.meshes import batch_sharding, check_mesh, data_mesh, fsdp_partition_spec, mesh_axes, shard_batch
from leanstep.sharding.model_sharding import constrain, gathered, sharding_context
from leanstep.sharding.partition_rules import MeshAxes, param_specs

__all__ = [
    "MeshAxes",
    "batch_sharding",
    "check_mesh",
    "constrain",
    "data_mesh",
    "fsdp_partition_spec",
    "gathered",
    "mesh_axes",
    "param_specs",
    "shard_batch",
    "sharding_context",
]
