"""What every layer of leanstep uses: argument checks, files, memory sizes, jaxpr walking.

.. code-block:: text

    checks.py        argument checks that name the argument and the expected form
    files.py         files a user names: bounded reads, atomic writes, output paths
    memory_sizes.py  "512MiB", "1.5GB": parsed and shown
    jaxprs.py        where the sub-programs of a jaxpr equation live
    removed.py       the keywords removed in 0.12 and the names moved off the top, with their new spelling

Nothing here is public API; the modules import nothing else of leanstep's.
"""
