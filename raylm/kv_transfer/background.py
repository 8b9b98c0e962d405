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
from a step. So the process's copies share one CPU budget (`CopyBudget`):
a paced copy (`paced=True`: the file copies, which come in chunks, and the
packing and unpacking of a transfer between nodes, layer by layer; and the
frames of a transfer between nodes, raylm.kv_transfer.network) waits between
its chunks while the CPU that all of them spent (sealing and sending
included) is more than `COPY_CPU_SHARE` of the time: a step is never held by more than a
burst of about 1 ms or a chunk, and the steps around the copies lose at
most that share of their time.
The pre-copy takes longer for it (about its CPU time / the share), which the
request, still decoding at the source, does not see.
RAYLM_MIGRATION_COPY_CPU_SHARE sets the share (1: unpaced).

An import that waits for its source (a file not yet filled, an offer not yet
answered) can be cancelled: its migration was abandoned (the source died,
say), or the rank is closing. It then ends at once with an error instead of
holding its reserved blocks, or the rank's shutdown, for its whole timeout.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from raylm.thread_accounting import name_this_thread, thread_cpu_s

logger = logging.getLogger(__name__)


# What the copies of a process may take, in all, of a core's time. Where no
# core is spare (benchmarks/history/migration.md, "Each host on its own core", "Where a
# pre-copy's steps lose their time" and "K/V across hosts: the seal"; ~111M
# bf16, 2k tokens, against the same batch before and after): with CURVE at
# 3%, a source's steps lost +3.5% and +7.2% in two runs across two hosts, a
# destination's +1.1 and +3.9%. With the sealed frames, which halved the
# source's CPU per byte, at 3% the source lost +4.5% and the destination
# +3.8% (a migration 1.1 s); at 2% the source +4.9 / +4.2% and the
# destination +1.4 / -1.0% in two runs (1.6-1.8 s, what CURVE took at 3%),
# the source waiting for a CPU 2.1% of the time; on one node +3.4 / -1.6%.
_DEFAULT_COPY_CPU_SHARE = 0.02


def _copy_cpu_share() -> float:
    raw = os.environ.get("RAYLM_MIGRATION_COPY_CPU_SHARE", "").strip()
    try:
        share = float(raw) if raw else _DEFAULT_COPY_CPU_SHARE
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        raise ValueError(f"RAYLM_MIGRATION_COPY_CPU_SHARE must be a number in (0, 1], not {raw!r}")
    return share


COPY_CPU_SHARE = _copy_cpu_share()


