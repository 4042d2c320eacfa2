"""The tiny runs the tests train, defined once: their shapes, and the run ``tiny_run`` is a copy of.

A test spells out only what it adds (``[*TINY_MLP, "--steps", "6"]``), so that what a run of the
suite is, and what one test changes, are each said in one place.
"""

from __future__ import annotations

#: The smallest run that trains: an MLP on 4 rows of 8 tokens, which compiles in about a second.
#: A test that needs a run, not the model users train, trains this.
TINY_MLP = ("--model", "mlp", "--size", "tiny", "--batch-size", "4", "--seq-len", "8")

#: The tiny transformer (the default model) on 8 rows of 16 tokens.
TINY_TRANSFORMER = ("--size", "tiny", "--batch-size", "8", "--seq-len", "16")

#: No live progress and no chart: they cost seconds and are not what a test is about.
QUIET = ("--no-progress", "--no-chart")

#: The run every ``tiny_run`` (tests/conftest.py) copies: 2 microbatches of 4 rows, evaluated and
#: checkpointed every 10 steps; ``--steps``, ``--data`` and ``--out`` are added where it is trained.
TINY_RUN_FLAGS = (
    *TINY_TRANSFORMER,
    "--microbatches",
    "2",
    "--eval-every",
    "10",
    "--eval-batches",
    "2",
    "--checkpoint-every",
    "10",
    *QUIET,
    "--lr",
    "1e-2",
    "--warmup-steps",
    "5",
)
TINY_RUN_STEPS = 30

#: The ``tiny_corpus``: six modules of the standard library, real text of about 80 KB.
TINY_CORPUS_FILES = ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py")
