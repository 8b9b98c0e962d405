"""How every wait of the message queue (shm_broadcast) spins, sleeps and ends:
at the caller's timeout (TimeoutError), or when the queue is closed
(QueueClosedError), or when a reader has lost its place (QueueOutOfSyncError).
A peer that dies mid-message must not hang the other side."""

from __future__ import annotations

import time

from raylm.distributed.doorbell import DoorbellReader

# Spin this long (a step's reply usually lands within it), then a local reader
# sleeps until the writer rings its doorbell (doorbell.py), in slices so that a
# writer killed without closing is noticed; other waits sleep with intervals
# doubling up to the cap, so an idle waiter costs ~1% CPU.
_SPIN_S = 50e-6
_BELL_SLICE_S = 0.05
_FIRST_SLEEP_S = 10e-6
_MAX_SLEEP_S = 1e-3


class QueueClosedError(RuntimeError):
    """The queue was closed (by its writer, or locally) while waiting on it."""


class QueueOutOfSyncError(RuntimeError):
    """A reader got a message other than the next one (one was lost or sent
    twice). It cannot tell which payload is whose any more, so every later
    dequeue raises this too: close the reader."""


class Backoff:
    """Spin, then sleep with growing intervals; raises TimeoutError at the deadline."""

    __slots__ = ("deadline", "start", "sleep_s")

    def __init__(self, timeout: float | None):
        self.start = time.perf_counter()
        self.deadline = None if timeout is None else self.start + timeout
        self.sleep_s = _FIRST_SLEEP_S

    def wait(self, bell: DoorbellReader | None = None) -> None:
        now = time.perf_counter()
        if self.deadline is not None and now >= self.deadline:
            raise TimeoutError("timed out waiting on the message queue")
        if now - self.start < _SPIN_S:
            return
        if bell is not None:
            bell.wait(_BELL_SLICE_S if self.deadline is None else min(_BELL_SLICE_S, self.deadline - now))
            return
        time.sleep(self.sleep_s)
        self.sleep_s = min(self.sleep_s * 2, _MAX_SLEEP_S)

    def remaining_ms(self) -> int | None:
        if self.deadline is None:
            return None
        return max(0, int((self.deadline - time.perf_counter()) * 1000))

    def poll_slice_ms(self) -> int:
        # Short at first for latency, then up to 10 ms: a ZMQ poll sleeps in the
        # kernel, so long slices cost no CPU; they only bound how late close() is seen.
        elapsed = time.perf_counter() - self.start
        return 1 if elapsed < 0.01 else 10