class CopyBudget:
    """The CPU of all of a process's copies beside its steps, held together
    within `share` of the wall time: every thread that copies is counted
    (the export and import threads, and, for a transfer between nodes, the
    K/V server's thread, which seals, and the ZMQ I/O threads that send and
    receive), and every copy waits between its chunks (`pause`, or `wait_s`
    where the caller waits its own way) while what they spent together is
    more than the share has paid for. One budget, not one per thread: each
    thread kept to the share on its own let a source that packed and
    encrypted, or a destination that decrypted, joined and unpacked (with
    CURVE, then), take two or three times the share from its steps (a
    2k-token stage across two hosts slowed them 7-11%).

    Spent CPU is a debt the passing time pays at `share` seconds a second,
    never below nothing (idle time saves no credit for a later burst): a
    copy goes on while the debt is at most `burst_s`, and otherwise waits
    until the debt is paid. So a small copy (a short request's blocks, a
    tiny model's) runs at once, and a large one goes by bursts of about one
    chunk or `burst_s`, whichever is larger."""

    def __init__(self, share: float | None = None, burst_s: float = 0.001, clock=time.monotonic, cpu_of=thread_cpu_s):
        self.share = COPY_CPU_SHARE if share is None else share
        self.burst_s = burst_s
        self._clock, self._cpu_of = clock, cpu_of
        self._lock = threading.Lock()
        self._cpu_s: dict[int, float] = {}  # counted thread -> its CPU seconds when last read
        self._allowances: dict[int, CPUAllowance] = {}  # counted thread -> what caps its count, if anything
        self._excused_s = 0.0  # CPU of counted threads that was no copy's (see `excuse`), not yet settled
        self._debt_s = 0.0
        self._read_at = clock()
        self.spent_s = 0.0  # the CPU counted in all

    def count(self, tids: list[int], allowance: CPUAllowance | None = None) -> None:
        """Count the CPU of the threads `tids` (of this process) from now on;
        with `allowance`, no more of it than that allows (threads that also
        do other work than copies: a listening socket's I/O threads)."""
        with self._lock:
            for tid in tids:
                cpu = self._cpu_of(tid)
                if cpu is not None:
                    self._cpu_s.setdefault(tid, cpu)
                    if allowance is not None:
                        self._allowances[tid] = allowance

    def excuse(self, cpu_s: float) -> None:
        """`cpu_s` that a counted thread spent on no copy (refusing a
        stranger's message, say) is not counted."""
        with self._lock:
            self._excused_s += cpu_s

    def count_this_thread(self) -> None:
        self.count([threading.get_native_id()])

    def forget(self, tids: list[int]) -> None:
        """Stop counting `tids` (threads about to end), what they spent so far kept."""
        with self._lock:
            self._settle()
            for tid in tids:
                self._cpu_s.pop(tid, None)
                self._allowances.pop(tid, None)

    def wait_s(self) -> float:
        """Seconds a copy should wait before its next chunk; 0: go on."""
        if self.share >= 1:
            return 0.0
        with self._lock:
            debt = self._settle()
        return 0.0 if debt <= self.burst_s else debt / self.share

    def pause(self) -> None:
        wait = self.wait_s()
        if wait > 0:
            time.sleep(wait)

    def _settle(self) -> float:
        now = self._clock()
        spent = 0.0
        for tid, before in list(self._cpu_s.items()):
            cpu = self._cpu_of(tid)
            if cpu is None:  # ended: what it spent since the last reading is not known
                del self._cpu_s[tid]
                self._allowances.pop(tid, None)
                continue
            allowance = self._allowances.get(tid)
            spent += max(0.0, cpu - before) if allowance is None else allowance.take(max(0.0, cpu - before))
            self._cpu_s[tid] = cpu
        excused = min(spent, self._excused_s)
        spent -= excused
        self._excused_s -= excused
        self.spent_s += spent
        self._debt_s = max(0.0, self._debt_s + spent - self.share * (now - self._read_at))
        self._read_at = now
        return self._debt_s


class CPUAllowance:
    """What counted threads may charge a budget for work they are given:
    `allow(s)` for each piece (a frame handed to a K/V socket's I/O thread:
    a bound on what sending it costs), and a reading of their CPU is counted
    up to what is allowed and not yet taken; the rest (`excess_s`) was
    other work. A K/V server's I/O threads also accept and refuse every
    stranger's connection (at 2k a second, 6-11% of a core here, three to
    five times the copies' whole share), which must not hold the copies
    back. What is not taken lapses `ttl_s` after the last allowance, so that
    an old transfer's unspent allowance does not pay for later refusals."""

    def __init__(self, ttl_s: float, clock=time.monotonic):
        self._ttl_s, self._clock = ttl_s, clock
        self._lock = threading.Lock()
        self._left_s = 0.0
        self._allowed_at = -math.inf
        self.excess_s = 0.0

    def allow(self, cpu_s: float) -> None:
        with self._lock:
            self._left_s += cpu_s
            self._allowed_at = self._clock()

    def take(self, spent_s: float) -> float:
        """The part of `spent_s` that is counted."""
        with self._lock:
            if self._clock() - self._allowed_at > self._ttl_s:
                self._left_s = 0.0
            counted = min(spent_s, self._left_s)
            self._left_s -= counted
            self.excess_s += spent_s - counted
            return counted


