"""A CPU rank's threads governed at run time, from how much CPU its forward
passes get: `ThreadGovernor` for a single rank (it shares the machine with the
engine loop and whatever else runs there), `ContentionWatch` for a rank the
plan pinned (it unpins itself when something else takes its cores);
`watch_for` picks which, from the rank's placement.

Apart from the plan (raylm.worker.cpu_placement), which decides once, before
the model loads, where the ranks run: these watch every pass and change the
thread count or the pinning while the engine serves. What Linux says of the
threads (run-queue wait) is read through raylm.thread_accounting.

A single rank (uni, mp TP=1) gets every core and gives the engine loop's core
back while its threads wait for CPUs, trying every core again after a
back-off. The decode kernels now stream weights at the memory's speed, where
one thread leaves much of batch-1 decode on the table. One request 128 in /
128 out, bf16, 2 cores, alternating processes, best of 2 (quiet | beside one
busy process):
- 111M: governed 1.33-1.44 s | 2.37-2.55 s (it dropped); 1 thread 2.37-2.46 |
  2.18-2.39; 2 threads 1.39-1.48 | 4.5-5.2.
- 7M: governed 0.14-0.17 | 0.28-0.40; 1 thread 0.21 | 0.21-0.26; 2 threads
  0.18-0.20 | 0.64-0.79.
(A short OpenMP spin, GOMP_SPINCOUNT=1000, was tried instead of the governor:
it kept 2 threads within 10% of 1 beside other work, but made the 7M model
3x slower on a quiet machine, every parallel region waking its threads.)
"""

from __future__ import annotations

import logging
import time

# What Linux says of this process's threads (shared with the K/V copies' CPU budget).
from raylm.thread_accounting import process_run_queue_wait_s
from raylm.worker.cpu_placement import RankPlacement

logger = logging.getLogger(__name__)


class ContentionWatch:
    """Tells a pinned rank that something else runs on its cores.

    Around each forward pass it reads the wall clock and the process's CPU
    time. Uncontended, a rank's threads are on CPU for nearly all of a pass
    (a short wait for a peer at an all-reduce spins or yields, which counts);
    when another process shares its cores, the OS gives it a fraction. Once
    a window of passes (at least `window_s` long and `min_steps` passes) has
    had less than `min_cpu_share` of threads x wall time, `end` answers True,
    once; the watch then stops measuring. Measured on 2 cores, TP=2: 0.78-0.99
    idle (the engine loop's own work shares a core now and then; the 7M model
    is the low end), 0.46-0.61 beside one busy process."""

    def __init__(
        self, num_threads: int, *, window_s: float = 1.0, min_steps: int = 16, min_cpu_share: float = 0.65, clocks=None
    ):
        self.num_threads = max(1, num_threads)
        self.window_s = window_s
        self.min_steps = min_steps
        self.min_cpu_share = min_cpu_share
        self._wall, self._cpu = clocks or (time.perf_counter, time.process_time)
        self._started: tuple[float, float] | None = None
        self._steps = 0
        self._wall_sum = 0.0
        self._cpu_sum = 0.0
        self.triggered = False
        # The CPU share of the last full window (for the log line).
        self.last_share: float | None = None

    def begin(self) -> None:
        if not self.triggered:
            self._started = (self._wall(), self._cpu())

    def end(self, work: int = 1) -> bool:
        """After a pass (of `work` tokens, unused here): True once, when the
        window just completed was starved."""
        if self._started is None:
            return False
        wall0, cpu0 = self._started
        self._started = None
        self._wall_sum += self._wall() - wall0
        self._cpu_sum += self._cpu() - cpu0
        self._steps += 1
        if self._steps < self.min_steps or self._wall_sum < self.window_s:
            return False
        self.last_share = self._cpu_sum / (self._wall_sum * self.num_threads)
        self._steps, self._wall_sum, self._cpu_sum = 0, 0.0, 0.0
        self.triggered = self.last_share < self.min_cpu_share
        return self.triggered


