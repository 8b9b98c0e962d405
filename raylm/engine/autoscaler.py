"""Autoscaling of data-parallel replicas (--autoscale MIN:MAX, in Ray Serve's
vocabulary): how many replicas the load calls for, and when to act on it.

One rule decides both ways, with a band between them (hysteresis):
- out: ceil(requests in flight / target_ongoing_requests) replicas, and one
  more than serve now when the replicas' mean KV usage is above KV_USAGE_HIGH
  or every replica has a queue (work the in-flight count does not show as
  pressure);
- in: to the fewest replicas that would still be clear of every out
  condition with the load they would then carry: the in-flight count fits
  their target, no replica has a queue, and the KV usage, projected onto
  them, stays below KV_USAGE_LOW.
So the state right after a scale-in never asks for the scale-out again.
(Two rules that disagree flap: KV usage asked for 3 replicas at 2, the
count asked for 2 at 3, and the count was 2 -> 3 -> 2 -> 3 every
upscale + downscale delay.)

A change is made once the load has asked for one in the same direction
without a pause for the upscale (or downscale) delay: a short burst or lull
moves nothing. Scale-out warms the new replicas before they get traffic;
scale-in migrates the leaving replicas' requests (EngineCoreSupervisor.scale).

`AutoscalePolicy` is pure (time is an argument); `Autoscaler` runs it in the
engine's event loop and logs each decision with its reason.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from raylm.config import AutoscaleConfig

logger = logging.getLogger(__name__)

# Out: a mean KV usage above KV_USAGE_HIGH. In: only to a count at which the
# projected KV usage stays below KV_USAGE_LOW. The band between leaves room
# for the load to grow after a scale-in before it asks for the scale-out.
KV_USAGE_HIGH = 0.85
KV_USAGE_LOW = 0.70
_INTERVAL_S = 0.5


@dataclass(frozen=True)
class Decision:
    num_replicas: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.reason.startswith("up") else "down"


class AutoscalePolicy:
    def __init__(self, config: AutoscaleConfig):
        self.config = config
        # The direction the load has asked for without a pause, since when, and
        # the count to go to (for a scale-in, the most replicas it asked for
        # meanwhile: never fewer than a moment of the delay needed).
        self._direction: str | None = None
        self._since = 0.0
        self._target, self._why = 0, ""

    def desired(self, replicas: list[dict]) -> tuple[int, str]:
        """(replicas the load calls for, why), within MIN..MAX."""
        serving = [r for r in replicas if r.get("state") == "serving"]
        n = len(serving)
        target = self.config.target_ongoing_requests
        in_flight = sum(r.get("in_flight", 0) for r in serving)
        # KV usage in replicas' worth: the mean usage times n, so that usage / m
        # is what m replicas would each carry.
        kv_total = sum(r.get("kv_cache_usage", 0.0) for r in serving)
        queued = [r for r in serving if r.get("num_waiting", 0) > 0]
        by_count = math.ceil(in_flight / target)
        why = f"{in_flight} request(s) in flight, target {target:g} per replica"
        wanted = by_count
        if n and kv_total / n > KV_USAGE_HIGH:
            wanted, why = max(by_count, n + 1), f"KV cache usage above {KV_USAGE_HIGH:.0%}"
        elif n and len(queued) == n:
            wanted, why = max(by_count, n + 1), "every replica has a queue"
        elif by_count < n:
            wanted, why = self._fewest_that_fit(n, in_flight, kv_total, bool(queued), why)
        return min(max(wanted, self.config.min_replicas), self.config.max_replicas), why

    def _fewest_that_fit(self, n: int, in_flight: int, kv_total: float, queued: bool, why: str) -> tuple[int, str]:
        """The fewest replicas (down to MIN) that the load would leave clear of
        every scale-out condition, with the KV usage below the lower watermark
        (not just below the high one); n when not even n - 1 would be."""
        if queued:  # the waiting work would land on fewer replicas, each with a queue
            return n, f"{why}; a replica has a queue"
        fewest = n
        for m in range(n - 1, max(self.config.min_replicas, 1) - 1, -1):
            if in_flight > m * self.config.target_ongoing_requests or kv_total / m >= KV_USAGE_LOW:
                break
            fewest = m
        if fewest == n:
            return n, why
        return fewest, f"{why}; KV cache usage on {fewest} replica(s) would be {kv_total / fewest:.0%}"

    def decide(self, replicas: list[dict], now: float) -> Decision | None:
        """A change of replica count once the load has asked for one in the
        same direction for that direction's delay; None meanwhile (or while
        replicas start or leave)."""
        if any(r.get("state") != "serving" for r in replicas):
            self._direction = None  # a change is under way: judge the load after it
            return None
        current = len(replicas)
        wanted, why = self.desired(replicas)
        if wanted == current:
            self._direction = None
            return None
        direction = "up" if wanted > current else "down"
        if direction != self._direction:
            self._direction, self._since = direction, now
            self._target, self._why = wanted, why
        elif direction == "up" or wanted >= self._target:
            # Up: the latest ask (the load may have grown meanwhile). Down: the
            # most replicas asked for since the clock started.
            self._target, self._why = wanted, why
        delay = self.config.upscale_delay_s if direction == "up" else self.config.downscale_delay_s
        if now - self._since < delay:
            return None
        self._direction = None
        return Decision(self._target, f"{direction}: {self._why}, for {now - self._since:.1f} s")


class Autoscaler:
    """The policy, applied every _INTERVAL_S to an engine (AsyncLLM) from its event loop."""

    def __init__(self, engine, config: AutoscaleConfig, on_decision=None, policy=None):
        """`policy`: AutoscalePolicy(config) unless given (P/D roles pass
        role_autoscaler.RoleAutoscalePolicy, whose decisions name the prefill
        pool too: applied by the engine's `scale_roles`)."""
        self.engine = engine
        self.policy = policy if policy is not None else AutoscalePolicy(config)
        self.on_decision = on_decision
        self.decisions: list[Decision] = []

    async def run(self) -> None:
        """Until cancelled (the engine's shutdown). A decision that fails is
        logged and the next one is made: this task is awaited by nobody, so
        an error that ended it would stop autoscaling for the server's life
        without a word."""
        while True:
            await asyncio.sleep(_INTERVAL_S)
            try:
                await self._decide_and_scale()
            except Exception as e:  # not CancelledError (a BaseException): a cancel still ends the loop
                logger.exception(
                    "autoscaling: deciding the replica count failed (%s: %s); deciding again in %g s",
                    type(e).__name__,
                    e,
                    _INTERVAL_S,
                )

    async def _decide_and_scale(self) -> None:
        replicas = self.engine.replica_states() or []
        decision = self.policy.decide(replicas, time.monotonic())
        if decision is None:
            return
        logger.warning("autoscaling %d -> %d replicas (%s)", len(replicas), decision.num_replicas, decision.reason)
        if not await self._scale(decision):
            return
        self.decisions.append(decision)
        if self.on_decision is not None:
            self.on_decision(decision)

    async def _scale(self, decision: Decision) -> bool:
        """Whether the engine scaled. On failure nothing changed, and the
        policy asks again once the load still calls for it for the delay."""
        try:
            prefill = getattr(decision, "prefill_replicas", None)
            if prefill is not None:
                await self.engine.scale_roles(decision.num_replicas, prefill)
            else:
                await self.engine.scale(decision.num_replicas)
        except Exception as e:
            # ValueError: refused now (a change under way); RuntimeError: could
            # not be placed, or a new replica did not start in time
            # (EngineStartTimeoutError). Anything else is unexpected: traceback.
            expected = isinstance(e, (ValueError, RuntimeError))
            logger.error(
                "autoscaling to %d replicas failed (%s: %s); trying again when the load asks for it",
                decision.num_replicas,
                type(e).__name__,
                e,
                exc_info=not expected,
            )
            return False
        return True
