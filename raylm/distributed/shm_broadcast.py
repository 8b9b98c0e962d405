"""MessageQueue: one writer, N readers, every reader gets every message in
order. Local readers read a shared-memory ring of fixed-size chunks
(shm_ring); payloads larger than a chunk reach them on a loopback ZMQ socket,
and readers on other nodes get every message over ZMQ (mq_sockets).

Every wait, on every path, ends at the caller's timeout (TimeoutError) and
when the queue is closed, locally or by its writer (QueueClosedError); a
reader that lost a message raises QueueOutOfSyncError (mq_wait).

Trust: payloads are typed msgpack (raylm.distributed.message_codec), never
unpickled. Code (a callable) travels only where the writer enables
`local_callables`, and only inline in the shared-memory ring: a segment only
this user can open (mode 0600). The remote TCP socket uses ZMQ CURVE with the
executor's keys (raylm.distributed.tcp_auth); the local overflow socket is on
loopback and carries no code.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from dataclasses import dataclass
from typing import Any

import zmq

from raylm.distributed.doorbell import DoorbellReader, DoorbellWriter
from raylm.distributed.message_codec import CallableNotAllowedError, MessageCodec
from raylm.distributed.mq_sockets import Publisher, Subscriber
from raylm.distributed.mq_wait import Backoff, QueueClosedError, QueueOutOfSyncError
from raylm.distributed.shm_ring import CHUNK_HEADER, KIND_OVERFLOW, ShmRing, unlink_segment
from raylm.distributed.tcp_auth import CurveKeys, CurveServer, tcp_auth_enabled, terminate_context

logger = logging.getLogger(__name__)

# The queue's segments in /dev/shm: raylm_mq_<pid>_<hex>.
SEGMENT_PREFIX = "raylm_mq_"
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_CHUNKS = 8


@dataclass
class MessageQueueHandle:
    """Everything a reader needs to attach; picklable, so it can travel to a
    spawned process or a Ray actor. It holds the queue's CURVE secret: pass it
    only over trusted channels (a Ray actor call, a spawned child's arguments)."""

    shm_name: str | None
    chunk_bytes: int
    max_chunks: int
    local_reader_ranks: list[int]
    local_overflow_address: str | None
    remote_address: str | None
    num_remote_readers: int = 0
    # The writer may put callables in the ring (decoded only from shared memory).
    local_callables: bool = False
    # The remote socket's CURVE keys; None when it is plain TCP (or there is none).
    tcp_keys: CurveKeys | None = None
    # The path prefix of the local readers' doorbells (named pipes), one per reader slot.
    doorbell_prefix: str | None = None


class MessageQueue:
    """One writer, N readers; every reader receives every message, in order.

    The writer constructs it; readers attach with
    `MessageQueue.create_from_handle(writer.export_handle(), rank)`. A rank in
    `local_reader_ranks` reads from shared memory, any other rank is a remote
    reader and subscribes over ZMQ at `host_ip`. The writer blocks when the
    slowest local reader is `max_chunks` messages behind.
    """

    def __init__(
        self,
        num_local_readers: int,
        num_remote_readers: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        host_ip: str = "127.0.0.1",
        local_reader_ranks: list[int] | None = None,
        codec: MessageCodec | None = None,
        local_callables: bool = False,
        tcp_keys: CurveKeys | None = None,
        authenticate_tcp: bool | None = None,
    ):
        """`local_callables`: the multiprocess executor's broadcast may carry
        callables, inline in shared memory only (not with remote readers).
        `tcp_keys`: the executor's CURVE keys for the remote socket; without
        them one is made here, unless `authenticate_tcp` is False (default: on,
        unless RAYLM_MQ_UNAUTHENTICATED_TCP=1)."""
        if num_local_readers < 0 or num_remote_readers < 0 or num_local_readers + num_remote_readers == 0:
            raise ValueError("a MessageQueue needs at least one reader")
        if chunk_bytes <= CHUNK_HEADER.size or max_chunks < 1:
            raise ValueError(f"chunk_bytes must exceed {CHUNK_HEADER.size} and max_chunks be >= 1")
        if local_reader_ranks is None:
            local_reader_ranks = list(range(num_local_readers))
        if len(local_reader_ranks) != num_local_readers:
            raise ValueError("local_reader_ranks must name one rank per local reader")
        if local_callables and num_remote_readers:
            raise ValueError("local_callables: code travels only in shared memory, and this queue has remote readers")
        self.is_writer = True
        self._local_callables = local_callables
        self.codec = codec or MessageCodec()
        self._closed = False
        self._lock = threading.Lock()
        self._chunk_bytes = chunk_bytes
        self._num_local = num_local_readers
        self._num_remote = num_remote_readers
        self._seq = 0  # of the next message
        self._zmq = zmq.Context()
        self._ring: ShmRing | None = None
        self._bells: DoorbellWriter | None = None
        self._local_pub: Publisher | None = None
        self._remote_pub: Publisher | None = None
        self._curve_server: CurveServer | None = None
        if num_local_readers:
            name = f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
            self._ring = ShmRing.create(name, chunk_bytes, max_chunks, num_local_readers)
            self._bells = DoorbellWriter(num_local_readers)
            self._local_pub = Publisher(self._zmq, "127.0.0.1")
        if num_remote_readers:
            if authenticate_tcp is None:
                authenticate_tcp = tcp_keys is not None or tcp_auth_enabled()
            if authenticate_tcp:
                # Started before the bind: no client may connect unchecked.
                self._curve_server = CurveServer(self._zmq, tcp_keys or CurveKeys.generate())
            self._remote_pub = Publisher(self._zmq, host_ip, self._curve_server)
        self._handle = MessageQueueHandle(
            shm_name=self._ring.name if self._ring else None,
            chunk_bytes=chunk_bytes,
            max_chunks=max_chunks,
            local_reader_ranks=list(local_reader_ranks),
            local_overflow_address=self._local_pub.address if self._local_pub else None,
            remote_address=self._remote_pub.address if self._remote_pub else None,
            num_remote_readers=num_remote_readers,
            local_callables=local_callables,
            tcp_keys=self._curve_server.keys if self._curve_server else None,
            doorbell_prefix=self._bells.prefix if self._bells else None,
        )

    def export_handle(self) -> MessageQueueHandle:
        return self._handle

    @classmethod
    def create_from_handle(
        cls, handle: MessageQueueHandle, rank: int, codec: MessageCodec | None = None
    ) -> MessageQueue:
        """Attach as the reader `rank` (local if `rank` is in handle.local_reader_ranks)."""
        self = cls.__new__(cls)
        self.is_writer = False
        self.codec = codec or MessageCodec()
        self._closed = False
        self._lock = threading.Lock()
        self._chunk_bytes = handle.chunk_bytes
        self._num_local = len(handle.local_reader_ranks)
        self._num_remote = handle.num_remote_readers
        self._handle = handle
        self._seq = 0  # a remote reader's next expected message; local ones read it from the ring
        self._zmq = zmq.Context()
        self._ring = None
        self._bell: DoorbellReader | None = None
        self._curve_server = None
        if rank in handle.local_reader_ranks:
            self._reader_slot = handle.local_reader_ranks.index(rank)
            self._ring = ShmRing.attach(handle.shm_name, handle.chunk_bytes, handle.max_chunks, self._num_local)
            if handle.doorbell_prefix is not None:
                self._bell = DoorbellReader(handle.doorbell_prefix, self._reader_slot)
            self._sub = Subscriber(self._zmq, handle.local_overflow_address)
        else:
            if handle.remote_address is None:
                raise ValueError(f"rank {rank} is not a local reader and the queue has no remote readers")
            self._reader_slot = None
            self._sub = Subscriber(self._zmq, handle.remote_address, handle.tcp_keys)
        return self

    @property
    def shm_name(self) -> str | None:
        return self._handle.shm_name

    def _is_closed(self) -> bool:
        return self._closed

    # ---- writer -------------------------------------------------------------------

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Block until every ZMQ reader has subscribed (enqueue also does it lazily)."""
        backoff = Backoff(timeout)
        if self._num_local:
            self._local_pub.wait_for_subscribers(self._num_local, backoff, self._is_closed)
        if self._num_remote:
            self._remote_pub.wait_for_subscribers(self._num_remote, backoff, self._is_closed)

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Send `obj` to every reader; blocks while the ring is full. On
        TimeoutError or QueueClosedError no reader got the message."""
        if not self.is_writer:
            raise RuntimeError("only the writer enqueues")
        try:
            payload, carries_code = self.codec.encode(obj), False
        except CallableNotAllowedError:
            # Tried second so that the step path pays nothing for it.
            if not self._local_callables:
                raise
            payload, carries_code = self.codec.encode(obj, allow_callables=True), True
        with self._lock:
            if self._closed:
                raise QueueClosedError("message queue is closed")
            backoff = Backoff(timeout)
            overflow = len(payload) + CHUNK_HEADER.size > self._chunk_bytes
            if carries_code and overflow:
                raise CallableNotAllowedError(
                    f"a message carrying a callable is {len(payload)} bytes, more than a chunk "
                    f"({self._chunk_bytes}): code travels only inline in shared memory, never on a socket"
                )
            # Every wait comes before the first send: a timeout then leaves the
            # message with no reader at all, and a retry duplicates it for none.
            if self._num_local:
                self._ring.wait_for_free_chunk(backoff, self._is_closed)
                if overflow:
                    self._local_pub.wait_for_subscribers(self._num_local, backoff, self._is_closed)
            if self._num_remote:
                self._remote_pub.wait_for_subscribers(self._num_remote, backoff, self._is_closed)
                self._remote_pub.send_remote(self._seq, payload)
            if self._num_local:
                if overflow:
                    # Sent before the marker is published, so a reader that sees
                    # the marker finds the payload already on its way; the seq
                    # frame lets it check that the payload is this chunk's.
                    self._local_pub.send_overflow(self._seq, payload)
                self._ring.publish(self._seq, payload, overflow)
                self._bells.ring()
            self._seq += 1

    # ---- reader -------------------------------------------------------------------

    def dequeue(self, timeout: float | None = None) -> Any:
        """The next message; TimeoutError after `timeout` seconds (the message,
        if on its way, is kept for the next call), QueueClosedError once the
        queue is closed and drained, QueueOutOfSyncError if a message went missing."""
        if self.is_writer:
            raise RuntimeError("the writer does not dequeue")
        with self._lock:
            if self._closed:
                raise QueueClosedError("message queue is closed")
            if self._sub.out_of_sync is not None:
                raise QueueOutOfSyncError(self._sub.out_of_sync)
            backoff = Backoff(timeout)
            if self._reader_slot is None:
                payload = self._sub.recv_remote(self._seq, backoff, self._is_closed)
                self._seq += 1
                return self.codec.decode(payload)
            return self._read_local(backoff)

    def _read_local(self, backoff: Backoff) -> Any:
        ring, slot = self._ring, self._reader_slot
        kind, length, seq = ring.wait_for_chunk(slot, backoff, self._bell, self._is_closed)
        # Raises before the chunk is marked read: after a timeout the next
        # dequeue picks up the same payload instead of losing it.
        overflow = None
        if kind == KIND_OVERFLOW:
            overflow = self._sub.recv_overflow(seq, backoff, lambda: ring.writer_closed, self._is_closed)
        try:
            if overflow is not None:
                return self.codec.decode(overflow)  # from a socket: never trusted with code
            with ring.inline_payload(length) as view:
                return self.codec.decode(view, trusted=self._handle.local_callables)
        finally:
            # Even if decoding failed: the writer must not wait on this chunk forever.
            ring.mark_read(slot)

    # ---- shutdown -----------------------------------------------------------------

    def close(self, unlink: bool | None = None) -> None:
        """Idempotent. The writer marks the queue closed (waking every reader) and,
        by default, unlinks the segment; a reader only detaches."""
        if self._closed:
            return
        self._closed = True
        if self.is_writer and self._ring is not None:
            self._ring.mark_closed()
            self._bells.ring()  # readers asleep on their doorbells see the flag now
        # Wait for a dequeue/enqueue in another thread to notice the flag (<= ~1 ms).
        acquired = self._lock.acquire(timeout=2.0)
        try:
            if self.is_writer:
                if self._remote_pub is not None:
                    self._remote_pub.send_close(self._seq)
                for pub in (self._local_pub, self._remote_pub):
                    if pub is not None:
                        pub.close()
                if self._curve_server is not None:
                    self._curve_server.stop()
            else:
                self._sub.close()
            if not terminate_context(self._zmq):
                logger.warning("message queue: its ZMQ context did not terminate within the bound; left to exit")
            for bells in (getattr(self, "_bells", None), getattr(self, "_bell", None)):
                if bells is not None and acquired:  # else a waiter may still use them: the process exit closes them
                    bells.close()
            if self._ring is not None:
                if acquired:
                    self._ring.segment.close()
                if unlink if unlink is not None else self.is_writer:
                    unlink_segment(self._ring.name)
        finally:
            if acquired:
                self._lock.release()

    def __del__(self):
        # A writer that is garbage collected must not leave its segment behind.
        try:
            if getattr(self, "is_writer", False) and not self._closed:
                self.close()
        except Exception:
            pass