class ThreadGovernor:
    """A single rank's thread count, set from how long its threads wait for a
    CPU and from how fast its passes then go.

    Around each forward pass it keeps the wall time and the pass's work (its
    scheduled tokens); once a window of passes (at least `window_s` and
    `min_steps` passes) is complete it reads how long this process's threads
    were runnable but not running over the window (the kernel's run-queue
    delay, /proc/self/task/*/schedstat). Waiting is what other work on the
    cores costs a parallel pass: every region ends at a barrier, so one thread
    kept off a core holds all of them. CPU time, as ContentionWatch reads it,
    cannot tell this apart from a region that keeps only one thread busy, or
    (with a short OpenMP spin) from a thread asleep at a barrier.

    Above `tolerated_wait` (at first `max_wait_share`) of the window's pass
    time per thread, the rank drops to its `contended_threads` (two threads
    beside one busy process on two cores wait about a third of the time;
    quiet, well under a tenth), and the next window says whether that paid:
    unless its passes went faster (seconds per token, by `min_gain`), the rank
    takes every core back and tolerates that much waiting (with a margin), so
    that only more contention drops it again. Waiting alone cannot tell: a
    server's own front end makes the threads wait for the other core without
    taking much of it (`raylm serve` of the ~111M model, 64 streams on 2 cores:
    146 output tok/s when it dropped for good, 209 so), where a busy process
    beside the rank takes it.
    After `probe_after_s` on fewer threads it tries every core again for one
    window; a probe that does not wait keeps them, one that waits keeps them
    only if its passes went faster than in the window before it. A probe that
    loses doubles the back-off (up to `max_probe_after_s`), one that wins
    resets it; under contention a probe costs one window of slower passes,
    which the back-off bounds to a few per cent.

    begin()/end() wrap each pass like ContentionWatch's; end() answers False
    (there is nothing to unpin), having set the thread count itself."""

    def __init__(
        self,
        placement: RankPlacement,
        *,
        window_s: float = 0.5,
        min_steps: int = 4,
        max_wait_share: float = 0.15,
        probe_after_s: float = 10.0,
        max_probe_after_s: float = 160.0,
        min_gain: float = 0.05,
        clock=time.monotonic,
        read_wait_s=None,
        set_threads=None,
    ):
        if placement.contended_threads is None:
            raise ValueError("a ThreadGovernor needs a placement with contended_threads")
        self.every_core = placement.num_threads
        self.contended = placement.contended_threads
        self.window_s = window_s
        self.min_steps = min_steps
        self.max_wait_share = max_wait_share
        self.tolerated_wait = max_wait_share
        self.probe_after_s = probe_after_s
        self.max_probe_after_s = max_probe_after_s
        self.min_gain = min_gain
        self._clock = clock
        self._read_wait_s = read_wait_s or process_run_queue_wait_s
        self._set_threads = set_threads or _set_torch_threads
        self.threads = self.every_core
        self.last_wait_share: float | None = None
        self._wait_s_backoff = probe_after_s
        self._probing = False
        self._next_probe: float | None = None  # while contended: when to try every core again
        # Seconds per token of the last window on fewer threads, and on every core.
        self._contended_pace: float | None = None
        self._every_core_pace: float | None = None
        self._checking = False  # the window after a drop for waiting: does it pay?
        self._pass_started: float | None = None
        # (wait at its start, passes, pass seconds, tokens)
        self._window: tuple[float, int, float, int] | None = None

    def begin(self) -> None:
        now = self._clock()
        if self._next_probe is not None and now >= self._next_probe:
            # A window of the old count measured nothing of the new one.
            self._next_probe, self._probing, self._window = None, True, None
            self._switch(self.every_core)
        if self._window is None:
            self._window = (self._read_wait_s(), 0, 0.0, 0)
        self._pass_started = now

    def end(self, work: int = 1) -> bool:
        """After a pass of `work` tokens."""
        if self._pass_started is None:
            return False
        wait_at_start, passes, seconds, tokens = self._window
        passes, seconds, tokens = passes + 1, seconds + self._clock() - self._pass_started, tokens + max(work, 1)
        self._pass_started = None
        if passes < self.min_steps or seconds < self.window_s:
            self._window = (wait_at_start, passes, seconds, tokens)
            return False
        self._window = None
        pace = seconds / tokens
        if self.threads != self.every_core:
            self._contended_pace = pace
            if self._checking:
                self._checking = False
                if pace > self._every_core_pace * (1 - self.min_gain):
                    logger.info(
                        "%d thread(s) went no faster than %d waiting for a CPU %.0f%% of the time: back to %d",
                        self.contended,
                        self.every_core,
                        100 * self.last_wait_share,
                        self.every_core,
                    )
                    self._next_probe = None
                    self._switch(self.every_core)
                    self._keep_every_core(tolerating_this_wait=True)
            return False
        self.last_wait_share = (self._read_wait_s() - wait_at_start) / (seconds * self.every_core)
        self._every_core_pace = pace
        if self._probing:
            self._probing = False
            if self.last_wait_share <= self.max_wait_share:
                self._keep_every_core(tolerating_this_wait=False)
            elif self._contended_pace is not None and pace <= self._contended_pace * (1 - self.min_gain):
                self._keep_every_core(tolerating_this_wait=True)
                logger.info(
                    "this rank's threads waited for a CPU %.0f%% of the time on %d threads, but its passes "
                    "went %.0f%% faster: keeping %d",
                    100 * self.last_wait_share,
                    self.every_core,
                    100 * (1 - pace / self._contended_pace),
                    self.every_core,
                )
            else:
                # A probe that waited for nothing waits longer.
                self._drop(min(2 * self._wait_s_backoff, self.max_probe_after_s))
        elif self.last_wait_share > self.tolerated_wait:
            self._drop(self.probe_after_s)
            self._checking = True
        return False

    def _keep_every_core(self, tolerating_this_wait: bool) -> None:
        """Every core stays; with `tolerating_this_wait`, waiting as much as the
        last window did (with a margin) no longer drops them."""
        self._wait_s_backoff = self.probe_after_s
        self.tolerated_wait = (
            min(1.0, 1.5 * self.last_wait_share + 0.05) if tolerating_this_wait else self.max_wait_share
        )

    def _drop(self, backoff_s: float) -> None:
        """Give the core back; try every core again after `backoff_s`."""
        self._wait_s_backoff, self.tolerated_wait = backoff_s, self.max_wait_share
        self._switch(self.contended)
        self._next_probe = self._clock() + backoff_s
        logger.info(
            "this rank's threads waited for a CPU %.0f%% of the time: down to %d thread(s), trying %d again in %.0f s",
            100 * self.last_wait_share,
            self.contended,
            self.every_core,
            backoff_s,
        )

    def _switch(self, threads: int) -> None:
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads


def _set_torch_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def watch_for(placement: RankPlacement) -> ContentionWatch | ThreadGovernor | None:
    """What watches a CPU rank's forward passes: a governor for a single rank
    with a fallback count, a contention watch for a rank the plan pinned,
    nothing for a placement the user fixed."""
    if placement.contended_threads is not None:
        return ThreadGovernor(placement)
    if placement.auto:
        return ContentionWatch(placement.num_threads)
    return None
