"""Tier loads, the supervisor's side: a new request routed to a core of
this node whose prompt's prefix continues, past what that core's cache
holds, in the tiers of evicted blocks of this node's cores (its own
included, raylm.core.host_tier) is sent as a `TierLoad`: the core reads
those slots into free blocks before it adds the request (the core's side:
raylm.engine.core_tier), and computes only the rest.

No holder takes part: every core's tier files are in this supervisor's
folder in /dev/shm, and a reader checks each slot's sequence number and
hash around its copy (raylm.kv_transfer.host_tier), so a slot its owner
reused meanwhile is simply not read. Nothing waits and nothing is held:
the request is dispatched at once, the load is one memory copy on the
core's loop, and whatever it could not read the request computes.

A load is chosen over a prefix pull when the tiers reach at least as far
into the prompt as any other core's cache does (a pull asks the holder for
an export; a tier load asks nobody).
"""

from __future__ import annotations

import collections
import glob
import os
import socket

from raylm.engine.core_channel import CoreChannel, CoreLauncher
from raylm.engine.core_tier import planned_replicas
from raylm.engine.prefix_index import PrefixIndex, reusable_prefix_hashes
from raylm.engine.prefix_pull import MAX_PULL_BLOCKS
from raylm.engine.protocol import EngineCoreRequest, TierLoad


class TierLoads:
    def __init__(self, index: PrefixIndex, block_size: int, launcher: CoreLauncher, folder: str | None, encode):
        """`folder`: where this node's cores keep their tier files (None: no tiers)."""
        self._index = index
        self._block_size = block_size
        self._launcher = launcher
        self._folder = folder
        self._encode = encode
        self.counts: collections.Counter[str] = collections.Counter()  # loads sent, blocks named

    @classmethod
    def for_engine(cls, config, index: PrefixIndex, launcher: CoreLauncher, kv_routes, encode) -> TierLoads:
        """With --kv-offloading-size, this node's cores keep their tier files
        in the supervisor's stage folder (made now; the cores get it, and
        this host's name, with their config; a core on another host keeps
        its own); without, no tiers."""
        folder = None
        if config.cache_config.kv_offloading_size:
            folder = kv_routes.stage_folder.make()
            config.cache_config.kv_offloading_folder = folder
            config.cache_config.kv_offloading_host = socket.gethostname()
            config.cache_config.kv_offloading_replicas = planned_replicas(config)
        return cls(index, config.cache_config.block_size, launcher, folder, encode)

    def plan(
        self, request: EngineCoreRequest, destination: CoreChannel, cores: list[CoreChannel], hashes: list | None
    ) -> bytes | None:
        """The TierLoad frame to send instead of the plain request, or None."""
        if self._folder is None or not self._launcher.is_local(destination.index):
            return None
        hashes = reusable_prefix_hashes(request, self._block_size, MAX_PULL_BLOCKS, hashes)
        if not hashes:
            return None
        matched = self._index.matched_blocks(hashes, [c.index for c in cores])
        here = matched.get(destination.index, 0)
        elsewhere = max((n for i, n in matched.items() if i != destination.index), default=0)
        local = [c.index for c in cores if self._is_ours(c.index)]
        run = self._index.tier_run(hashes[here:], local)
        if not run or here + len(run) < elsewhere:
            return None  # nothing in the tiers, or a pull brings more
        blocks = [
            (self._index.tier_prefix[core], slot, block_hash)
            for (core, slot), block_hash in zip(run, hashes[here:], strict=False)
        ]
        self.counts["loads"] += 1
        self.counts["blocks"] += len(blocks)
        return self._encode(TierLoad(request, here, blocks))

    def _is_ours(self, core: int) -> bool:
        """A core of this node whose tier files are in our folder."""
        prefix = self._index.tier_prefix.get(core)
        return (
            prefix is not None and self._launcher.is_local(core) and prefix.startswith(self._folder.rstrip("/") + "/")
        )

    def on_channel_removed(self, core: int) -> None:
        """Core `core` left: its tier files go (its ranks may be dead; a reader
        mapping one now finds nothing, and a live one keeps what it mapped)."""
        if self._is_ours(core):
            for path in glob.glob(glob.escape(self._index.tier_prefix[core]) + ".rank*"):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
