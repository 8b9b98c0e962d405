"""KV blocks between ranks on different nodes (live migration across hosts;
on one node they go through files in shared memory, raylm.kv_transfer.files).

The source rank packs the blocks of a stage in memory (the same bytes as a
transfer file: header, then each layer's K and V; into buffers it keeps) and
offers them, by name, on a ZMQ ROUTER socket of its own, bound on its node's
address. The destination's rank of the same index connects, asks for the
name once, and gets the stage as messages of up to 1 MiB each, which it
opens and joins, then scatters into the blocks it reserved. A pre-copy
stage's messages go no faster than each end's copy budget allows
(raylm.kv_transfer.background: the source's packing and sealing, the
destination's opening, joining and unpacking, each end within the copy's
CPU share); a final stage's go at once, between them if need be. An offer is
handed out once and then dropped; one never asked for is withdrawn when its
migration ends (and, as a safety net, expires).

Trust: a key the supervisor makes and sends both sides inside their
migration messages, which travel on the cores' authenticated input sockets
(raylm.distributed.tcp_auth). The server's socket admits a connection only
at its handshake, and only one that presents a fresh token sealed with that
key (`SealedAdmission`; ZMQ's PLAIN mechanism carries the token to a ZAP
handler): anything else, junk, a silent connection, another mechanism, a
token that does not open or was used before, is closed by libzmq before it
can send a single message. An admitted destination seals its request with
the key too, and the source answers only a request that opens and that it
has not taken before, with every message of the answer sealed for that
request (raylm.kv_transfer.sealed_frames, AES-256-GCM): a stranger's
request gets nothing, a request played back gets nothing, the K/V is
encrypted on the wire, and a message changed on the way fails the fetch.

The pieces: the wire (raylm.kv_transfer.frames), the admission and its
heartbeats (raylm.kv_transfer.admission), the source's server
(raylm.kv_transfer.server), the destination's fetch
(raylm.kv_transfer.fetch); here, a rank's endpoint that holds them.
"""

from __future__ import annotations

import functools
import threading

import torch

from raylm.kv_transfer import files, peer_filter
from raylm.kv_transfer.background import CopyBudget
from raylm.kv_transfer.fetch import _JoinedStage, fetch
from raylm.kv_transfer.frames import FETCH_TIMEOUT_S
from raylm.kv_transfer.sealed_frames import TransferKey
from raylm.kv_transfer.server import KVBlockServer


class KVNetworkEndpoint:
    """A rank's side of cross-node transfers: its server (started on the first
    export, remade if the supervisor's transfer key changes) and its fetches."""

    def __init__(self, budget: CopyBudget | None = None):
        self._server: KVBlockServer | None = None
        self._budget = budget  # what paces its server's pre-copy stages; None: the process's

    def serve(
        self,
        kv_caches: list[torch.Tensor],
        name: str,
        block_ids: list[int],
        host: str,
        key: TransferKey,
        run_in_background=None,
        peer: str = "",
    ) -> tuple[int, str]:
        """Pack the blocks and offer them as `name`; (bytes, address to fetch them from).
        `peer`: the destination's address, the only one admitted for it ("": any).
        `run_in_background(fn, *args) -> Future`: pack on another thread (a
        fetch meanwhile waits for it); None: pack now."""
        server = self._server_for(host, key)
        size = files.packed_size(kv_caches, len(block_ids))
        buffer = server.buffers.take(size)
        try:
            if run_in_background is None:
                packed = files.pack_blocks(kv_caches, block_ids, into=buffer)
            else:
                packed = run_in_background(functools.partial(files.pack_blocks, into=buffer), kv_caches, block_ids)
        except BaseException:
            server.buffers.give_back(buffer)
            raise
        return size, server.offer(name, packed, buffer, peer)

    def fetch_into(
        self,
        kv_caches: list[torch.Tensor],
        name: str,
        block_ids: list[int],
        address: str,
        key: TransferKey,
        timeout_s: float = FETCH_TIMEOUT_S,
        cancelled: threading.Event | None = None,
        pause=None,
        local: str = "",
    ) -> int:
        """Fetch the offer `name` into `block_ids`; `pause`: called between
        frames and between layers of the unpacking (a paced copy beside the
        steps); `local`: this node's address, the one the source admits."""
        what = f"the K/V blocks {name!r} from {address}"
        if not kv_caches:
            raise files.KVTransferError("this rank holds no KV cache")
        join = _JoinedStage(what, files.packed_size(kv_caches, len(block_ids)))
        try:
            fetch(peer_filter.connect_address(local, address), name, key, timeout_s, cancelled, pause, into=join.into)
            return files.unpack_blocks(kv_caches, block_ids, join.joined(), what, pause)
        finally:
            join.release()

    def withdraw(self, prefix: str) -> int:
        if self._server is None:
            return 0
        self._server.keep_serving()
        return self._server.withdraw(prefix)

    def _server_for(self, host: str, key: TransferKey) -> KVBlockServer:
        server = self._server
        if server is not None and (server.key != key or server.host != host):
            server.close()
            server = None
        if server is None:
            server = self._server = KVBlockServer(host, key, self._budget)
        else:
            server.keep_serving()
        return server

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
