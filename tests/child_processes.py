"""A multiprocessing context for a test's own child processes (the ones that
run a test function in another process, as a rank or a peer would)."""

from __future__ import annotations

import multiprocessing

# What such a child imports anyway: the server imports it once for them all.
PRELOAD = [
    "torch",
    "pytest",
    "raylm.distributed.parallel_state",
    "raylm.distributed.shm_broadcast",
    "raylm.messages",
    "raylm.model.loader",
]


def preloaded_spawn_context():
    """Each child is forked from a server that imported torch once, instead
    of being a fresh interpreter that imports it again (seconds a child on
    two busy cores). A child still shares nothing with the test process but
    what it is handed: the server is a clean interpreter, started from this
    process's environment at its first use; pass what a child needs in its
    arguments. Kept light (no tests.conftest): every child imports the
    module of its target, and so this one."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context
