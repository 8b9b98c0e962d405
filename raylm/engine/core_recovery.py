"""Recovery, the supervisor's part for failures (supervisor.py): what happens
when an engine core dies, hangs or gives up, and how its replacement starts.

A core found dead (its launcher says so, it sent its error, or it was silent
past its deadline and was killed) leaves the supervisor's channels at once;
its unfinished requests go to the other cores, or wait, as continuations
(prompt plus the tokens so far). The death charges the requests it exposed
(raylm.core.quarantine); a culprit is failed alone and its deaths are
forgiven. A replacement starts in a thread after the budget's backoff, and
its recovery is reported, with the seconds from the death to serving again,
once the read loop adopts it. A death past the budget leaves the replica
waiting until the oldest restart leaves the budget's window (listed as
"waiting_for_restart_budget" meanwhile), then it is tried again: a server
that lost a replica to a burst of failures gets it back.

`Recovery` owns the restart budget, the blame ledger, the replacements
under way and those waiting for the budget; it starts the planned restarts
of scaling.py too (the same start, without a budget), and tells their
outcome to the `ReplicaRestarts` it was given.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from raylm.config import EngineConfig
from raylm.core import quarantine
from raylm.core.outputs import EngineCoreOutput
from raylm.engine.core_channel import CoreChannel, CoreLauncher
from raylm.engine.errors import EngineDeadError
from raylm.engine.ledger import Ledger
from raylm.engine.protocol import RecoveryStats
from raylm.engine.restart_budget import BlameLedger, RestartBudget
from raylm.engine.routing import Router

logger = logging.getLogger("raylm.engine.supervisor")  # one log for the supervisor, whichever part speaks


@dataclass
class Replacement:
    """A core being replaced: since when, why, and the requests it held."""

    noticed: float
    cause: str
    num_requests: int
    # A restart asked for (scaling.py), not a failure: no recovery to report.
    planned: bool = False


@dataclass
class BudgetWait:
    """A core the restart budget refused to replace, and when to try again."""

    replacement: Replacement
    retry_at: float


class BackgroundThreads:
    """Runs a task in a thread of its own after a delay, or its `cancelled`
    if the engine shuts down first (`closed` is set). The supervisor's parts
    run every start and stop that may block through one of these; the chaos
    harness (raylm.testing.chaos) gives the supervisor one that runs them at
    points of its schedule instead."""

    def __init__(self, closed: threading.Event):
        self._closed = closed

    def run(self, delay_s: float, run, cancelled, name: str) -> None:
        def body() -> None:
            if self._closed.wait(delay_s):
                cancelled()
            else:
                run()

        threading.Thread(target=body, name=name, daemon=True).start()


class RestartOutcomes(Protocol):
    """Who hears how a planned replica restart ended (scaling.ReplicaRestarts)."""

    def done(self, index: int) -> None: ...

    def failed(self, index: int, why: str) -> None: ...


class Recovery:
    def __init__(
        self,
        config: EngineConfig,
        ledger: Ledger,
        router: Router,
        launcher: CoreLauncher,
        ctx,
        background: BackgroundThreads,
        closed: threading.Event,
        restarts: RestartOutcomes,
        remove_channel: Callable[[int, str], CoreChannel | None],
    ):
        """`restarts` hears how a planned restart's start went and of a
        restarting replica's death (its restart is over); `remove_channel`
        is the supervisor's one way for a core to leave."""
        ft = config.fault_tolerance
        self._ft = ft
        self._ledger = ledger
        self._router = router
        self._launcher = launcher
        self._ctx = ctx
        self._background = background
        self._closed = closed
        self._restarts = restarts
        self._remove_channel = remove_channel
        self.restart_budget = RestartBudget(ft.max_restarts, ft.restart_window_s)
        # Restarts that failed requests caused are forgiven, up to a rate.
        self.blame = BlameLedger(self.restart_budget, ft.max_blamed_recoveries, ft.restart_window_s)
        self.starting: dict[int, Replacement] = {}  # cores being started, by index
        # Starts that returned, (channel, error), taken up by housekeeping (`adopt_started`).
        self.started: queue.Queue = queue.Queue()
        self._budget_waits: dict[int, BudgetWait] = {}  # cores lost past the restart budget, by index
        self._recoveries: list[RecoveryStats] = []
        self._culprit_outputs: list[EngineCoreOutput] = []
        self.last_failure = ""

    def take_recoveries(self) -> list[RecoveryStats]:
        """The recoveries done since last asked (each reported once)."""
        recoveries, self._recoveries = self._recoveries, []
        return recoveries

    def take_culprit_outputs(self) -> list[EngineCoreOutput]:
        """The culprits failed since last asked: each request's last output, an error."""
        culprits, self._culprit_outputs = self._culprit_outputs, []
        return culprits

    def has_reports(self) -> bool:
        return bool(self._recoveries or self._culprit_outputs)

    def start(self, index: int, replacement: Replacement, backoff_s: float) -> None:
        """Start a new core `index` in the background, after `backoff_s`; the
        read loop adopts it (`adopt_started`)."""
        self.starting[index] = replacement
        channel = self._launcher.new_channel(self._ctx, index)
        target = self._launcher.plan_targets(1)[0]

        def start() -> None:
            try:
                self._launcher.start(channel, target)
            except BaseException as e:
                self.started.put((channel, e))
                return
            if self._closed.is_set():  # shut down while it loaded: nobody will use it
                self._launcher.stop(index, wait_s=0)
            self.started.put((channel, None))

        def shut_down_meanwhile() -> None:
            self.started.put((channel, EngineDeadError("the engine was shut down")))

        self._background.run(backoff_s, start, shut_down_meanwhile, name=f"raylm-core-replace-{index}")

    def adopt_started(self) -> None:
        """Housekeeping, first: the cores whose start returned serve, or are
        tried again. (One that died before it was adopted is then found dead
        as the core serving its index: handled before, its death would be
        lost, and its requests stall until the step deadline.)"""
        while not self.started.empty():
            self._on_started(*self.started.get())

    def _on_started(self, channel: CoreChannel, error: BaseException | None) -> None:
        replacement = self.starting.pop(channel.index)
        if self._closed.is_set():
            self._launcher.close_channel(channel)
            if error is None:
                self._launcher.stop(channel.index, wait_s=0)
            return
        if error is not None:
            self._launcher.close_channel(channel)
            logger.error("starting engine core %d failed: %s", channel.index, error)
            # A planned restart that failed ends here, unsuccessful (its caller
            # is told), and goes on as a recovery.
            self._restarts.failed(channel.index, f"its new engine core failed to start ({error})")
            # A failed start costs another restart from the budget.
            self.last_failure = str(error)
            self._restart_if_allowed(channel.index, replacement)
            return
        self._ledger.adopt(channel)
        if replacement.planned:
            self._restarts.done(channel.index)
            return
        seconds = time.monotonic() - replacement.noticed
        logger.warning(
            "engine core %d replaced in %.1f s (%s); %d request(s) carried over",
            channel.index,
            seconds,
            replacement.cause,
            replacement.num_requests,
        )
        self._recoveries.append(RecoveryStats(self._launcher.recovery_kind, seconds, replacement.num_requests))

    def _restart_if_allowed(self, index: int, replacement: Replacement, blamed: int = 0) -> None:
        """Replace core `index` if the budget allows (past it while a culprit
        is being hunted, within the blame rate); else serve without it until
        the budget's window allows (`restart_when_budget_allows`)."""
        budget = self.restart_budget
        recorded = budget.num_recent
        hunting = budget.max_restarts > 0 and self._ledger.any_quarantined()
        allowed = budget.allow() or (hunting and self.blame.excuse())
        if blamed:  # the culprit's doing, this failure included: not the core's
            allowed = self.blame.forgive(blamed) or allowed
        if not allowed:
            if budget.num_recent > recorded:
                # A refused restart did not happen: it must not hold a place in
                # the window, or the retry would find the window full again.
                budget.forgive(1)
            self._wait_for_budget(index, replacement)
            return
        logger.warning("restarting engine core %d (%s)", index, budget.describe())
        self.start(index, replacement, 0.0 if hunting else budget.backoff_s())

    def _wait_for_budget(self, index: int, replacement: Replacement) -> None:
        budget = self.restart_budget
        serving = f"serving with {len(self._ledger.channels)} core(s)"
        if budget.max_restarts == 0:  # no restart is ever allowed: nothing to wait for
            logger.error("no restart left for engine core %d (0 allowed): %s", index, serving)
            return
        retry_in = _window_frees_in(budget)
        self._budget_waits[index] = BudgetWait(replacement, time.monotonic() + retry_in)
        logger.error(
            "no restart left for engine core %d (%d allowed within %g s): %s; it is restarted in "
            "%.0f s, when the oldest restart leaves the window",
            index,
            budget.max_restarts,
            budget.window_s,
            serving,
            retry_in,
        )

    def restart_when_budget_allows(self) -> None:
        """Housekeeping: try again the restarts the budget refused, once due."""
        now = time.monotonic()
        for index, wait in list(self._budget_waits.items()):
            if wait.retry_at <= now:
                del self._budget_waits[index]
                self._restart_if_allowed(index, wait.replacement)

    def give_up_budget_waits(self, why: str) -> None:
        """A scale sets the size that serves: no replica lost earlier is started on top of it."""
        for index in sorted(self._budget_waits):
            logger.warning("engine core %d no longer waits for the restart budget: %s", index, why)
        self._budget_waits.clear()

    def budget_waits(self) -> dict[int, float]:
        """The cores waiting for the restart budget: index -> seconds until they are tried again."""
        now = time.monotonic()
        return {index: max(0.0, wait.retry_at - now) for index, wait in self._budget_waits.items()}

    def recovery_status(self) -> dict | None:
        """The recovery in progress while no core can serve, if any: what
        recovers (the launcher's kind: a core being replaced; "executor": a
        core rebuilding its executor in place, as it announced), since when
        (seconds), and the limit past which /health fails."""
        channels = self._ledger.channels
        if any(c.rebuilding_since is None for c in channels.values()):
            return None
        now, what, since = time.monotonic(), None, None
        replacements = list(self.starting.values())
        if replacements:
            what, since = str(self._launcher.recovery_kind), min(r.noticed for r in replacements)
        elif channels:
            what, since = "executor", min(c.rebuilding_since for c in channels.values())
        if since is None:
            return None
        return {"recovering": what, "seconds": now - since, "limit_s": self._ft.engine_start_timeout_s}

    def kill_hung_cores(self) -> None:
        """A core that sent nothing for longer than the step deadline while it
        holds requests is hung (one whose model runs in its own process, the
        uni backend, has nobody else to notice): it is killed and handled as
        a death. A busy core reports after every step; one rebuilding its
        executor may take as long as a start (it loads the model again)."""
        ft = self._ft
        now = time.monotonic()
        for channel in list(self._ledger.channels.values()):
            silent_s = now - channel.last_heard
            rebuilding = channel.rebuilding_since is not None
            limit = ft.engine_start_timeout_s if rebuilding else ft.execute_model_timeout_s
            if not (channel.in_flight or rebuilding) or silent_s <= limit:
                continue
            what = "while rebuilding its executor" if rebuilding else "with requests in flight"
            logger.error("engine core %d sent nothing for %.0f s %s: killing it", channel.index, silent_s, what)
            self._launcher.stop(channel.index, wait_s=0)
            self.on_death(channel.index, f"no progress for {silent_s:.0f} s {what} (hung); killed it")

    def on_death(self, index: int, cause: str) -> None:
        """Core `index` is gone: its requests go to the others (or wait for
        its replacement) as continuations, and it is replaced within budget."""
        noticed = time.monotonic()
        channel = self._remove_channel(index, "died")
        if channel is None:
            return
        self._launcher.close_channel(channel)
        self.last_failure = cause
        orphans = sorted(channel.in_flight)
        blamed = self._charge_death(index, orphans, cause)
        orphans = [rid for rid in orphans if rid in self._ledger]
        logger.error("engine core %d died (%s); resubmitting its %d request(s)", index, cause, len(orphans))
        # A replica that dies while it drains for a restart is replaced as any
        # dead core is; the restart asked for is over (else it stayed
        # "restarting" for good: the replacement is not a planned start).
        self._restarts.failed(index, f"it died while draining ({cause})")
        for request_id in orphans:
            self._router.resubmit(request_id)
        self._restart_if_allowed(index, Replacement(noticed, cause, len(orphans)), blamed)

    def _charge_death(self, index: int, orphans: list[str], cause: str) -> int:
        """Charge the requests exposed to a core's death (see
        quarantine.charge_death); a culprit ends here, with an error. Returns
        the deaths the culprit caused (0 if this one names none)."""
        running_alone = self._launcher.take_running_alone(index)
        verdict = quarantine.charge_death({rid: self._ledger[rid].request for rid in orphans}, running_alone)
        if not verdict.found_culprit:
            return 0
        culprit = verdict.culprits[0]
        logger.error(
            "request %s was present at %d failures and killed engine core %d again running alone: failed, not retried",
            culprit,
            verdict.culprit_recoveries + 1,
            index,
        )
        self._ledger.drop(culprit)
        self._culprit_outputs.append(quarantine.culprit_output(verdict, cause))
        return verdict.culprit_recoveries + 1


def _window_frees_in(budget) -> float:
    """Seconds until the restart budget's window has room for one more: the
    oldest restart in it leaves (RestartBudget keeps them oldest first)."""
    recent = budget._recent
    if len(recent) < budget.max_restarts:
        return 0.0
    # Restarts excused past the budget (a culprit hunted) hold places too:
    # the window has room once all but max_restarts - 1 of them left.
    return max(0.0, recent[len(recent) - budget.max_restarts] + budget.window_s - time.monotonic())
