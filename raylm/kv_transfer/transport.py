"""The one interface the engine moves K/V between engines through.

A transfer kind is a `KVTransport`. Two exist: `FileTransport` (both cores
on the supervisor's node: each rank writes and reads its own file in the
supervisor's private folder in /dev/shm, raylm.kv_transfer.files) and
`NetworkTransport` (either core on another node: each source rank offers
its blocks on a socket of its own and the destination's rank fetches them,
sealed with the supervisor's transfer key, raylm.kv_transfer.network). The
supervisor picks the kind once per migration, from the pair of cores
(KVRoutes.kv_network: both on its node, or not), keeps that
migration's transport (`transport_for`) and puts the choice in every
message of the migration (its `network`); each core gets the same
transport from the message (`transport_for`). Past that choice neither side asks which kind it has:
the supervisor (raylm.engine.migration) names stages (`StageFolder`) and
ends what it made; the cores (raylm.engine.core_migration) call the
transport's methods, which call the ranks' (raylm.kv_transfer.rank)
through `rpc`, the executor's collective_rpc, always these and no others:

  kv_export(route, block_ids, background)  -> [bytes, address or None], each rank
  kv_import(route, block_ids, background)  -> bytes (None: `background`)
  kv_copies_done(names)                    -> {name: [ok, bytes or error]}
  kv_cancel(names)
  kv_withdraw(route, prefix)               -> how many offers were dropped

A `route` is plain values (a dict: it crosses to the ranks as any RPC
argument does) that names the kind (`route["kind"]`) and what its ranks
need for one stage.

A stage is named by a path in the supervisor's folder
(`<folder>/<migration id>-<stage>`): the files' prefix, and, by its last
part (`stage_name`), the name under which the ranks run its copies beside
the steps and offer its blocks.

What a new transfer kind (a prefix pull, a P/D hand-off) implements:
- here, a KVTransport subclass: `kind` and `description`; `route(stage,
  sources)`, the plain values its ranks need; `offered(addresses)`, what
  the destination is told of the source's export (each rank's address, or
  None); `check_sources(sources, world_size)`, a refusal (an exception)
  before anything is read; `end_at_source(rpc, migration_id, stages)`, what
  the source drops once the migration ends (unfetched offers, stage files);
  and `end_at_supervisor(folder, migration_id)`, what the supervisor made for
  it; and a way into `transport_for` (what in the message chooses it);
- in raylm.kv_transfer.rank, a RankTransport registered under the same
  `kind`: `export` and `import_` (each rank its own shard; `background`:
  handed to the rank's copy threads under the stage's name, so that
  `kv_copies_done` and `kv_cancel`, which every kind shares, reach it) and
  `withdraw`.
"""

from __future__ import annotations

import abc
import contextlib
import glob
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable

logger = logging.getLogger(__name__)

# The executor's collective_rpc: (method, args=...) -> one answer per rank.
RPC = Callable


def stage_name(stage: str) -> str:
    """A stage's name on the ranks (their copies, their offers): the last
    part of its path (migration id, stage)."""
    return stage.rsplit("/", 1)[-1]


class KVTransport(abc.ABC):
    """One migration's way for its K/V (see the module's docstring)."""

    kind = ""
    description = ""

    # ---- what a kind defines ------------------------------------------------------------

    @abc.abstractmethod
    def route(self, stage: str, sources: list[str] | None = None) -> dict:
        """The plain values this kind's ranks need for one stage, `kind` among them."""

    def offered(self, addresses: list[str | None]) -> list[str] | None:
        """What the destination must be told of an export (None: nothing)."""
        return None

    def check_sources(self, sources: list[str] | None, world_size: int) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """Raise before an import reads anything it could not read right."""

    def end_at_source(self, rpc: RPC, migration_id: str, stages: set[str]) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """The migration ended: drop what the source still holds of its stages."""

    def end_at_supervisor(self, folder: StageFolder, migration_id: str) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """The migration ended: remove what the supervisor made for it."""

    # ---- the same for every kind ------------------------------------------------------------

    def export(self, rpc: RPC, stage: str, block_ids: list[int], background: bool) -> tuple[int, list[str] | None]:
        """Each source rank exports its shard of `block_ids` for `stage`
        (`background`: gathered beside the steps); (bytes, `offered`)."""
        answers = rpc("kv_export", args=(self.route(stage), block_ids, background))
        return sum(size for size, _ in answers), self.offered([address for _, address in answers])

    def import_(
        self, rpc: RPC, stage: str, block_ids: list[int], background: bool, sources: list[str] | None, world_size: int
    ) -> int | None:
        """Each destination rank reads the same source rank's shard of `stage`
        into `block_ids`; the bytes, or None for `background` (read beside
        the steps: `copies_done` tells when it ended)."""
        self.check_sources(sources, world_size)
        sizes = rpc("kv_import", args=(self.route(stage, sources), block_ids, background))
        return None if background else sum(sizes)

    @staticmethod
    def copies_done(rpc: RPC, names: list[str]) -> list[dict]:
        """Per rank: the background imports of `names` that have ended, each
        [ok, bytes or error]; a rank answers for a copy once."""
        return rpc("kv_copies_done", args=(names,))

    @staticmethod
    def cancel(rpc: RPC, names: list[str]) -> None:
        """Background imports of `names` still waiting for their source give
        up now (their outcome is still `copies_done`'s)."""
        rpc("kv_cancel", args=(names,))


