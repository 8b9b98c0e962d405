"""What the supervisor makes of its cores' messages beyond handing each part
its share (supervisor.py's `_receive` does that): whether a core may speak
for the requests its outputs name (`drop_foreign_outputs`), the engine's
stats as the sum of its cores' (`aggregate_stats`), and which pings are still
waiting for an answer (`Pings`: one pong goes up once every serving core
answered, or left).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from raylm.engine.core_channel import CoreChannel, DropLog
from raylm.engine.ledger import Ledger
from raylm.engine.protocol import EngineCoreOutputs, SchedulerStats


def drop_foreign_outputs(ledger: Ledger, channel: CoreChannel, outputs: EngineCoreOutputs, foreign: DropLog) -> None:
    """Keep only the outputs of requests routed to `channel`: a core may
    not speak for another's. Outputs of a request it was told to abort
    are expected (they cross the abort) and dropped quietly."""
    kept = []
    for out in outputs.outputs:
        entry = ledger.get(out.request_id)
        if entry is not None and entry.channel == channel.index:
            kept.append(out)
        elif out.request_id not in channel.aborted:
            foreign.dropped(f"core {channel.index} sent request {out.request_id[:64]!r}")
    outputs.outputs = kept


def aggregate_stats(channels: Mapping[int, CoreChannel]) -> SchedulerStats:
    """The serving cores' last stats, summed (rates and usage averaged)."""
    stats = [c.stats for c in channels.values() if c.stats is not None]
    n = max(1, len(stats))
    return SchedulerStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / n,
        prefix_cache_hit_rate=sum(s.prefix_cache_hit_rate for s in stats) / n,
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        prefix_cache_tier_hits=sum(s.prefix_cache_tier_hits for s in stats),
        kv_tier_blocks=sum(s.kv_tier_blocks for s in stats),
        kv_tier_capacity_blocks=sum(s.kv_tier_capacity_blocks for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        kv_capacity_tokens=sum(s.kv_capacity_tokens for s in stats),
        kv_capacity_tokens_per_rank=max((s.kv_capacity_tokens_per_rank for s in stats), default=0),
        unhealthy=next((s.unhealthy for s in stats if s.unhealthy), None),
        lora_running=sorted({name for s in stats for name in s.lora_running}),
        lora_waiting=sorted({name for s in stats for name in s.lora_waiting}),
        lora_slots=sorted({digest for s in stats for digest in s.lora_slots}),
        **_spec_decode_totals(stats),
    )


def _spec_decode_totals(stats: list[SchedulerStats]) -> dict:
    """The cores' speculative decoding totals, summed (per position and by reason too)."""
    per_pos: list[int] = []
    by_reason: dict[str, int] = {}
    for s in stats:
        for position, count in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            if position == len(per_pos):
                per_pos.append(0)
            per_pos[position] += count
        for reason, count in s.spec_decode_steps_aside_by_reason.items():
            by_reason[reason] = by_reason.get(reason, 0) + count
    return {
        "spec_decode_num_drafts": sum(s.spec_decode_num_drafts for s in stats),
        "spec_decode_num_draft_tokens": sum(s.spec_decode_num_draft_tokens for s in stats),
        "spec_decode_num_accepted_tokens": sum(s.spec_decode_num_accepted_tokens for s in stats),
        "spec_decode_num_accepted_tokens_per_pos": per_pos,
        "spec_decode_num_steps_aside": sum(s.spec_decode_num_steps_aside for s in stats),
        "spec_decode_steps_aside_by_reason": by_reason,
    }


class Pings:
    """The pings sent and the cores each still waits for (its length: how
    many are waiting); the pongs to pass up for pings whose last cores left."""

    def __init__(self) -> None:
        self._waiting: dict[int, set[int]] = {}
        self._pongs: list[int] = []  # pings answered for cores that died
        self._nonce = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def new(self, cores: Iterable[int]) -> int:
        """A ping to `cores`: its nonce."""
        self._nonce += 1
        self._waiting[self._nonce] = set(cores)
        return self._nonce

    def answered(self, nonce: int, index: int) -> bool:
        """Core `index` answered ping `nonce`: whether its pong goes up now
        (no other core is still to answer it)."""
        waiting = self._waiting.get(nonce)
        if waiting is not None:
            waiting.discard(index)
        if waiting:  # others still to answer
            return False
        self._waiting.pop(nonce, None)
        return True

    def forget_core(self, index: int) -> None:
        """A core that left will not answer: a ping only it had left to
        answer is answered here (the supervisor serves on; requests wait if
        need be)."""
        for nonce, waiting in list(self._waiting.items()):
            waiting.discard(index)
            if not waiting:
                del self._waiting[nonce]
                self._pongs.append(nonce)

    def has_pongs(self) -> bool:
        return bool(self._pongs)

    def take_pong(self) -> int | None:
        return self._pongs.pop() if self._pongs else None
