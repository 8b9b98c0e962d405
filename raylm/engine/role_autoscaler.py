"""Autoscaling per P/D role (--autoscale MIN:MAX with --prefill-replicas):
the prefill and decode pools scale independently (issue 50).

Each pool has its own `AutoscalePolicy` (autoscaler.py: the same rule, its
own hysteresis and delays), fed only its own replicas' states: the prefill
pool's in-flight requests are prompts being computed (and finished prefills
waiting for decode room), plus the new requests held in the ledger because
every prefill replica's hand-off queue is full (`pd_held`: work waiting for
the prefill pool that no replica counts yet); the decode pool's are streams. Each pool keeps at
least one replica; together they stay within MIN..MAX (at MAX, the larger
growth is cut first, and no pool shrinks to feed the other).

Roles go by index (config.replica_role), so a decision is a total and a
prefill count: the engine applies it as a scale (which adds and removes the
highest indices, decode replicas) and a change of `prefill_replicas`, which
turns the replica at the boundary from one role into the other. A replica
turned to prefill hands its decoding requests off like any prefill replica;
one turned to decode goes on decoding what it holds. The order keeps a
decode replica at every moment: a larger prefill pool is set after the
scale-out, a smaller one before the scale-in (`scale_steps`;
AsyncLLM.scale_roles applies them, the chaos harness's World too).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raylm.config import AutoscaleConfig
from raylm.engine.autoscaler import AutoscalePolicy, Decision


@dataclass(frozen=True)
class RoleDecision(Decision):
    """A Decision (its total, `num_replicas`) with the prefill pool's size."""

    prefill_replicas: int = 1


class RoleAutoscalePolicy:
    """Two AutoscalePolicy, one per role; pure (time is an argument)."""

    def __init__(self, config: AutoscaleConfig):
        self.config = config
        # Each pool within its own bounds (config.role_range: 1 to MAX - 1
        # unless --autoscale-prefill/--autoscale-decode say). A policy's MAX is
        # at least 2, which AutoscaleConfig needs: `_within` holds a pool to
        # its real bounds.
        self.ranges = {role: config.role_range(role) for role in ("prefill", "decode")}
        self.prefill, self.decode = (
            AutoscalePolicy(
                dataclasses.replace(
                    config, min_replicas=low, max_replicas=max(2, high), prefill_range=None, decode_range=None
                )
            )
            for low, high in self.ranges.values()
        )

    def decide(self, replicas: list[dict], now: float) -> RoleDecision | None:
        """A new (total, prefill) once either pool's load asked for a change
        for its delay; None meanwhile, while replicas start or leave, or
        without both roles serving."""
        if any(r.get("state") != "serving" for r in replicas):
            self.prefill.decide(replicas, now)  # (resets both: judged after the change)
            self.decode.decide(replicas, now)
            return None
        prefill = [r for r in replicas if r.get("role") == "prefill"]
        decode = [r for r in replicas if r.get("role") == "decode"]
        if not prefill or not decode:
            return None
        prefill = _with_held(prefill)
        p_decision = self.prefill.decide(prefill, now)
        d_decision = self.decode.decide(decode, now)
        if p_decision is None and d_decision is None:
            return None
        p = p_decision.num_replicas if p_decision else len(prefill)
        d = d_decision.num_replicas if d_decision else len(decode)
        p, d = _within(
            p, d, len(prefill), len(decode), max(self.config.min_replicas, 2), self.config.max_replicas, self.ranges
        )
        if (p, d) == (len(prefill), len(decode)):
            return None
        why = "; ".join(
            f"{role} {decision.reason}"
            for role, decision in (("prefill", p_decision), ("decode", d_decision))
            if decision is not None
        )
        up = p + d > len(replicas) or (p + d == len(replicas) and p > len(prefill))
        reason = f"{'up' if up else 'down'}: {len(prefill)}+{len(decode)} -> {p}+{d} (prefill+decode); {why}"
        return RoleDecision(p + d, reason, prefill_replicas=p)


def _with_held(prefill: list[dict]) -> list[dict]:
    """The prefill replicas' states with the requests held back for them
    (`pd_held`, the pool's count, on each) spread over them as waiting
    requests: copies, the states given stay as they were."""
    held = max(r.get("pd_held", 0) for r in prefill)
    if not held:
        return prefill
    n = len(prefill)
    shares = [held // n + (1 if i < held % n else 0) for i in range(n)]
    return [
        {**r, "in_flight": r.get("in_flight", 0) + share, "num_waiting": r.get("num_waiting", 0) + share}
        for r, share in zip(prefill, shares)
    ]


def _within(p: int, d: int, p0: int, d0: int, low: int, high: int, ranges: dict) -> tuple[int, int]:
    """The pools' asks (p, d; now p0, d0) within each pool's own range and
    LOW..HIGH replicas in all: past HIGH, the larger growth is cut first (the
    decode pool's on a tie), never a pool below what it has and asked to
    keep; below LOW, decode replicas are added (then prefill ones, past the
    decode pool's MAX)."""
    (p_low, p_high), (d_low, d_high) = ranges["prefill"], ranges["decode"]
    p, d = min(max(p, p_low), p_high), min(max(d, d_low), d_high)
    while p + d > high:  # (ends: with no growth left the sum is at most p0 + d0 <= high)
        if d - d0 >= p - p0 and d > max(d0, d_low):
            d -= 1
        elif p > p_low:
            p -= 1
        else:
            d -= 1
    short = max(0, low - p - d)
    added = min(short, d_high - d)
    return p + min(short - added, p_high - p), d + added


def scale_steps(current_prefill: int, prefill_replicas: int) -> tuple[str, ...]:
    """The order to apply a RoleDecision in ("roles", "scale"): a smaller
    prefill pool before the replica count changes, a larger one after, so
    that a decode replica serves throughout."""
    if prefill_replicas < current_prefill:
        return ("roles", "scale")
    return ("scale", "roles")
