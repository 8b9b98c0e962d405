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
wait. Torch's copy kernels and file I/O release the GIL, so the loop runs
meanwhile.

A thread beside the steps is not free where no core is spare (one decode
thread per core, as on a small host): every millisecond it copies is taken
from a step. So a paced copy (`paced=True`: the file copies, which come in
chunks, and the packing and unpacking of a transfer between nodes, layer by
layer) sleeps after each burst of about 1 ms of CPU (or one chunk: at most
1 MiB of a file, one layer of a network transfer) for as long as makes the
burst's CPU time `COPY_CPU_SHARE` of the whole: a step is never held by more
than a burst, and the steps around the copy lose at most that share of
their time.
The pre-copy takes longer for it (about its CPU time / the share), which the
request, still decoding at the source, does not see.
RAYLM_MIGRATION_COPY_CPU_SHARE sets the share (1: unpaced).

An import that waits for its source (a file not yet filled, an offer not yet
answered) can be cancelled: its migration was abandoned (the source died,
say), or the rank is closing. It then ends at once with an error instead of
holding its reserved blocks, or the rank's shutdown, for its whole timeout.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

logger = logging.getLogger(__name__)


def _copy_cpu_share() -> float:
    raw = os.environ.get("RAYLM_MIGRATION_COPY_CPU_SHARE", "").strip()
    try:
        share = float(raw) if raw else 0.05
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        raise ValueError(f"RAYLM_MIGRATION_COPY_CPU_SHARE must be a number in (0, 1], not {raw!r}")
    return share


COPY_CPU_SHARE = _copy_cpu_share()


class CopyPacer:
    """`pause` between a copy's chunks: once the thread has used `burst_s`
    of CPU since it last slept, sleeps so that this CPU time was `share` of
    the time since then. So a small copy (a short request's blocks, a tiny
    model's) runs at once, and a large one goes by bursts of about one
    chunk or `burst_s`, whichever is larger. Burst by burst: a copy that
    first waited (for its source's file) has no credit for the wait to
    spend in one go; the waiting's own CPU counts."""

    def __init__(self, share: float = COPY_CPU_SHARE, burst_s: float = 0.001):
        self.share = share
        self.burst_s = burst_s
        self._cpu_mark = time.thread_time()

    def pause(self) -> None:
        if self.share >= 1:
            return
        used = time.thread_time() - self._cpu_mark
        if used < self.burst_s:
            return
        time.sleep(used * (1 / self.share - 1))
        self._cpu_mark = time.thread_time()


def _paced(fn: Callable, *args, **kwargs):
    return fn(*args, pause=CopyPacer().pause, **kwargs)


class KVCopyJobs:
    def __init__(self):
        self._exports = ThreadPoolExecutor(1, thread_name_prefix="raylm-kv-export")
        self._imports = ThreadPoolExecutor(1, thread_name_prefix="raylm-kv-import")
        self._jobs: dict[str, Future] = {}  # imports, by name, until their outcome is taken
        self._cancels: dict[str, threading.Event] = {}  # set: the import's wait gives up

    def export(self, fn: Callable, *args, paced: bool = False) -> Future:
        """Run an export (a gather of filled blocks) beside the steps;
        `paced`: `fn` takes a `pause` to call between its chunks."""
        return self._exports.submit(_paced, fn, *args) if paced else self._exports.submit(fn, *args)

    def import_(self, name: str, fn: Callable, *args, paced: bool = False) -> None:
        """Run an import (into reserved blocks) beside the steps; its outcome:
        `finished`. `fn` takes a `cancelled` event (see `cancel`); `paced`:
        as for `export`."""
        cancelled = self._cancels[name] = threading.Event()
        runner = functools.partial(_paced, fn) if paced else fn
        self._jobs[name] = self._imports.submit(runner, *args, cancelled=cancelled)

    def cancel(self, names: list[str]) -> None:
        """Imports of `names` still waiting for their source give up (their
        outcome: an error); one already copying finishes its copy."""
        for name in names:
            event = self._cancels.get(name)
            if event is not None:
                event.set()

    def finished(self, names: list[str]) -> dict[str, list]:
        """The imports of `names` that have ended, each [ok, bytes or the error]; taken once."""
        done = {}
        for name in names:
            job = self._jobs.get(name)
            if job is None:
                done[name] = [False, "no such K/V copy on this rank"]
            elif job.done():
                del self._jobs[name]
                self._cancels.pop(name, None)
                error = job.exception()
                done[name] = [True, job.result()] if error is None else [False, f"{type(error).__name__}: {error}"]
        return done

    def close(self) -> None:
        self.cancel(list(self._cancels))  # no wait for a source outlives the rank
        self._exports.shutdown(wait=True, cancel_futures=True)
        self._imports.shutdown(wait=True, cancel_futures=True)
        self._jobs.clear()
        self._cancels.clear()
