"""Whether a prefix pull is worth waiting for: its expected time against the
time the destination would take to compute the same prompt tokens itself
(issue 49: a pull falls back to recompute when its estimated remaining time
exceeds the estimated recompute time; never a stall).

Two measures, both learnt while serving:
- a pull's seconds per byte, from routing to the destination's import, over
  the pulls that brought their blocks (a moving average): it holds the
  holder's wait for its step to end, the copy, and the destination's read;
- the destination's seconds per prompt token, from its own steps
  (raylm.core.prefill_pace, reported with its stats).

Used twice. At the start: a pull expected to take longer than the recompute
is not started (`too_slow`; the request computes its prompt at once). While
the holder exports: once the pull has taken as long as the recompute would
have, the rest of its time can only add to the request's wait, so it falls
back then (`timeout`), or at EXPORT_TIMEOUT_S when nothing is measured yet.
Until both measures exist every pull is tried: the first pulls teach the
estimate, and a prompt of a short-context model pulls as a long one does.

RAYLM_PULL_ESTIMATES=0 turns the estimate off (every pull is tried, the
fixed timeout stays): the test suite's tiny models compute a prompt faster
than any copy, and the tests that exercise pulls need them to happen.
"""

from __future__ import annotations

import os

from raylm.engine.protocol import SchedulerStats

# How long a holder may take to export when the destination's pace is not
# measured yet: the export is an unpaced copy of a few MiB (milliseconds); a
# holder that takes longer is busy or stuck. Once measured, the wait is the
# recompute's estimated time instead (`export_deadline`).
EXPORT_TIMEOUT_S = 1.0

# Weight of the newest pull in the moving average of seconds per byte.
_WEIGHT = 0.25


def estimates_enabled() -> bool:
    return os.environ.get("RAYLM_PULL_ESTIMATES", "1") != "0"


class PullEstimate:
    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = estimates_enabled() if enabled is None else enabled
        self.seconds_per_byte = 0.0  # 0: no pull measured yet
        self.bytes_per_block = 0

    def observe(self, num_blocks: int, num_bytes: int, seconds: float) -> None:
        """A pull that brought `num_blocks` blocks (`num_bytes`) in `seconds`."""
        if num_blocks <= 0 or num_bytes <= 0 or seconds <= 0:
            return
        self.bytes_per_block = num_bytes // num_blocks
        sample = seconds / num_bytes
        old = self.seconds_per_byte
        self.seconds_per_byte = sample if old == 0 else (1 - _WEIGHT) * old + _WEIGHT * sample

    def pull_seconds(self, num_blocks: int) -> float | None:
        """A pull of `num_blocks` blocks, expected; None: not measured yet."""
        if not self.seconds_per_byte or not self.bytes_per_block:
            return None
        return num_blocks * self.bytes_per_block * self.seconds_per_byte

    @staticmethod
    def recompute_seconds(stats: SchedulerStats | None, num_tokens: int) -> float | None:
        """`num_tokens` prompt tokens computed by the core whose last stats
        are `stats`; None: it has not measured its pace yet."""
        if stats is None or not stats.prefill_seconds_per_token:
            return None
        return num_tokens * stats.prefill_seconds_per_token

    def worth_starting(self, num_blocks: int, num_tokens: int, destination: SchedulerStats | None) -> bool:
        """False when the pull is expected to take longer than computing its
        `num_tokens` tokens at the destination."""
        if not self.enabled:
            return True
        pull, recompute = self.pull_seconds(num_blocks), self.recompute_seconds(destination, num_tokens)
        return pull is None or recompute is None or pull <= recompute

    def export_deadline(self, started: float, num_tokens: int, destination: SchedulerStats | None) -> float:
        """When a pull started at `started` stops waiting for its holder's export."""
        # Measured: as long as the recompute, however long (capped at the fixed
        # timeout, a loaded holder's 2k-token prefill step outlasted it and the
        # pulls the routing trace needed timed out: each shared prefix was
        # computed on both replicas). Waiting that long and then computing
        # costs at most twice the recompute; not waiting costs it always.
        recompute = self.recompute_seconds(destination, num_tokens) if self.enabled else None
        return started + (EXPORT_TIMEOUT_S if recompute is None else recompute)
