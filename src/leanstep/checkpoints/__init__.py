"""Checkpoints that survive a kill: written atomically, verified, restored to any layout.

.. code-block:: text

    checkpointer.py  Checkpointer: save (in the background too), restore, retention (orbax underneath)
    errors.py        CheckpointError, and one line for a failed orbax write
    layout.py        the folders of a checkpoint directory, and what is committed
    manifest.py      what each checkpoint holds, with checksums
    trees.py         a train state as savable trees, and back
"""

from leanstep.checkpoints.checkpointer import Checkpointer, CheckpointError, RestoreResult

__all__ = ["CheckpointError", "Checkpointer", "RestoreResult"]
