"""What several test modules share that is not a fixture: models, reference steps, bit comparisons, worker launchers.

Test modules import them as ``from helpers.workers import run_worker``: pytest puts ``tests/`` on the
path (the rootdir-relative ``prepend`` import mode; ``tests/`` itself is no package). A fixture lives in
``tests/conftest.py`` instead.
"""
