"""A rank's K/V copies that run beside its steps (the overlapped pre-copy of
live migration, raylm.engine.core_migration).

A migration's stages before the last copy blocks that no step writes: at the
source, blocks the request has filled (a full block never changes again); at
the destination, blocks reserved for the import, which no request of its own
holds. So those copies run on threads of the rank's while its loop keeps
stepping, and only the final stage (the request paused) copies on the loop.

Exports and imports have a thread each: an import may wait on another rank's
export (its file not yet written, its offer not yet packed), and two cores
that migrate to each other must not each hold their one thread in such a
wait. Torch's copy kernels release the GIL, so the loop runs meanwhile.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

logger = logging.getLogger(__name__)


class KVCopyJobs:
    def __init__(self):
        self._exports = ThreadPoolExecutor(1, thread_name_prefix="raylm-kv-export")
        self._imports = ThreadPoolExecutor(1, thread_name_prefix="raylm-kv-import")
        self._jobs: dict[str, Future] = {}  # imports, by name, until their outcome is taken

    def export(self, fn: Callable, *args) -> Future:
        """Run an export (a gather of filled blocks) beside the steps."""
        return self._exports.submit(fn, *args)

    def import_(self, name: str, fn: Callable, *args) -> None:
        """Run an import (into reserved blocks) beside the steps; its outcome: `finished`."""
        self._jobs[name] = self._imports.submit(fn, *args)

    def finished(self, names: list[str]) -> dict[str, list]:
        """The imports of `names` that have ended, each [ok, bytes or the error]; taken once."""
        done = {}
        for name in names:
            job = self._jobs.get(name)
            if job is None:
                done[name] = [False, "no such K/V copy on this rank"]
            elif job.done():
                del self._jobs[name]
                error = job.exception()
                done[name] = [True, job.result()] if error is None else [False, f"{type(error).__name__}: {error}"]
        return done

    def close(self) -> None:
        self._exports.shutdown(wait=True, cancel_futures=True)
        self._imports.shutdown(wait=True, cancel_futures=True)
        self._jobs.clear()
