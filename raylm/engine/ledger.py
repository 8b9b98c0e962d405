"""The supervisor's ledger (supervisor.py): every request in flight in an
engine core, as first sent and with the tokens that came back, and the cores
that serve, each with the requests it holds.

Both sides of "core C holds request R" live here, `LedgerEntry.channel` and
`CoreChannel.in_flight`, and only the ledger's methods change them, so the
two never disagree: a request is held by exactly one serving core, or waits
for one (channel -1, in `waiting`). Routing, recovery, migration and
scaling read the ledger and ask it to move requests; none of them keeps a
copy of who holds what.

A `Ledger` reads as a mapping of request id to `LedgerEntry` (what the
supervisor's readers, the tests and the benchmarks look at).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from raylm.engine.core_channel import CoreChannel
from raylm.engine.protocol import EngineCoreRequest


@dataclass
class LedgerEntry:
    """A request in flight in a core: as first sent, and what came back."""

    request: EngineCoreRequest
    channel: int  # the core serving it; -1 while it waits for one
    token_ids: list[int] = field(default_factory=list)  # generated so far, across cores
    pinned: bool = False  # sent to a data_parallel_rank by its client: never moved by rebalancing
    # Held by the supervisor until its prefix is pulled to its core
    # (raylm.engine.prefix_pull): the core does not have it yet, so it cannot migrate.
    held: bool = False
    # Prompt tokens its core still has to compute, as routing estimated when
    # it sent it there (Router: its prompt less the prefix cached or pulled
    # there); 0 once its first token there came back. Summed per core, the
    # kv_aware policy's count of a core's pending prompt work (routing.load_of).
    prefill_tokens: int = 0

    def continuation(self) -> EngineCoreRequest:
        """The request to send again: it continues after the tokens so far.
        Prompt logprobs start again from the prompt's first position; those
        the client already has are skipped above (OutputProcessor)."""
        return self.request.continuation(self.token_ids)


class Ledger(Mapping[str, LedgerEntry]):
    def __init__(self):
        self._entries: dict[str, LedgerEntry] = {}
        # The cores that serve, by index (one start of each index at a time).
        # Never replaced: the supervisor's shutdown holds this very dict.
        self.channels: dict[int, CoreChannel] = {}
        self.waiting: list[str] = []  # request ids with no core to go to yet

    # ---- the mapping ---------------------------------------------------------------

    def __getitem__(self, request_id: str) -> LedgerEntry:
        return self._entries[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    # ---- requests ----------------------------------------------------------------------

    def add(self, request: EngineCoreRequest, pinned: bool) -> LedgerEntry:
        entry = self._entries[request.request_id] = LedgerEntry(
            request, -1, list(request.output_token_ids), pinned=pinned
        )
        return entry

    def assign(self, request_id: str, channel: CoreChannel) -> None:
        """`channel` holds the request from now on (it is being sent there)."""
        if not channel.in_flight:
            channel.last_heard = time.monotonic()  # its silence while idle was no hang
        channel.in_flight.add(request_id)
        channel.num_routed += 1
        self._entries[request_id].channel = channel.index

    def wait(self, request_id: str) -> None:
        """No core can take the request now: it waits for one."""
        self._entries[request_id].channel = -1
        self.waiting.append(request_id)

    def take_waiting(self) -> list[str]:
        """The requests waiting for a core, once one serves (else none)."""
        if not self.waiting or not self.serving():
            return []
        waiting, self.waiting = self.waiting, []
        return [rid for rid in waiting if rid in self._entries]

    def finished(self, request_id: str, channel: CoreChannel) -> None:
        channel.in_flight.discard(request_id)
        del self._entries[request_id]

    def release(self, request_id: str, channel: CoreChannel) -> None:
        """`channel` no longer holds the request (it is sent again next, or has ended)."""
        channel.in_flight.discard(request_id)

    def abort(self, request_ids: list[str]) -> dict[int, list[str]]:
        """The requests leave the ledger; returns those each core must be
        told to abort, by core index."""
        by_channel: dict[int, list[str]] = {}
        for request_id in request_ids:
            entry = self._entries.pop(request_id, None)
            if entry is None:
                continue
            channel = self.channels.get(entry.channel)
            if channel is not None:
                channel.in_flight.discard(request_id)
                channel.aborted.append(request_id)
                by_channel.setdefault(channel.index, []).append(request_id)
        if self.waiting and len(by_channel) < len(request_ids):
            self.waiting = [rid for rid in self.waiting if rid in self._entries]
        return by_channel

    def drop(self, request_id: str) -> None:
        """A request failed by the supervisor itself (a culprit): it leaves
        (its core died: no core holds it)."""
        del self._entries[request_id]

    def move(self, request_id: str, source: CoreChannel, destination: CoreChannel) -> None:
        """A migration's hand-over, or its undoing: `destination` holds the
        request from now on; `source` no longer does."""
        source.in_flight.discard(request_id)
        if not destination.in_flight:
            destination.last_heard = time.monotonic()
        destination.in_flight.add(request_id)
        self._entries[request_id].channel = destination.index

    def requests_on(self, channel: CoreChannel) -> dict[str, EngineCoreRequest]:
        """The requests `channel` holds, as first sent (their failure records)."""
        return {rid: self._entries[rid].request for rid in channel.in_flight if rid in self._entries}

    def any_quarantined(self) -> bool:
        return any(entry.request.quarantined for entry in self._entries.values())

    # ---- cores -----------------------------------------------------------------------------

    def adopt(self, channel: CoreChannel) -> None:
        if channel.index in self.channels:  # would orphan the requests of the core serving it
            raise RuntimeError(f"engine core {channel.index} started twice")
        self.channels[channel.index] = channel

    def remove(self, index: int) -> CoreChannel | None:
        """Core `index`'s channel leaves (None if gone already). Its requests
        stay in the ledger, naming it, until they are sent again: only the
        supervisor's _remove_channel calls this (the transfers that name the
        core end there too)."""
        return self.channels.pop(index, None)

    def serves(self, channel: CoreChannel) -> bool:
        """Whether this start of a core is still the one serving its index."""
        return self.channels.get(channel.index) is channel

    def serving(self) -> list[CoreChannel]:
        """The cores that take new requests (not draining)."""
        return [c for c in self.channels.values() if not c.draining]
