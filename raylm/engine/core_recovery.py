"""The failure half of EngineCoreSupervisor (supervisor.py): what happens when
an engine core dies, hangs or gives up, and how its replacement starts.

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
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from raylm.core import quarantine
from raylm.engine.core_channel import CoreChannel
from raylm.engine.errors import EngineDeadError
from raylm.engine.protocol import RecoveryStats

logger = logging.getLogger("raylm.engine.supervisor")  # one log for the supervisor, whichever half speaks


@dataclass
class Replacement:
    """A core being replaced: since when, why, and the requests it held."""

    noticed: float
    cause: str
    num_requests: int
    # A restart asked for (replica_restart.py), not a failure: no recovery to report.
    planned: bool = False


@dataclass
class BudgetWait:
    """A core the restart budget refused to replace, and when to try again."""

    replacement: Replacement
    retry_at: float


class CoreRecovery:
    """Mixed into EngineCoreSupervisor, whose state it shares (channels,
    ledger, launcher, restart budget): the methods of the failure path."""

    def _replace_in_background(self, index: int, replacement: Replacement, backoff_s: float) -> None:
        """Start a new core `index` in a thread, after `backoff_s`; the read
        loop adopts it (`_on_started`)."""
        self._starting[index] = replacement
        channel = self.launcher.new_channel(self._ctx, index)
        target = self.launcher.plan_targets(1)[0]

        def start() -> None:
            try:
                self.launcher.start(channel, target)
            except BaseException as e:
                self._started.put((channel, e))
                return
            if self._closed.is_set():  # shut down while it loaded: nobody will use it
                self.launcher.stop(index, wait_s=0)
            self._started.put((channel, None))

        def shut_down_meanwhile() -> None:
            self._started.put((channel, EngineDeadError("the engine was shut down")))

        self._in_background(backoff_s, start, shut_down_meanwhile, name=f"raylm-core-replace-{index}")

    def _in_background(self, delay_s: float, run, cancelled, name: str) -> None:
        """`run` in a thread of its own after `delay_s`, or `cancelled` if the
        engine shuts down first. (The chaos harness, raylm.testing.chaos,
        runs these at points of its schedule instead.)"""

        def body() -> None:
            if self._closed.wait(delay_s):
                cancelled()
            else:
                run()

        threading.Thread(target=body, name=name, daemon=True).start()

    def _on_started(self, channel: CoreChannel, error: BaseException | None) -> None:
        replacement = self._starting.pop(channel.index)
        if self._closed.is_set():
            self.launcher.close_channel(channel)
            if error is None:
                self.launcher.stop(channel.index, wait_s=0)
            return
        if error is not None:
            self.launcher.close_channel(channel)
            logger.error("starting engine core %d failed: %s", channel.index, error)
            # A planned restart that failed ends here, unsuccessful (its caller
            # is told), and goes on as a recovery.
            self._restart_failed(channel.index, f"its new engine core failed to start ({error})")
            # A failed start costs another restart from the budget.
            self._last_failure = str(error)
            self._restart_if_allowed(channel.index, replacement)
            return
        self.channels[channel.index] = channel
        if replacement.planned:
            self._restart_done(channel.index)
            return
        seconds = time.monotonic() - replacement.noticed
        logger.warning("engine core %d replaced in %.1f s (%s); %d request(s) carried over",
                       channel.index, seconds, replacement.cause, replacement.num_requests)
        self._recoveries.append(RecoveryStats(self.launcher.recovery_kind, seconds, replacement.num_requests))

    def _restart_if_allowed(self, index: int, replacement: Replacement, blamed: int = 0) -> None:
        """Replace core `index` if the budget allows (past it while a culprit
        is being hunted, within the blame rate); else serve without it until
        the budget's window allows (`_restart_when_budget_allows`)."""
        budget = self.restart_budget
        recorded = budget.num_recent
        hunting = budget.max_restarts > 0 and any(e.request.quarantined for e in self.ledger.values())
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
        self._replace_in_background(index, replacement, 0.0 if hunting else budget.backoff_s())

    def _wait_for_budget(self, index: int, replacement: Replacement) -> None:
        budget = self.restart_budget
        serving = f"serving with {len(self.channels)} core(s)"
        if budget.max_restarts == 0:  # no restart is ever allowed: nothing to wait for
            logger.error("no restart left for engine core %d (0 allowed): %s", index, serving)
            return
        retry_in = _window_frees_in(budget)
        self._budget_waits[index] = BudgetWait(replacement, time.monotonic() + retry_in)
        logger.error("no restart left for engine core %d (%d allowed within %g s): %s; it is restarted in "
                     "%.0f s, when the oldest restart leaves the window", index, budget.max_restarts,
                     budget.window_s, serving, retry_in)

    def _restart_when_budget_allows(self) -> None:
        """Housekeeping: try again the restarts the budget refused, once due."""
        now = time.monotonic()
        for index, wait in list(self._budget_waits.items()):
            if wait.retry_at <= now:
                del self._budget_waits[index]
                self._restart_if_allowed(index, wait.replacement)

    def _give_up_budget_waits(self, why: str) -> None:
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
        if any(c.rebuilding_since is None for c in self.channels.values()):
            return None
        now, what, since = time.monotonic(), None, None
        replacements = list(self._starting.values())
        if replacements:
            what, since = str(self.launcher.recovery_kind), min(r.noticed for r in replacements)
        elif self.channels:
            what, since = "executor", min(c.rebuilding_since for c in self.channels.values())
        if since is None:
            return None
        return {"recovering": what, "seconds": now - since,
                "limit_s": self.config.fault_tolerance.engine_start_timeout_s}

    def _kill_hung_cores(self) -> None:
        """A core that sent nothing for longer than the step deadline while it
        holds requests is hung (one whose model runs in its own process, the
        uni backend, has nobody else to notice): it is killed and handled as
        a death. A busy core reports after every step; one rebuilding its
        executor may take as long as a start (it loads the model again)."""
        ft = self.config.fault_tolerance
        now = time.monotonic()
        for channel in list(self.channels.values()):
            silent_s = now - channel.last_heard
            rebuilding = channel.rebuilding_since is not None
            limit = ft.engine_start_timeout_s if rebuilding else ft.execute_model_timeout_s
            if not (channel.in_flight or rebuilding) or silent_s <= limit:
                continue
            what = "while rebuilding its executor" if rebuilding else "with requests in flight"
            logger.error("engine core %d sent nothing for %.0f s %s: killing it", channel.index, silent_s, what)
            self.launcher.stop(channel.index, wait_s=0)
            self._on_death(channel.index, f"no progress for {silent_s:.0f} s {what} (hung); killed it")

    def _on_death(self, index: int, cause: str) -> None:
        """Core `index` is gone: its requests go to the others (or wait for
        its replacement) as continuations, and it is replaced within budget."""
        noticed = time.monotonic()
        channel = self._remove_channel(index)
        if channel is None:
            return
        self.launcher.close_channel(channel)
        self._last_failure = cause
        orphans = sorted(channel.in_flight)
        blamed = self._charge_death(index, orphans, cause)
        orphans = [rid for rid in orphans if rid in self.ledger]
        logger.error("engine core %d died (%s); resubmitting its %d request(s)", index, cause, len(orphans))
        # A replica that dies while it drains for a restart is replaced as any
        # dead core is; the restart asked for is over (else it stayed
        # "restarting" for good: the replacement is not a planned start).
        self._restart_failed(index, f"it died while draining ({cause})")
        for request_id in orphans:
            self._resubmit(request_id)
        self._restart_if_allowed(index, Replacement(noticed, cause, len(orphans)), blamed)

    def _remove_channel(self, index: int, why: str = "died"):
        """Core `index`'s channel, out of the supervisor's (None if it was
        gone already): every way a core leaves (it died, or drained for a
        scale-in or a restart) comes through here, so none leaves a ping
        waiting for an answer that is no longer read, none leaves a
        migration naming it (either side), and none is still routed to by
        its prefix cache. The migrations end before the core's requests are
        resubmitted: a paused copy of a request handed over to it is dropped
        at its source before the request may go there."""
        channel = self.channels.pop(index, None)
        if channel is not None:
            self.prefix_index.drop_core(index)
            self._forget_pings_to(index)
            self._migrations_on_channel_removed(channel, why)
        return channel

    def _forget_pings_to(self, index: int) -> None:
        """A core that left will not answer: a ping only it had left to
        answer is answered here (the supervisor serves on; requests wait if
        need be)."""
        for nonce, waiting in list(self._pings.items()):
            waiting.discard(index)
            if not waiting:
                del self._pings[nonce]
                self._pongs.append(nonce)

    def _charge_death(self, index: int, orphans: list[str], cause: str) -> int:
        """Charge the requests exposed to a core's death (see
        quarantine.charge_death); a culprit ends here, with an error. Returns
        the deaths the culprit caused (0 if this one names none)."""
        running_alone = self.launcher.take_running_alone(index)
        verdict = quarantine.charge_death({rid: self.ledger[rid].request for rid in orphans}, running_alone)
        if not verdict.found_culprit:
            return 0
        culprit = verdict.culprits[0]
        logger.error("request %s was present at %d failures and killed engine core %d again running alone: "
                     "failed, not retried", culprit, verdict.culprit_recoveries + 1, index)
        del self.ledger[culprit]
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
