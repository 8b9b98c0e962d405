"""An engine core's side of a prefix pull (the supervisor's side, which
plans and drives it, is raylm.engine.prefix_pull).

As the holder, a core exports the cached blocks of a prompt's leading
block hashes, as many as its prefix cache still holds from the first (none:
the pull is `missing`), pinned while its ranks copy them, and unpaced: a
request waits for them, where a migration's pre-copy yields to the steps.

As the destination, a core reads the pulled blocks into free blocks, which
join its prefix cache only under the hashes it computes itself from the
request's prompt (the interleavings' first rule: a block is shareable only
under a hash this engine computed), and only once every rank has read its
shard; then it adds the request, whose prefix lookup finds them. Nothing
half-read is ever findable: a failed read frees the blocks unregistered.
Whatever fails, the request is added and computes its prompt itself.

The K/V travels by the same transport as a migration's
(raylm.kv_transfer.transport: files in shared memory on one node, the
sealed network across nodes), one stage per pull.
"""

from __future__ import annotations

import logging

from raylm.core.kv_cache_manager import KVCacheBlock
from raylm.engine.prefix_index import prompt_block_hashes
from raylm.engine.protocol import PullEnd, PullExport, PullImport, PullReport
from raylm.kv_transfer.transport import transport_for

logger = logging.getLogger(__name__)


class PullEndpoint:
    def __init__(self, core):
        self.core = core  # EngineCore

    @property
    def _kv(self):
        return self.core.scheduler.kv_cache_manager

    def handle(self, message) -> PullReport | None:
        if isinstance(message, PullExport):
            return self._export(message)
        if isinstance(message, PullImport):
            return self._import(message)
        if isinstance(message, PullEnd):
            self._end(message)
            return None
        raise TypeError(f"not a pull message: {type(message).__name__}")

    # ---- holder --------------------------------------------------------------------

    def _export(self, message: PullExport) -> PullReport:
        blocks = self._cached_prefix(message.block_hashes)
        if not blocks:
            return _refused(message.pull_id, "missing: none of the prefix's blocks is cached here any more")
        # Pinned while the ranks copy them: an eviction would hand them to
        # another request's writes. Unpaced, the copy is over on return.
        self._kv.pool.touch(blocks)
        self._copy_cpu()  # what earlier unpaced copies spent is not this pull's
        try:
            num_bytes, sources = transport_for(message.network).export(
                self.core.executor.collective_rpc, message.path_prefix, [b.block_id for b in blocks], False
            )
        except Exception as e:
            return _refused(message.pull_id, f"exporting the prefix failed: {type(e).__name__}: {e}")
        finally:
            self._kv.pool.free(list(reversed(blocks)))
        return PullReport(
            message.pull_id,
            ok=True,
            num_blocks=len(blocks),
            num_bytes=num_bytes,
            sources=sources,
            cpu_seconds=self._copy_cpu(),
        )

    def _copy_cpu(self) -> float:
        """The ranks' CPU seconds on unpaced copies since the last call (a
        pull's own, reported apart from the background copies, which are
        paced by their budget); 0 when the ranks cannot say."""
        try:
            return float(sum(self.core.executor.collective_rpc("kv_take_copy_cpu")))
        except Exception:
            return 0.0

    def _cached_prefix(self, block_hashes: list[bytes]) -> list[KVCacheBlock]:
        if not self._kv.enable_prefix_caching or self._kv.num_shards > 1:
            return []  # a context-parallel cache is sharded over the ranks: not moved
        found = []
        for block_hash in block_hashes:
            block = self._kv.pool.cached.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def _end(self, message: PullEnd) -> None:
        """What the holder still holds of the pull's stage: its files, or an
        offer the destination never fetched."""
        try:
            transport_for(message.network).end_at_source(
                self.core.executor.collective_rpc, message.pull_id, {message.path_prefix}
            )
        except Exception as e:  # the executor is failing: its recovery drops the ranks' offers
            logger.warning("could not end the stage of prefix pull %s: %s", message.pull_id, e)

    # ---- destination -----------------------------------------------------------------

    def _import(self, message: PullImport) -> PullReport:
        request = message.request
        try:
            return self._take_in(message)
        finally:
            self.core.add_request(request)

    def _take_in(self, message: PullImport) -> PullReport:
        kv, request = self._kv, message.request
        if request.request_id in self.core.scheduler.requests:
            return _refused(message.pull_id, "a request with this id is already here")
        if not kv.enable_prefix_caching or kv.num_shards > 1:
            return _refused(message.pull_id, "this core keeps no prefix cache a pull could fill")
        if request.sampling_params.prompt_logprobs is not None:
            return _refused(message.pull_id, "the request computes every prompt position (prompt logprobs)")
        n = len(message.block_hashes)
        usable = (len(request.prompt_token_ids) - 1) // kv.block_size  # its last token is always computed
        own = prompt_block_hashes(
            request.prompt_token_ids, kv.block_size, request.cache_salt, min(n, usable), request.lora_digest
        )
        if n == 0 or own != message.block_hashes:
            return _refused(message.pull_id, "the pulled blocks are not this request's prompt's leading blocks")
        block_ids = kv.allocate_for_import(message.pull_id, n)
        if block_ids is None:
            return _refused(message.pull_id, f"no room for {n} KV blocks")
        try:
            self.core.host_tier.flush()  # what that allocation evicted goes to the tier before it is overwritten
            self._copy_cpu()
            num_bytes = transport_for(message.network).import_(
                self.core.executor.collective_rpc,
                message.path_prefix,
                block_ids,
                False,
                message.sources,
                self.core.config.parallel_config.world_size,
            )
        except Exception as e:
            kv.free_import(message.pull_id)  # never registered: nobody finds what was half read
            return _refused(message.pull_id, f"reading the prefix failed: {type(e).__name__}: {e}")
        blocks = kv.imports.pop(message.pull_id)
        for block, block_hash in zip(blocks, own):
            kv.pool.register(block, block_hash)
        # Unused until the request takes them: cached and free, the prefix's
        # tail first to go (as a finished request leaves its blocks).
        kv.pool.free(list(reversed(blocks)))
        return PullReport(message.pull_id, ok=True, num_blocks=n, num_bytes=num_bytes, cpu_seconds=self._copy_cpu())


def _refused(pull_id: str, reason: str) -> PullReport:
    logger.info("prefix pull %s refused: %s", pull_id, reason)
    return PullReport(pull_id, ok=False, error=reason)