class FileTransport(KVTransport):
    """Through files in the supervisor's folder in /dev/shm (both cores on its
    node): each rank writes, and the destination's same rank reads, the file
    `<stage>.rank<i>` (raylm.kv_transfer.files)."""

    kind = "files"
    description = "through shared memory"

    def route(self, stage: str, sources: list[str] | None = None) -> dict:
        return {"kind": self.kind, "path_prefix": stage}

    def end_at_source(self, rpc: RPC, migration_id: str, stages: set[str]) -> None:
        """The files of a migration's stages (each rank's), once it ended: the
        supervisor removes those it finds when it ends the migration, but a
        stage the source wrote after that (its export was already on its way)
        would stay until the engine shuts down. The destination has read them
        (or given up) by the time the source hears the end."""
        for prefix in stages:
            for path in glob.glob(f"{glob.escape(prefix)}.rank*"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def end_at_supervisor(self, folder: StageFolder, migration_id: str) -> None:
        folder.remove(migration_id)


class NetworkTransport(KVTransport):
    """Over the network (either core on another node): each source rank packs
    its blocks and offers them on `host`, its core's node's address, to
    `peer`, the destination's (raylm.kv_transfer.peer_filter); the
    destination's same rank fetches them; both sealed with `key`, the
    supervisor's pre-shared transfer key (raylm.kv_transfer.network)."""

    kind = "network"
    description = "over the network"

    def __init__(self, host: str, key: bytes, peer: str = ""):
        self.host, self.key, self.peer = host, key, peer

    def route(self, stage: str, sources: list[str] | None = None) -> dict:
        return {
            "kind": self.kind,
            "name": stage_name(stage),
            "host": self.host,
            "key": self.key,
            "peer": self.peer,
            "sources": sources,
        }

    def offered(self, addresses: list[str | None]) -> list[str] | None:
        return list(addresses)

    def check_sources(self, sources: list[str] | None, world_size: int) -> None:
        if len(sources or []) != world_size:
            raise ValueError(
                f"the source offers {len(sources or [])} ranks' blocks, this engine has "
                f"{world_size} ranks (engines must have the same TP/PP layout)"
            )

    def end_at_source(self, rpc: RPC, migration_id: str, stages: set[str]) -> None:
        """Offers the destination never fetched (it gave up, or died)."""
        try:
            rpc("kv_withdraw", args=(self.route(""), f"{migration_id}-"))
        except Exception as e:
            logger.warning("could not withdraw the K/V offers of migration %s: %s", migration_id, e)


def transport_for(network) -> KVTransport:
    """A migration message's transport: its `network` (host and key; None:
    the cores share the supervisor's node)."""
    if network is None:
        return FileTransport()
    return NetworkTransport(network.host, network.key, network.peer)


class StageFolder:
    """The supervisor's private folder in shared memory where its migrations'
    stages are named (and, through files, written): made at the first
    stage, 0700 (only this user's cores read and write there), removed with
    everything in it at shutdown (`close`) or when the supervisor goes."""

    def __init__(self):
        self.path: str | None = None
        self._cleanup = None

    def make(self) -> str:
        """The folder, made now if not yet."""
        if self.path is None:
            self.path = tempfile.mkdtemp(prefix="raylm-migration-", dir=_shm_root())
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.path, True)
        return self.path

    def stage_path(self, migration_id: str, stage: int) -> str:
        return os.path.join(self.make(), f"{migration_id}-{stage}")

    def remove(self, migration_id: str) -> None:
        """The files of a migration's stages. The source removes those it
        wrote when it hears the end (FileTransport.end_at_source), in its own
        process, maybe between this glob and this unlink: a file already gone
        is no error (it ended the engine from the reading thread)."""
        for path in glob.glob(os.path.join(self.path or "/nonexistent", f"{migration_id}-*")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def close(self) -> None:
        """At shutdown: no transfer file outlives the engine. Again while the
        folder is still there: a core that was starting as the engine shut
        down may have made a file in it between the removal's listing and
        its rmdir."""
        if self._cleanup is not None:
            self._cleanup()
            for _ in range(3):
                if self.path is None or not os.path.exists(self.path):
                    break
                shutil.rmtree(self.path, ignore_errors=True)


def _shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
