"""Autoscaling of data-parallel replicas (--autoscale MIN:MAX, in Ray Serve's
vocabulary): how many replicas the load calls for, and when to act on it.

The load asks for ceil(requests in flight / target_ongoing_requests)
replicas; one more than serve now when the replicas' KV caches are nearly
full or every replica has a queue (work the in-flight count does not show
as pressure). A change is made once the load has asked for it without a
pause for the upscale (or downscale) delay: a short burst or lull moves
nothing. Scale-out warms the new replicas before they get traffic; scale-in
migrates the leaving replicas' requests (EngineCoreSupervisor.scale).

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

# Signals beyond the request count: a mean KV usage above this, or a queue on every replica.
KV_USAGE_HIGH = 0.85
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
        self._wanted: int | None = None  # what the load asks for, and since when
        self._since = 0.0

    def desired(self, replicas: list[dict]) -> tuple[int, str]:
        """(replicas the load calls for, why), within MIN..MAX."""
        serving = [r for r in replicas if r.get("state") == "serving"]
        in_flight = sum(r.get("in_flight", 0) for r in serving)
        wanted = math.ceil(in_flight / self.config.target_ongoing_requests)
        why = f"{in_flight} request(s) in flight, target {self.config.target_ongoing_requests:g} per replica"
        if serving and sum(r.get("kv_cache_usage", 0.0) for r in serving) / len(serving) > KV_USAGE_HIGH:
            wanted, why = max(wanted, len(serving) + 1), f"KV cache usage above {KV_USAGE_HIGH:.0%}"
        elif serving and all(r.get("num_waiting", 0) > 0 for r in serving):
            wanted, why = max(wanted, len(serving) + 1), "every replica has a queue"
        return min(max(wanted, self.config.min_replicas), self.config.max_replicas), why

    def decide(self, replicas: list[dict], now: float) -> Decision | None:
        """A change of replica count once the load has asked for it for the
        direction's delay; None meanwhile (or while replicas start or leave)."""
        if any(r.get("state") != "serving" for r in replicas):
            self._wanted = None  # a change is under way: judge the load after it
            return None
        current = len(replicas)
        wanted, why = self.desired(replicas)
        if wanted == current:
            self._wanted = None
            return None
        if wanted != self._wanted:
            self._wanted, self._since = wanted, now
        delay = self.config.upscale_delay_s if wanted > current else self.config.downscale_delay_s
        if now - self._since < delay:
            return None
        self._wanted = None
        direction = "up" if wanted > current else "down"
        return Decision(wanted, f"{direction}: {why}, for {now - self._since:.1f} s")


class Autoscaler:
    """The policy, applied every _INTERVAL_S to an engine (AsyncLLM) from its event loop."""

    def __init__(self, engine, config: AutoscaleConfig, on_decision=None):
        self.engine = engine
        self.policy = AutoscalePolicy(config)
        self.on_decision = on_decision
        self.decisions: list[Decision] = []

    async def run(self) -> None:
        while True:
            await asyncio.sleep(_INTERVAL_S)
            replicas = self.engine.replica_states() or []
            decision = self.policy.decide(replicas, time.monotonic())
            if decision is None:
                continue
            logger.warning("autoscaling %d -> %d replicas (%s)", len(replicas), decision.num_replicas,
                           decision.reason)
            try:
                await self.engine.scale(decision.num_replicas)
            except (ValueError, RuntimeError) as e:  # cannot be placed now: try again when the load says so
                logger.error("autoscaling to %d replicas failed: %s", decision.num_replicas, e)
                continue
            self.decisions.append(decision)
            if self.on_decision is not None:
                self.on_decision(decision)
