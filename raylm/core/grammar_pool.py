"""The small thread pool that compiles structured outputs' grammars
(raylm.core.structured_output)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

# Workers stuck on abandoned compilations that get a replacement (see
# CompilePool); past this many, the pool does with the workers it has.
_MAX_ABANDONED = 4


class CompilePool:
    """A few daemon threads that run compilations.

    A thread cannot be killed, and xgrammar's compiler cannot be interrupted,
    so a compilation past its deadline is abandoned: its request fails at
    once, the compilation runs on to its end on its thread and its result is
    discarded, and a new worker takes that thread's place (up to
    _MAX_ABANDONED at a time), so the other grammars keep their workers. The
    thread then exits. Daemon threads, unlike ThreadPoolExecutor's, which the
    interpreter joins at exit: an abandoned compilation never holds up the
    engine's shutdown."""

    def __init__(self, num_workers: int):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._abandoned: set[Future] = set()  # still running
        self._num_started = 0
        for _ in range(num_workers):
            self._start_worker()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def abandon(self, future: Future) -> None:
        """Give up on a running job: its worker is replaced, and leaves once it is done."""
        with self._lock:
            if future.done() or future in self._abandoned or len(self._abandoned) >= _MAX_ABANDONED:
                return
            self._abandoned.add(future)
        self._start_worker()

    def shutdown(self) -> None:
        """Cancel what is queued and let the idle workers go; running jobs end on their own."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        # A stop sign per worker ever started: those that left never read theirs.
        for _ in range(self._num_started):
            self._jobs.put(None)

    def _start_worker(self) -> None:
        self._num_started += 1
        threading.Thread(target=self._work, name=f"raylm-grammar-{self._num_started}", daemon=True).start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue  # its request went away while it was queued
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)
            with self._lock:
                if future in self._abandoned:
                    self._abandoned.discard(future)
                    return  # its replacement works on