def no_wakeup_preemption(tid: int | None = None) -> None:
    """The thread `tid` (this one by default) runs as SCHED_BATCH: its
    wake-ups do not preempt a step that holds the core (Linux runs it when
    the step's time slice ends or the step waits), at its niceness.
    Elsewhere, or where not allowed, nothing."""
    _set_policy(tid or 0, "SCHED_BATCH")


def _set_policy(tid: int, policy: str) -> None:
    try:
        os.sched_setscheduler(tid, getattr(os, policy), os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, not allowed, or the thread is gone
        pass


class ThreadsBesideTheSteps:
    """Threads that copy for both kinds of stage (ZMQ's I/O threads, which
    send and receive the frames): SCHED_BATCH for a pre-copy, beside the
    steps; at the steps' own policy while a final stage needs them (`urgent`), whose
    request is paused meanwhile: a wake-up that waited for the step's time
    slice to end would stretch the pause. (A policy, not a niceness: a
    thread may go back from SCHED_BATCH, not to a lower niceness, without
    privileges.)"""

    def __init__(self, tids: list[int]):
        self.tids = list(tids)
        self._lock = threading.Lock()
        self._urgent = 0
        for tid in self.tids:
            no_wakeup_preemption(tid)

    def urgent_begin(self) -> None:
        with self._lock:
            self._urgent += 1
            if self._urgent == 1:
                for tid in self.tids:
                    _set_policy(tid, "SCHED_OTHER")

    def urgent_end(self) -> None:
        with self._lock:
            self._urgent -= 1
            if self._urgent == 0:
                for tid in self.tids:
                    no_wakeup_preemption(tid)


_process_budget: CopyBudget | None = None
_process_budget_lock = threading.Lock()


def process_copy_budget() -> CopyBudget:
    """This process's budget: every rank's copies beside the steps share the
    cores of the process (one rank per process here, as the executors place them)."""
    global _process_budget
    with _process_budget_lock:
        if _process_budget is None:
            _process_budget = CopyBudget()
        return _process_budget


class KVCopyJobs:
    def __init__(self, budget: CopyBudget | None = None):
        self.budget = budget or process_copy_budget()
        self._thread_ids: list[int] = []  # the two threads', counted in the budget
        self._exports = ThreadPoolExecutor(
            1, thread_name_prefix="raylm-kv-export", initializer=self._start_thread, initargs=("raylm-kv-export",)
        )
        self._imports = ThreadPoolExecutor(
            1, thread_name_prefix="raylm-kv-import", initializer=self._start_thread, initargs=("raylm-kv-import",)
        )
        self._jobs: dict[str, Future] = {}  # imports, by name, until their outcome is taken
        self._cancels: dict[str, threading.Event] = {}  # set: the import's wait gives up

    def _start_thread(self, name: str) -> None:
        name_this_thread(name)
        no_wakeup_preemption()
        self._thread_ids.append(threading.get_native_id())
        self.budget.count_this_thread()

    def export(self, fn: Callable, *args, paced: bool = False) -> Future:
        """Run an export (a gather of filled blocks) beside the steps;
        `paced`: `fn` takes a `pause` to call between its chunks."""
        if paced:
            return self._exports.submit(fn, *args, pause=self.budget.pause)
        return self._exports.submit(fn, *args)

    def import_(self, name: str, fn: Callable, *args, paced: bool = False) -> None:
        """Run an import (into reserved blocks) beside the steps; its outcome:
        `finished`. `fn` takes a `cancelled` event (see `cancel`); `paced`:
        as for `export`."""
        cancelled = self._cancels[name] = threading.Event()
        pacing = {"pause": self.budget.pause} if paced else {}
        self._jobs[name] = self._imports.submit(fn, *args, cancelled=cancelled, **pacing)

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
        self.budget.forget(self._thread_ids)
        self._jobs.clear()
        self._cancels.clear()
