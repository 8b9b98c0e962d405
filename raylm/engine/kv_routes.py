"""Which way K/V goes between two engine cores, and which cores have shown
they cannot move it: the supervisor's part that live migrations
(migration.py) and prefix pulls (prefix_pull.py) share.

The way is chosen once per transfer from its pair of cores (`kv_network`):
when both run on the supervisor's node, files in its private folder in
/dev/shm (the StageFolder, which names every stage); otherwise (either core
on another node) over the network, each source rank offering its blocks on a
socket of its own and the destination's rank fetching them
(raylm.kv_transfer.network), sealed with a key this supervisor makes and
sends both sides inside their messages (raylm.kv_transfer.sealed_frames).

Neither way serves a replica whose ranks span nodes: every rank writes or
reads its own stage file in this node's /dev/shm folder (a rank elsewhere
does not have it), or offers its blocks on its core's node's address (a rank
elsewhere cannot bind it). Its transfers fail the same way every time, so a
core whose transfers keep failing is marked unable to move K/V, once, with a
warning that says why (`count_transfer`): no migration from or to it is
tried again (a drain waits for its requests to finish) until another start
of it serves.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from raylm.engine.core_channel import CoreChannel, CoreLauncher
from raylm.engine.protocol import KVNetwork, MigrationReport
from raylm.kv_transfer import sealed_frames
from raylm.kv_transfer.transport import StageFolder

logger = logging.getLogger("raylm.engine.supervisor")

# A core whose K/V transfers failed this many times in a row, none moving
# between, is taken to be unable to move K/V at all (see above). A refusal
# for room, a preemption or a request that ended says nothing of the kind.
_MAX_TRANSFER_FAILURES = 3
# How a core reports a transfer that failed (core_migration.py's words).
_TRANSFER_FAILED = ("exporting its K/V failed", "importing its K/V failed")
# Failures that cannot pass, marked at the first: a rank that cannot bind
# its core's node's address runs on another node (EADDRNOTAVAIL); an engine
# of another TP/PP layout cannot take the source's ranks' blocks.
_PERMANENT_FAILURES = ("Cannot assign requested address", "same TP/PP layout")


@dataclass
class _Transfers:
    """How the K/V transfers of one start of a core have gone."""

    channel: CoreChannel
    failures: int = 0  # in a row
    # Why it cannot move K/V (its last failure); no migration from or to it then.
    unable: str | None = None


class KVRoutes:
    """The supervisor's stage folder and network key, the way each pair of
    cores moves K/V, and each core's record of transfers."""

    def __init__(self, launcher: CoreLauncher):
        self._launcher = launcher
        self._stage_folder = StageFolder()  # where stages are named (and, through files, written)
        self._kv_key: bytes | None = None  # made by the first transfer across nodes
        # RAYLM_MIGRATION_NETWORK=1: every migration takes the sealed network
        # path, cores of one node too (the chaos harness's real tier and the
        # benchmarks reach that path, and its listening sockets, on one host).
        self._network_always = os.environ.get("RAYLM_MIGRATION_NETWORK", "").strip().lower() in ("1", "true", "yes")
        self._transfers: dict[int, _Transfers] = {}  # by core index, for the start of it that serves

    def close(self) -> None:
        """At shutdown: no transfer file outlives the engine."""
        self._stage_folder.close()

    @property
    def stage_folder(self) -> StageFolder:
        """Where this supervisor's transfers name their stages (migrations' and prefix pulls')."""
        return self._stage_folder

    @property
    def transfer_dir(self) -> str | None:
        """The folder of this supervisor's stages, once the first was named."""
        return self._stage_folder.path

    # ---- which way ----------------------------------------------------------------------

    def _shares_node(self, source: CoreChannel, destination: CoreChannel) -> bool:
        """Both cores on this supervisor's node: the K/V can go through its /dev/shm folder."""
        return (
            source.node_ip == destination.node_ip
            and self._launcher.is_local(source.index)
            and self._launcher.is_local(destination.index)
        )

    def kv_network(self, source: CoreChannel, destination: CoreChannel) -> KVNetwork | None:
        """How K/V goes from `source` to `destination` (a migration's, a prefix
        pull's): None through files, else the sealed network's host, key and peer."""
        if self._shares_node(source, destination) and not self._network_always:
            return None
        if self._kv_key is None:
            self._kv_key = sealed_frames.new_key()
        return KVNetwork(source.node_ip, self._kv_key, peer=destination.node_ip)

    # ---- cores that cannot move K/V ---------------------------------------------------------

    def count_transfer(self, channel: CoreChannel, report: MigrationReport) -> None:
        """A stage `channel` exported or imported, or refused to: past
        _MAX_TRANSFER_FAILURES failed transfers in a row (or one that cannot
        pass), the core is marked unable to move K/V, and says so once."""
        record = self._transfers.get(channel.index)
        if record is None or record.channel is not channel:  # a new start of the core: its own record
            record = self._transfers[channel.index] = _Transfers(channel)
        if report.ok:
            record.failures = 0
            return
        error = report.error or ""
        if not error.startswith(_TRANSFER_FAILED):
            return
        record.failures += 1
        permanent = any(sign in error for sign in _PERMANENT_FAILURES)
        if record.unable is None and (permanent or record.failures >= _MAX_TRANSFER_FAILURES):
            record.unable = error
            logger.warning(
                "engine core %d cannot move K/V (%s; %d transfer(s) in a row failed): no migration from or to it "
                "is tried again, its requests finish where they run. A replica whose ranks span nodes fails so: "
                "its ranks move their blocks through this node's shared memory, or offer them on the address "
                "of its core's node",
                channel.index,
                error[:300],
                record.failures,
            )

    def cannot_move_kv(self, channel: CoreChannel) -> bool:
        record = self._transfers.get(channel.index)
        return record is not None and record.channel is channel and record.unable is not None

    def on_channel_removed(self, channel: CoreChannel) -> None:
        """Core `channel` left: its record goes with it (another start of it
        begins a record of its own). Called from the supervisor's
        _remove_channel only."""
        record = self._transfers.get(channel.index)
        if record is not None and record.channel is channel:
            del self._transfers[channel.index]
