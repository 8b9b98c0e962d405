"""Prefix pulls, the supervisor's side: when routing sends a request to a
core that holds fewer of its prompt's leading blocks than another core
does, the holder's blocks are copied to the chosen core before the request
starts there, and only the rest of the prompt is computed (the cores' side:
raylm.engine.core_pull).

One pull, in order:
1. `start`: the request is the chosen core's in the ledger from now on (a
   recovery of that core sends it elsewhere, as any of its requests), but
   is held here; the holder is sent `PullExport` with the prompt's block
   hashes (as many as it holds, from the first).
2. The holder's report: its blocks are staged (files in the supervisor's
   /dev/shm folder on one node, an offer on its sealed K/V server across
   nodes). The destination is sent `PullImport` carrying the request: it
   reads them, keeps them under its own hashes, and adds the request.
3. The destination's report (the request was added whatever it says) ends
   the pull: the holder drops what is left of the stage (`PullEnd`).

Never a stall, never a failed request: the request is sent as a plain add
(it computes its whole prompt) when the holder refuses or holds none of the
blocks any more (`missing`), when the holder has not exported by the time
the destination would have computed the prefix itself (`timeout`;
raylm.engine.pull_estimate), or when the holder leaves; a pull expected to
take longer than that recompute is not started (`too_slow`); a destination that leaves
takes the request with it into recovery. A pull is a transfer that names
both cores: removing either's channel ends it (`on_channel_removed`, from
the supervisor's `_remove_channel`), the interleavings' second rule.

Bounded: at most MAX_PULLS_PER_HOLDER pulls export from one holder at once
(more requests recompute), and a request whose prefix is already being
pulled to the same core follows that pull instead of pulling it again
(its add is sent right after the pull's import, and finds the blocks).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import time
from dataclasses import dataclass, field

from raylm.engine.core_channel import CoreChannel
from raylm.engine.kv_routes import KVRoutes
from raylm.engine.ledger import Ledger
from raylm.engine.prefix_index import PrefixIndex, reusable_prefix_hashes
from raylm.engine.protocol import (
    EngineCoreRequest,
    KVNetwork,
    PullEnd,
    PullExport,
    PullImport,
    PullReport,
    PullStats,
)
from raylm.engine.pull_estimate import PullEstimate
from raylm.kv_transfer.transport import transport_for

logger = logging.getLogger(__name__)

# Pulls one holder exports at once; beyond them requests recompute.
MAX_PULLS_PER_HOLDER = 4

# A prompt is hashed for pulls up to this many blocks (as for routing).
MAX_PULL_BLOCKS = 1024

OUTCOMES = (
    "ok",
    "missing",
    "refused",
    "failed",
    "timeout",
    "too_slow",
    "holder_gone",
    "destination_gone",
    "aborted",
)


@dataclass
class Pull:
    pull_id: str
    request: EngineCoreRequest
    frame: bytes  # the request's add, encoded: sent instead when the pull falls back
    holder: CoreChannel
    destination: CoreChannel
    block_hashes: list[bytes]
    stage: str
    network: KVNetwork | None
    started: float
    deadline: float  # the holder's export is not waited for after this (time.monotonic)
    importing: bool = False  # PullImport sent: the destination has the request
    cpu_seconds: float = 0.0  # the holder's ranks' CPU on its export
    # Requests whose prefix this pull brings to the same core: sent after it.
    followers: list[tuple[str, bytes]] = field(default_factory=list)


class Pulls:
    def __init__(
        self,
        ledger: Ledger,
        index: PrefixIndex,
        block_size: int,
        kv_routes: KVRoutes,
        encode,
        enabled: bool = True,
    ):
        """`kv_routes`: which way K/V travels between two cores and where its
        stages are named, the same as for a migration."""
        self._ledger = ledger
        self._index = index
        self._block_size = block_size
        self._kv_routes = kv_routes
        self._stage_folder = kv_routes.stage_folder
        self._encode = encode
        self.enabled = enabled
        self._pulls: dict[str, Pull] = {}
        self._by_request: dict[str, str] = {}
        # Pulls ended before their holder reported (by pull id): it may write
        # their stage still; swept when it reports, or leaves.
        self._unacknowledged: dict[str, Pull] = {}
        self._ids = itertools.count()
        self.counts: collections.Counter[str] = collections.Counter()
        self.bytes_pulled = 0
        self.cpu_seconds = 0.0  # the ranks' CPU on pulls' copies, both ends
        self.estimate = PullEstimate()
        self._events: list[PullStats] = []  # pulls ended, for the front end's metrics

    def __len__(self) -> int:
        return len(self._pulls)

    # ---- starting one ------------------------------------------------------------

    def start(
        self, request: EngineCoreRequest, frame: bytes, destination: CoreChannel, hashes: list[bytes] | None = None
    ) -> bool:
        """Pull `request`'s cached prefix to `destination` (already chosen)
        when another core holds more of it; False: send it as usual.
        `hashes`: its prompt's block hashes, if routing computed them."""
        if not self.enabled or len(self._ledger.channels) < 2:
            return False
        hashes = reusable_prefix_hashes(request, self._block_size, MAX_PULL_BLOCKS, hashes)
        if not hashes:
            return False
        cores = [c for c in self._ledger.channels.values() if c.rebuilding_since is None]
        matched = self._index.matched_blocks(hashes, [c.index for c in cores])
        here = matched.get(destination.index, 0)
        holders = [c for c in cores if c is not destination and matched.get(c.index, 0) > here]
        if not holders:
            return False
        following = self._pull_to_follow(destination, hashes)
        if following is not None and following.importing:
            return False  # sent now, it lands behind the pull's import: the blocks are there
        if following is not None:
            self._hold(request.request_id, destination)
            following.followers.append((request.request_id, frame))
            self._by_request[request.request_id] = following.pull_id
            return True
        busy = collections.Counter(p.holder.index for p in self._pulls.values() if not p.importing)
        holders = [c for c in holders if busy[c.index] < MAX_PULLS_PER_HOLDER]
        if not holders:
            return False
        holder = max(holders, key=lambda c: (matched[c.index], -len(c.in_flight), -c.index))
        num_tokens = matched[holder.index] * self._block_size
        if not self.estimate.worth_starting(matched[holder.index], num_tokens, destination.stats):
            self._count("too_slow")
            return False
        pull_id = f"pull{next(self._ids)}"
        started = time.monotonic()
        pull = Pull(
            pull_id,
            request,
            frame,
            holder,
            destination,
            hashes[: matched[holder.index]],
            self._stage_folder.stage_path(pull_id, 0),
            self._kv_routes.kv_network(holder, destination),
            started,
            self.estimate.export_deadline(started, num_tokens, destination.stats),
        )
        self._pulls[pull_id] = pull
        self._by_request[request.request_id] = pull_id
        self._hold(request.request_id, destination)
        self.counts["started"] += 1
        self._send(holder, PullExport(pull_id, pull.block_hashes, pull.stage, pull.network))
        return True

    def _hold(self, request_id: str, destination: CoreChannel) -> None:
        """The request is `destination`'s from now on (a recovery of that core
        sends it elsewhere, as its others), held here until it is sent."""
        self._ledger.assign(request_id, destination)
        self._ledger[request_id].held = True

    def _release(self, request_id: str, frame: bytes, destination: CoreChannel) -> None:
        """Send a held request to its core (still its, and still serving)."""
        entry = self._ledger.get(request_id)
        if entry is None or not entry.held:
            return  # aborted, or recovered elsewhere meanwhile
        entry.held = False
        if frame and entry.channel == destination.index and self._ledger.serves(destination):
            destination.send(frame)

    def _pull_to_follow(self, destination: CoreChannel, hashes: list[bytes]) -> Pull | None:
        """A pull under way to `destination` that brings at least as much of
        this prompt's prefix as any holder has (the same leading blocks)."""
        for pull in self._pulls.values():
            n = len(pull.block_hashes)
            if pull.destination is destination and hashes[:n] == pull.block_hashes:
                return pull
        return None

    # ---- reports ---------------------------------------------------------------------

    def on_report(self, channel: CoreChannel, report: PullReport) -> None:
        pull = self._pulls.get(report.pull_id)
        if pull is None:  # ended already (fell back, or a core left)
            ended = self._unacknowledged.get(report.pull_id)
            if ended is not None and channel is ended.holder:
                # Its stage was written after the end: the holder drops it at
                # PullEnd (sent), and the supervisor's folder is swept now.
                del self._unacknowledged[report.pull_id]
                transport_for(ended.network).end_at_supervisor(self._stage_folder, ended.pull_id)
            return
        if channel is pull.holder and not pull.importing:
            if not report.ok:
                outcome = "missing" if (report.error or "").startswith("missing") else "refused"
                self._fall_back(pull, outcome)
                return
            pull.importing = True
            pull.cpu_seconds = report.cpu_seconds
            n = report.num_blocks
            self._ledger[pull.request.request_id].held = False  # on its way, in PullImport
            self._send(
                pull.destination,
                PullImport(pull.pull_id, pull.request, pull.block_hashes[:n], pull.stage, pull.network, report.sources),
            )
            self._send_followers(pull)
            return
        if channel is pull.destination and pull.importing:
            if report.ok:
                seconds = time.monotonic() - pull.started
                self.bytes_pulled += report.num_bytes
                self.estimate.observe(report.num_blocks, report.num_bytes, seconds)
                self._count("ok", report.num_bytes, seconds, pull.cpu_seconds + report.cpu_seconds)
            else:
                self._count("failed", cpu_seconds=pull.cpu_seconds + report.cpu_seconds)
            self._end(pull)

    def next_deadline(self) -> float | None:
        """The soonest export deadline of the pulls waiting for their holder."""
        return min((p.deadline for p in self._pulls.values() if not p.importing), default=None)

    def expire(self, now: float | None = None) -> None:
        """Housekeeping: a holder that has not exported by its pull's deadline
        is not waited for; stage files of pulls that ended are swept."""
        now = time.monotonic() if now is None else now
        for pull in [p for p in self._pulls.values() if not p.importing and now > p.deadline]:
            self._fall_back(pull, "timeout")
        self._sweep_ended_stages()

    def _sweep_ended_stages(self) -> None:
        """A holder that left before it exported (drained, restarted) may
        still write its stage after the sweep its leaving made: its process
        runs until it is stopped (found by the chaos harness). Such a file
        belongs to no pull under way and nobody reads it: removed at the next
        housekeeping. Files of pulls whose holder serves and will hear
        PullEnd are its to drop."""
        folder = self._stage_folder.path
        if folder is None or not self.counts["started"]:
            return
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return
        for name in names:
            pull_id = name.split("-", 1)[0]
            if pull_id.startswith("pull") and pull_id not in self._pulls and pull_id not in self._unacknowledged:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, name))

    # ---- hooks for the rest of the supervisor -------------------------------------------

    def on_channel_removed(self, channel: CoreChannel) -> None:
        """Core `channel` left: its pulls end. A holder's: the request goes
        without its prefix (unless the destination has it already). A
        destination's: the request is recovered with the core's others."""
        for pull in [p for p in self._pulls.values() if channel in (p.holder, p.destination)]:
            if channel is pull.destination:
                self._count("destination_gone")
                self._end(pull)
            elif not pull.importing:
                self._fall_back(pull, "holder_gone")
        for pull_id in [i for i, p in self._unacknowledged.items() if p.holder is channel]:
            # It will never drop the stage it may have written after the end (its
            # pulls ended just above among them).
            ended = self._unacknowledged.pop(pull_id)
            transport_for(ended.network).end_at_supervisor(self._stage_folder, pull_id)

    def holders_lost(self, indices: list[int]) -> None:
        """Cores `indices` are dead, their removal still to come (their last
        words are awaited): pulls they were to export fall back now."""
        if not indices:
            return
        for pull in [p for p in self._pulls.values() if p.holder.index in indices and not p.importing]:
            self._fall_back(pull, "holder_gone")

    def request_gone(self, request_id: str) -> None:
        """The client aborted `request_id` before its pull ended: it is not sent."""
        pull_id = self._by_request.pop(request_id, None)
        pull = self._pulls.get(pull_id) if pull_id is not None else None
        if pull is None:
            return
        if pull.request.request_id != request_id:  # a follower
            pull.followers = [(rid, frame) for rid, frame in pull.followers if rid != request_id]
            return
        if not pull.importing:
            self._count("aborted")
            pull.frame = b""  # nothing to send for it; its followers still go
            self._fall_back(pull, None)

    # ---- ending one ------------------------------------------------------------------

    def _fall_back(self, pull: Pull, outcome: str | None) -> None:
        """The request (and its followers) go to the destination without the prefix."""
        if outcome is not None:
            self._count(outcome)
            logger.info(
                "prefix pull %s of request %s: %s; it computes its prompt",
                pull.pull_id,
                pull.request.request_id[:64],
                outcome,
            )
        self._release(pull.request.request_id, pull.frame, pull.destination)
        self._send_followers(pull)
        self._end(pull)

    def _send_followers(self, pull: Pull) -> None:
        for request_id, frame in pull.followers:
            self._by_request.pop(request_id, None)
            self._release(request_id, frame, pull.destination)
        pull.followers = []

    def _end(self, pull: Pull) -> None:
        self._pulls.pop(pull.pull_id, None)
        self._send_followers(pull)  # (none left but where the destination left)
        # Requests still held (the destination left: they are recovered with
        # its others) are held no more.
        for request_id in [pull.request.request_id] + [rid for rid, _ in pull.followers]:
            self._by_request.pop(request_id, None)
            entry = self._ledger.get(request_id)
            if entry is not None:
                entry.held = False
        if not pull.importing:  # the holder may still write the stage: swept when it reports or leaves
            self._unacknowledged[pull.pull_id] = pull
        self._send(pull.holder, PullEnd(pull.pull_id, pull.stage, pull.network))
        transport_for(pull.network).end_at_supervisor(self._stage_folder, pull.pull_id)

    def _count(self, outcome: str, num_bytes: int = 0, seconds: float | None = None, cpu_seconds: float = 0.0) -> None:
        self.counts[outcome] += 1
        self.cpu_seconds += cpu_seconds
        self._events.append(PullStats(outcome, num_bytes, seconds, cpu_seconds))

    def has_events(self) -> bool:
        return bool(self._events)

    def take_events(self) -> list[PullStats]:
        events, self._events = self._events, []
        return events

    def _send(self, channel: CoreChannel, message) -> None:
        if self._ledger.serves(channel):
            channel.send(self._encode(message))
