"""RestartBudget: how often a failed component may be restarted before the
failure is treated as permanent. The front end uses it for the engine-core
process, the engine core for its executor (docs/architecture.md, "The failure model")."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

# Backoff before the k-th restart of a window: 0, 1, 2, 4, ... seconds, capped.
_MAX_BACKOFF_S = 30.0


class RestartBudgetExhausted(RuntimeError):
    """More restarts within the window than the budget allows."""


class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds.

    A sliding window rather than a lifetime count: a server that loses a core
    once a week should go on for years, one that crashes in a loop should stop
    soon and say so. The backoff grows with the restarts still in the window,
    so a crash loop does not burn CPU (or the budget) in a few seconds.
    """

    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._recent: deque[float] = deque()
        self.num_restarts = 0

    @property
    def num_recent(self) -> int:
        """Restarts recorded within the last `window_s` seconds."""
        self._forget_old(self._clock())
        return len(self._recent)

    def allow(self) -> bool:
        """Record a restart; True if it is within the budget."""
        now = self._clock()
        self._forget_old(now)
        self._recent.append(now)
        self.num_restarts += 1
        return len(self._recent) <= self.max_restarts

    def forgive(self, count: int = 1) -> None:
        """Take back the `count` most recent restarts: their failure turned out
        to be one request's doing (it was failed), not the component's."""
        for _ in range(min(count, len(self._recent))):
            self._recent.pop()

    def backoff_s(self) -> float:
        """The delay before the restart just recorded: none for the first in
        the window, then 1, 2, 4 ... seconds, at most 30."""
        k = len(self._recent)
        if k <= 1:
            return 0.0
        return min(_MAX_BACKOFF_S, 2.0 ** (k - 2))

    def record(self) -> float:
        """`allow` and `backoff_s` in one: the delay to wait before restarting,
        or RestartBudgetExhausted."""
        if not self.allow():
            raise RestartBudgetExhausted(
                f"{len(self._recent)} restarts within {self.window_s:g}s (the budget is {self.max_restarts})"
            )
        return self.backoff_s()

    def describe(self) -> str:
        """For log lines: "restart k of M"."""
        return f"restart {len(self._recent)} of {self.max_restarts}"

    def _forget_old(self, now: float) -> None:
        while self._recent and now - self._recent[0] >= self.window_s:
            self._recent.popleft()


class BlameLedger:
    """Takes back from a RestartBudget the restarts that a failed request
    caused (raylm.core.quarantine), at most `max_blamed` within `window_s`.

    Past that rate the failures are no longer believed to be the requests'
    alone (a node that fails every step would otherwise look healthy behind
    a stream of blamed requests): nothing more is forgiven, and
    `unhealthy_reason` says why, for /health to report."""

    def __init__(
        self, budget: RestartBudget, max_blamed: int, window_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self.budget = budget
        self._blamed = RestartBudget(max_blamed, window_s, clock)
        self.unhealthy_reason: str | None = None

    def forgive(self, count: int) -> bool:
        """Forgive the `count` most recent restarts; False once over the rate."""
        for _ in range(count):
            if not self.excuse():
                return False
            self.budget.forgive(1)
        return True

    def excuse(self) -> bool:
        """Let one restart past an exhausted budget while quarantined requests
        are being run alone to find a culprit (the failures are presumably
        theirs); False once over the rate."""
        if self._blamed.allow():
            return True
        self.unhealthy_reason = (
            f"more than {self._blamed.max_restarts} recoveries within "
            f"{self._blamed.window_s:g} s were blamed on requests"
        )
        return False
