"""Linux thread accounting: a process's threads (their ids, names, CPU
time, and the time they waited for a CPU), read from /proc and the
per-thread CPU clocks. Used by the placement's thread governance
(raylm.worker.cpu_placement: the run-queue wait it governs by, the threads
it pins) and by the K/V copies beside the steps (raylm.kv_transfer: the CPU
budget that paces them, the names their threads show). Elsewhere than
Linux, each reading says nothing (None, 0 or no threads)."""

from __future__ import annotations

import os
import sys
import threading
import time


def thread_ids() -> list[int]:
    """This process's threads (Linux task ids; none where /proc is missing)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return []


def process_run_queue_wait_s() -> float:
    """Seconds this process's threads have spent runnable but off a CPU, in
    all; 0 where Linux does not say (the governor then never sees contention)."""
    return _schedstat_s(thread_ids(), 1)


def name_thread(tid: int, name: str) -> None:
    """Give the thread `tid` of this process `name` (15 bytes at most) where
    the OS shows it (top -H, ps -L, /proc/.../comm): Python names its
    threads only for itself, and a thread beside the steps should be told
    from the loop when one looks where a process's CPU goes. Linux only;
    elsewhere, or for a thread gone, nothing."""
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def name_this_thread(name: str) -> None:
    name_thread(threading.get_native_id(), name)


def thread_name(tid: int) -> str | None:
    """The name the OS shows for the thread `tid` of this process; None once it ended."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def thread_cpu_s(tid: int) -> float | None:
    """Seconds the thread `tid` of this process has run on a CPU; None once it
    has ended (or off Linux). Read from the thread's CPU-time clock (the
    clock id Linux gives a thread of the calling process, as glibc's
    pthread_getcpuclockid builds it): the copy budget reads every copying
    thread's on each check, and a /proc read cost 10.3 us here against 0.4 us
    for the system call."""
    if sys.platform != "linux":
        return None
    try:
        return time.clock_gettime(((~tid) << 3) | _CPUCLOCK_PERTHREAD_SCHED)
    except OSError:  # EINVAL: no such thread in this process (any more)
        return None


# A per-thread clock (4) of the scheduler's runtime (2), Linux's clock-id encoding.
_CPUCLOCK_PERTHREAD_SCHED = 4 | 2


def _schedstat_s(tids: list[int], field: int) -> float:
    """The sum of field `field` of the threads' /proc schedstat (0: on a CPU,
    1: runnable but waiting), in seconds; a thread gone counts 0."""
    return sum(value for value in (_schedstat_field_s(tid, field) for tid in tids) if value is not None)


def _schedstat_field_s(tid: int, field: int) -> float | None:
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[field]) / 1e9
    except (OSError, IndexError, ValueError):
        return None
