"""An engine core's tier of evicted K/V blocks (`--kv-offloading-size`):
its ranks' files in shared memory, and the copies its scheduler queues.

The directory (what is where, raylm.core.host_tier) lives in the
scheduler's KV cache manager; the bytes live in one file per rank
(raylm.kv_transfer.host_tier) under `<folder>/kvtier-<id>.rank<i>`: the
supervisor's private folder in /dev/shm for a data-parallel core (so
another core of the node can read them, and nothing outlives the
supervisor), a private folder of this core's otherwise.

Sizes: `kv_offloading_size` is the node's tier; each core takes an equal
share of it, for as many replicas as the engine may run at once
(data_parallel_size, or autoscale's max), and each rank an equal share of
its core's (a slot holds a block of that rank's layers and heads). A core
started beyond that number (a manual scale-out) takes only what the node's
tier has left (`tier_room`), so the node's files never exceed the size. A
size larger than the node's free memory is refused at the core's start. The
files are made anew when the executor is rebuilt (its ranks are new); a
core that dies leaves its files to its supervisor's folder, removed with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import shutil
import socket
import tempfile
import uuid
import weakref

from raylm.engine.prefix_index import prompt_block_hashes

logger = logging.getLogger(__name__)

_GIB = 2**30

# In the folder of a node's tier files: held while a core counts them and makes its own.
TIER_LOCK = ".kvtier-lock"


def planned_replicas(config) -> int:
    """How many replicas the engine may run at once (data_parallel_size, or autoscale's max)."""
    autoscale = config.autoscale
    return max(config.parallel_config.data_parallel_size, autoscale.max_replicas if autoscale is not None else 1)


def tier_share_bytes(config) -> int:
    """This core's share of the node's tier: the supervisor says among how
    many cores (a Ray replica's own config counts one replica)."""
    cc = config.cache_config
    return int(cc.kv_offloading_size * _GIB) // (cc.kv_offloading_replicas or planned_replicas(config))


def tier_room(folder: str, size_bytes: int) -> int:
    """What is left of a node's tier of `size_bytes` beside the tier files
    other cores made in `folder` (their nominal sizes)."""
    used = 0
    for path in glob.glob(os.path.join(glob.escape(folder), "kvtier-*.rank*")):
        with contextlib.suppress(FileNotFoundError):
            used += os.stat(path).st_size
    return max(0, size_bytes - used)


@contextlib.contextmanager
def _tier_lock(folder: str):
    """One core at a time counts the folder's files and makes its own: two
    replicas started together must not both take what is left."""
    fd = os.open(os.path.join(folder, TIER_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def check_fits_node(size_gib: float) -> None:
    """Refuse a tier larger than what the node has free (memory, and /dev/shm's room)."""
    size = int(size_gib * _GIB)
    free = _mem_available()
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    room = shm.f_bavail * shm.f_frsize if shm is not None else None
    for what, limit in (("free memory", free), ("free room in /dev/shm", room)):
        if limit is not None and size > limit:
            raise ValueError(
                f"kv_offloading_size {size_gib:g} GiB is more than this node's {what} ({limit / _GIB:.1f} GiB)"
            )


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class CoreHostTier:
    def __init__(self, core):
        self.core = core  # EngineCore
        self.prefix: str | None = None  # this executor's files: <prefix>.rank<i>
        self._own_folder: str | None = None
        self._cleanup = None

    @property
    def enabled(self) -> bool:
        cc = self.core.config.cache_config
        return bool(cc.kv_offloading_size) and cc.enable_prefix_caching and cc.num_kv_shards == 1

    def open(self, at_start: bool = True) -> None:
        """Make the ranks' files and give the scheduler its directory (at the
        core's start, where a size the node cannot hold is refused; and after
        its executor was rebuilt, where the core goes on without a tier
        rather than fail its recovery)."""
        if not self.enabled:
            return
        self._remove_files()  # a rebuilt executor's ranks start new files
        config = self.core.config
        try:
            check_fits_node(config.cache_config.kv_offloading_size)
        except ValueError as e:
            if at_start:
                raise
            logger.warning("no K/V tier of evicted blocks after the rebuild: %s", e)
            return
        folder = self._folder()
        if folder is None:
            logger.warning("no K/V tier of evicted blocks: its supervisor's folder is gone (shutting down)")
            return
        with _tier_lock(folder):
            num_slots = self._open_files(folder)
        if num_slots:
            self.core.scheduler.kv_cache_manager.attach_tier(num_slots)

    def _open_files(self, folder: str) -> int:
        """Make the ranks' files of this core's share (at most what the
        node's tier has left); their slots, 0 for none."""
        config = self.core.config
        share = min(tier_share_bytes(config), tier_room(folder, int(config.cache_config.kv_offloading_size * _GIB)))
        rpc = self.core.executor.collective_rpc
        num_slots = min(rpc("kv_tier_slots", args=(share // config.parallel_config.world_size,)))
        if num_slots < 1:
            logger.warning("kv_offloading_size leaves this core's ranks no room for one block: no tier")
            return 0
        self.prefix = os.path.join(folder, f"kvtier-{uuid.uuid4().hex[:12]}")
        try:
            rpc("kv_tier_open", args=(self.prefix, num_slots))
        except Exception as e:  # a rank on another node than its core (no such folder there), or failing
            logger.warning("no K/V tier of evicted blocks: a rank could not make its file (%s)", e)
            self._remove_files()
            return 0
        logger.info("K/V tier of evicted blocks: %d blocks (%s.rank*)", num_slots, self.prefix)
        return num_slots

    def _folder(self) -> str | None:
        """The supervisor's folder on its host (None if it is gone: the engine
        is being shut down as this core starts); a private one for a core of
        its own or on another host (its tier serves that core alone)."""
        cc = self.core.config.cache_config
        if cc.kv_offloading_folder is not None and cc.kv_offloading_host == socket.gethostname():
            return cc.kv_offloading_folder if os.path.isdir(cc.kv_offloading_folder) else None
        if self._own_folder is None:
            root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            self._own_folder = tempfile.mkdtemp(prefix="raylm-kvtier-", dir=root)
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._own_folder, True)
        return self._own_folder

    def flush(self) -> None:
        """Run the copies the scheduler queued (evicted blocks out, then tier
        hits in) on every rank, before anything writes or reads those blocks."""
        kv = self.core.scheduler.kv_cache_manager
        copies = kv.take_tier_copies()
        if copies is not None:
            self.core.executor.collective_rpc("kv_tier_copy", args=(copies.stores, copies.loads))

    # ---- a request whose prefix is in the node's tiers (raylm.engine.tier_loads) ----

    def load_for(self, message) -> None:
        """Read what `message` (a TierLoad) names into free blocks, kept under
        this core's own hashes as far as each slot still held its block; then
        add the request, whatever was read."""
        try:
            self._take_in(message)
        except Exception as e:  # a failing executor: its next step finds it; the request computes its prompt
            logger.warning("loading request %s's prefix from the K/V tier failed: %s", message.request.request_id, e)
        finally:
            self.core.add_request(message.request)

    def _take_in(self, message) -> None:
        request, kv = message.request, self.core.scheduler.kv_cache_manager
        if not kv.enable_prefix_caching or kv.num_shards > 1 or request.sampling_params.prompt_logprobs is not None:
            return
        usable = (len(request.prompt_token_ids) - 1) // kv.block_size  # its last token is always computed
        last = min(usable, message.first_block + len(message.blocks))
        own = prompt_block_hashes(
            request.prompt_token_ids, kv.block_size, request.cache_salt, last, request.lora_digest
        )
        wanted = []  # (tier prefix, slot, this core's hash) of blocks not cached here
        for position, (prefix, slot, block_hash) in enumerate(message.blocks, message.first_block):
            if position >= last or own[position] != block_hash:
                break  # not this prompt's block: the hint ends here
            if block_hash not in kv.pool.cached:
                wanted.append((prefix, slot, block_hash))
        if not wanted:
            return
        mine = [h for prefix, _, h in wanted if prefix == self.prefix and kv.tier is not None and h in kv.tier]
        if mine:
            kv.tier.pin(mine)  # the evictions of the allocation below must not take their slots
        load_id = f"tier-{request.request_id}"
        if kv.allocate_for_import(load_id, len(wanted)) is None:
            self.flush()  # nothing allocated; unpinned
            return
        self.flush()  # what that allocation evicted is stored before its blocks are overwritten
        blocks = kv.imports.pop(load_id)
        for start, end in _runs_by_prefix(wanted):
            prefix = wanted[start][0]
            slots = [slot for _, slot, _ in wanted[start:end]]
            hashes = [h for _, _, h in wanted[start:end]]
            ids = [b.block_id for b in blocks[start:end]]
            good = min(self.core.executor.collective_rpc("kv_tier_read", args=(prefix, slots, hashes, ids)))
            for block, block_hash in zip(blocks[start : start + good], hashes):
                kv.pool.register(block, block_hash)
            kv.tier_hits += good * kv.block_size
        # Unused until the request takes them: cached and free, the tail first
        # to go; those that held nothing good are free and findable by no one.
        kv.pool.free(list(reversed(blocks)))

    def _remove_files(self) -> None:
        if self.prefix is not None:
            for path in glob.glob(glob.escape(self.prefix) + ".rank*"):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        self.prefix = None

    def close(self) -> None:
        """At shutdown (the ranks unlink their own files; these are what dead ones left)."""
        self._remove_files()
        if self._cleanup is not None:
            self._cleanup()


def _runs_by_prefix(wanted: list) -> list[tuple[int, int]]:
    """[start, end) of the runs of `wanted` read from one core's tier."""
    runs, start = [], 0
    for i in range(1, len(wanted) + 1):
        if i == len(wanted) or wanted[i][0] != wanted[start][0]:
            runs.append((start, i))
            start = i
    return runs
