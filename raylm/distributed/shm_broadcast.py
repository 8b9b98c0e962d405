"""MessageQueue: one writer, N readers, over a shared-memory ring of fixed-size
chunks; payloads larger than a chunk, and readers on other nodes, use ZMQ.

Shared-memory layout (one segment in /dev/shm, named ``raylm_mq_<pid>_<hex>``)::

    [header: closed flag, padding]                      _HEADER_BYTES
    [flags: per chunk, 1 written flag + 1 per reader]   max_chunks * (1 + readers)
    [chunks: per chunk, kind u8 | length u32 | seq u64 | payload]
                                                        max_chunks * chunk_bytes

The protocol is lock-free. The writer takes chunk i once every reader has set
its read flag (or the chunk was never written): it clears the written flag,
writes the payload, clears the read flags and sets the written flag last.
Reader r takes chunk i when the written flag is set and its own read flag is
not, reads, then sets its read flag. x86 keeps stores in program order (and
loads in program order), so a reader that sees the written flag sees the
payload; weaker memory models would need explicit fences.

Every message carries its sequence number (0, 1, 2, ... per writer): in the
chunk header, in the first frame of an overflow payload and of a remote
message. ZMQ delivers in order but silently drops what a disconnected peer
missed, so a reader checks the number instead of trusting arrival order, and
raises QueueOutOfSyncError rather than return another message's payload.

Every wait, on every path, ends at the caller's timeout (TimeoutError) and
when the queue is closed, locally or by its writer (QueueClosedError): a peer
that dies mid-message must not hang the other side.

Trust: payloads are typed msgpack (raylm.distributed.message_codec), never
unpickled. Code (a callable) travels only where the writer enables
`local_callables`, and only inline in the shared-memory ring: a segment only
this user can open (mode 0600). The remote TCP socket uses ZMQ CURVE with the
executor's keys (raylm.distributed.tcp_auth); the local overflow socket is on
loopback and carries no code.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any

import _posixshmem
import zmq

from raylm.distributed.doorbell import DoorbellReader, DoorbellWriter
from raylm.distributed.message_codec import CallableNotAllowedError, MessageCodec
from raylm.distributed.tcp_auth import CurveKeys, CurveServer, secure_client, tcp_auth_enabled, terminate_context

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "raylm_mq_"
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_CHUNKS = 8

_HEADER_BYTES = 64
_CHUNK_HEADER = struct.Struct("<BIQ")  # kind, payload length, seq
_KIND_INLINE = 0
_KIND_OVERFLOW = 1  # the payload travels on the local ZMQ socket
_SEQ = struct.Struct("<Q")  # first frame of an overflow payload
_REMOTE_HEADER = struct.Struct("<BQ")  # kind, seq: first frame of a remote message
_REMOTE_DATA = 0
_REMOTE_CLOSE = 1

# Waiting policy: spin this long (a step's reply usually lands within it), then
# a local reader sleeps until the writer rings its doorbell (doorbell.py), in
# slices so that a writer killed without closing is noticed; other waits sleep
# with intervals doubling up to the cap, so an idle waiter costs ~1% CPU.
_SPIN_S = 50e-6
_BELL_SLICE_S = 0.05
_FIRST_SLEEP_S = 10e-6
_MAX_SLEEP_S = 1e-3
# How long close() lets undelivered ZMQ messages drain.
_ZMQ_LINGER_MS = 200
# How long a reader still waits for an overflow payload once the writer has
# closed: what it sent before closing arrives within its linger, or never.
_CLOSED_GRACE_S = _ZMQ_LINGER_MS / 1000 + 0.5


class QueueClosedError(RuntimeError):
    """The queue was closed (by its writer, or locally) while waiting on it."""


class QueueOutOfSyncError(RuntimeError):
    """A reader got a message other than the next one (one was lost or sent
    twice). It cannot tell which payload is whose any more, so every later
    dequeue raises this too: close the reader."""


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


class _Backoff:
    """Spin, then sleep with growing intervals; raises TimeoutError at the deadline."""

    __slots__ = ("deadline", "start", "sleep_s")

    def __init__(self, timeout: float | None):
        self.start = time.perf_counter()
        self.deadline = None if timeout is None else self.start + timeout
        self.sleep_s = _FIRST_SLEEP_S

    def wait(self, bell: DoorbellReader | None = None) -> None:
        now = time.perf_counter()
        if self.deadline is not None and now >= self.deadline:
            raise TimeoutError("timed out waiting on the message queue")
        if now - self.start < _SPIN_S:
            return
        if bell is not None:
            bell.wait(_BELL_SLICE_S if self.deadline is None else min(_BELL_SLICE_S, self.deadline - now))
            return
        time.sleep(self.sleep_s)
        self.sleep_s = min(self.sleep_s * 2, _MAX_SLEEP_S)

    def remaining_ms(self) -> int | None:
        if self.deadline is None:
            return None
        return max(0, int((self.deadline - time.perf_counter()) * 1000))


class _Segment:
    """A POSIX shared-memory mapping. Only the creator registers it with the
    resource tracker, so a reader's exit never unlinks the writer's segment."""

    def __init__(self, name: str, size: int, create: bool):
        self.name = name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if create:
            resource_tracker.register("/" + name, "shared_memory")
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        if self.buf is None:
            return
        self.buf.release()
        self.buf = None
        self._mmap.close()


def unlink_segment(name: str, unregister: bool = True) -> bool:
    """Remove a segment from /dev/shm if it is still there; True if this call removed it.

    `unregister` drops it from this process's resource tracker, which is the
    creator's tracker for processes spawned by the creator (multiprocessing
    hands the tracker down); a process with its own tracker passes False.
    """
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    if unregister:
        resource_tracker.unregister("/" + name, "shared_memory")
    return True


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
        if chunk_bytes <= _CHUNK_HEADER.size or max_chunks < 1:
            raise ValueError(f"chunk_bytes must exceed {_CHUNK_HEADER.size} and max_chunks be >= 1")
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
        self._max_chunks = max_chunks
        self._num_local = num_local_readers
        self._num_remote = num_remote_readers
        self._local_ranks = list(local_reader_ranks)
        self._index = 0
        self._seq = 0  # of the next message
        self._all_read = b"\x01" * num_local_readers
        self._zmq = zmq.Context()
        self._segment: _Segment | None = None
        self._bells: DoorbellWriter | None = None
        self._local_pub = self._remote_pub = None
        self._curve_server: CurveServer | None = None
        local_address = remote_address = None
        if num_local_readers:
            name = f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
            self._segment = _Segment(name, self._layout_size(), create=True)
            self._bells = DoorbellWriter(num_local_readers)
            self._local_pub, local_address = self._bind_xpub("127.0.0.1")
        if num_remote_readers:
            if authenticate_tcp is None:
                authenticate_tcp = tcp_keys is not None or tcp_auth_enabled()
            if authenticate_tcp:
                # Started before the bind: no client may connect unchecked.
                self._curve_server = CurveServer(self._zmq, tcp_keys or CurveKeys.generate())
            self._remote_pub, remote_address = self._bind_xpub(host_ip, self._curve_server)
        # Subscriptions seen so far: ZMQ drops what a PUB socket sends before a
        # subscriber is connected, so the writer waits for them before the
        # first message that needs them.
        self._subscribed = {"local": 0, "remote": 0}
        self._handle = MessageQueueHandle(
            shm_name=self._segment.name if self._segment else None,
            chunk_bytes=chunk_bytes,
            max_chunks=max_chunks,
            local_reader_ranks=self._local_ranks,
            local_overflow_address=local_address,
            remote_address=remote_address,
            num_remote_readers=num_remote_readers,
            local_callables=local_callables,
            tcp_keys=self._curve_server.keys if self._curve_server else None,
            doorbell_prefix=self._bells.prefix if self._bells else None,
        )

    # ---- construction -------------------------------------------------------------

    def _layout_size(self) -> int:
        return _HEADER_BYTES + self._max_chunks * (1 + self._num_local) + self._max_chunks * self._chunk_bytes

    def _bind_xpub(self, host: str, curve: CurveServer | None = None) -> tuple[zmq.Socket, str]:
        sock = self._zmq.socket(zmq.XPUB)
        if curve is not None:
            curve.secure(sock)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # count every subscriber, not distinct topics
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop: the ring already bounds what is in flight
        port = sock.bind_to_random_port(f"tcp://{host}")
        return sock, f"tcp://{host}:{port}"

    def export_handle(self) -> MessageQueueHandle:
        return self._handle

    @classmethod
    def create_from_handle(cls, handle: MessageQueueHandle, rank: int, codec: MessageCodec | None = None) -> "MessageQueue":
        """Attach as the reader `rank` (local if `rank` is in handle.local_reader_ranks)."""
        self = cls.__new__(cls)
        self.is_writer = False
        self.codec = codec or MessageCodec()
        self._closed = False
        self._lock = threading.Lock()
        self._chunk_bytes = handle.chunk_bytes
        self._max_chunks = handle.max_chunks
        self._num_local = len(handle.local_reader_ranks)
        self._num_remote = handle.num_remote_readers
        self._local_ranks = list(handle.local_reader_ranks)
        self._handle = handle
        self._index = 0
        self._seq = 0  # a remote reader's next expected message; local ones read it from the ring
        self._out_of_sync: str | None = None
        self._zmq = zmq.Context()
        self._segment = None
        self._bell: DoorbellReader | None = None
        self._curve_server = None
        self._sub = self._zmq.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        if rank in handle.local_reader_ranks:
            self._reader_slot = handle.local_reader_ranks.index(rank)
            self._segment = _Segment(handle.shm_name, self._layout_size(), create=False)
            if handle.doorbell_prefix is not None:
                self._bell = DoorbellReader(handle.doorbell_prefix, self._reader_slot)
            self._sub.connect(handle.local_overflow_address)
        else:
            if handle.remote_address is None:
                raise ValueError(f"rank {rank} is not a local reader and the queue has no remote readers")
            self._reader_slot = None
            if handle.tcp_keys is not None:
                secure_client(self._sub, handle.tcp_keys)
            self._sub.connect(handle.remote_address)
        return self

    @property
    def shm_name(self) -> str | None:
        return self._handle.shm_name

    # ---- writer -------------------------------------------------------------------

    def _count_subscriptions(self, which: str, needed: int, backoff: _Backoff) -> None:
        sock = self._local_pub if which == "local" else self._remote_pub
        while self._subscribed[which] < needed:
            if self._closed:
                raise QueueClosedError("message queue is closed")
            timeout = backoff.remaining_ms()
            if not sock.poll(timeout=min(10, timeout) if timeout is not None else 10):
                backoff.wait()
                continue
            event = sock.recv()
            if event[:1] == b"\x01":
                self._subscribed[which] += 1

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Block until every ZMQ reader has subscribed (enqueue also does it lazily)."""
        backoff = _Backoff(timeout)
        if self._num_local:
            self._count_subscriptions("local", self._num_local, backoff)
        if self._num_remote:
            self._count_subscriptions("remote", self._num_remote, backoff)

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
            backoff = _Backoff(timeout)
            overflow = len(payload) + _CHUNK_HEADER.size > self._chunk_bytes
            if carries_code and overflow:
                raise CallableNotAllowedError(
                    f"a message carrying a callable is {len(payload)} bytes, more than a chunk "
                    f"({self._chunk_bytes}): code travels only inline in shared memory, never on a socket"
                )
            # Every wait comes before the first send: a timeout then leaves the
            # message with no reader at all, and a retry duplicates it for none.
            if self._num_local:
                flags = self._wait_for_free_chunk(backoff)
                if overflow:
                    self._count_subscriptions("local", self._num_local, backoff)
            if self._num_remote:
                self._count_subscriptions("remote", self._num_remote, backoff)
                header = _REMOTE_HEADER.pack(_REMOTE_DATA, self._seq)
                self._remote_pub.send_multipart([header, payload], copy=False)
            if self._num_local:
                self._write_local(payload, flags, overflow)
            self._seq += 1

    def _wait_for_free_chunk(self, backoff: _Backoff) -> int:
        """Wait until every local reader has read the next chunk; its flags' offset."""
        buf = self._segment.buf
        flags = _HEADER_BYTES + self._index * (1 + self._num_local)
        while buf[flags] and buf[flags + 1 : flags + 1 + self._num_local] != self._all_read:
            if self._closed:
                raise QueueClosedError("message queue is closed")
            backoff.wait()
        return flags

    def _write_local(self, payload: bytes, flags: int, overflow: bool) -> None:
        buf = self._segment.buf
        chunk = self._index
        base = _HEADER_BYTES + self._max_chunks * (1 + self._num_local) + chunk * self._chunk_bytes
        buf[flags] = 0
        if overflow:
            # Sent before the marker is published, so a reader that sees the
            # marker finds the payload already on its way; the seq frame lets it
            # check that the payload is this chunk's.
            self._local_pub.send_multipart([_SEQ.pack(self._seq), payload], copy=False)
            _CHUNK_HEADER.pack_into(buf, base, _KIND_OVERFLOW, len(payload), self._seq)
        else:
            _CHUNK_HEADER.pack_into(buf, base, _KIND_INLINE, len(payload), self._seq)
            start = base + _CHUNK_HEADER.size
            buf[start : start + len(payload)] = payload
        buf[flags + 1 : flags + 1 + self._num_local] = bytes(self._num_local)
        buf[flags] = 1  # last: publishes the chunk
        self._bells.ring()
        self._index = (chunk + 1) % self._max_chunks

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
            if self._out_of_sync is not None:
                raise QueueOutOfSyncError(self._out_of_sync)
            backoff = _Backoff(timeout)
            if self._reader_slot is None:
                return self._read_remote(backoff)
            return self._read_local(backoff)

    def _read_local(self, backoff: _Backoff) -> Any:
        buf = self._segment.buf
        chunk = self._index
        flags = _HEADER_BYTES + chunk * (1 + self._num_local)
        mine = flags + 1 + self._reader_slot
        while not buf[flags] or buf[mine]:
            if buf[0] or self._closed:
                raise QueueClosedError("message queue is closed by its writer" if buf[0] else "message queue is closed")
            backoff.wait(self._bell)
        base = _HEADER_BYTES + self._max_chunks * (1 + self._num_local) + chunk * self._chunk_bytes
        kind, length, seq = _CHUNK_HEADER.unpack_from(buf, base)
        # Raises before the chunk is marked read: after a timeout the next
        # dequeue picks up the same payload instead of losing it.
        overflow = self._recv_overflow(seq, backoff) if kind == _KIND_OVERFLOW else None
        try:
            if overflow is not None:
                return self.codec.decode(overflow)  # from a socket: never trusted with code
            start = base + _CHUNK_HEADER.size
            with buf[start : start + length] as view:
                return self.codec.decode(view, trusted=self._handle.local_callables)
        finally:
            # Even if decoding failed: the writer must not wait on this chunk forever.
            buf[mine] = 1
            self._index = (chunk + 1) % self._max_chunks

    def _recv_overflow(self, seq: int, backoff: _Backoff) -> bytes:
        """The payload of message `seq`, from the local ZMQ socket."""
        # The writer sent it before publishing the marker we just saw, so it is
        # normally on its way; but a writer killed before it left the process,
        # or closed with it still queued past the linger, never delivers it:
        # so this wait ends at the timeout too, and after a grace once the
        # writer has closed.
        buf = self._segment.buf
        writer_closed_seen = None
        while True:
            if self._closed:
                raise QueueClosedError("message queue is closed")
            if self._poll(backoff):
                seq_frame, payload = self._sub.recv_multipart(copy=True)
                self._check_seq(_SEQ.unpack(seq_frame)[0], seq)
                return payload
            if buf[0]:
                now = time.perf_counter()
                if writer_closed_seen is None:
                    writer_closed_seen = now
                elif now - writer_closed_seen > _CLOSED_GRACE_S:
                    raise QueueClosedError(f"message queue closed by its writer before message {seq}'s payload arrived")

    def _read_remote(self, backoff: _Backoff) -> Any:
        while True:
            if self._closed:
                raise QueueClosedError("message queue is closed")
            if self._poll(backoff):
                header, payload = self._sub.recv_multipart(copy=True)
                kind, seq = _REMOTE_HEADER.unpack(header)
                if kind == _REMOTE_CLOSE:
                    raise QueueClosedError("message queue is closed by its writer")
                self._check_seq(seq, self._seq)
                self._seq += 1
                return self.codec.decode(payload)

    def _poll(self, backoff: _Backoff) -> bool:
        """Poll the ZMQ socket for one slice; TimeoutError once the deadline has
        passed (after a last zero-wait poll, so timeout=0 still takes what is there)."""
        timeout = backoff.remaining_ms()
        slice_ms = _poll_slice_ms(backoff)
        if self._sub.poll(timeout=slice_ms if timeout is None else min(slice_ms, timeout)):
            return True
        if timeout == 0:
            raise TimeoutError("timed out waiting on the message queue")
        return False

    def _check_seq(self, got: int, expected: int) -> None:
        if got != expected:
            self._out_of_sync = (
                f"message queue out of sync: got message {got} where {expected} was due "
                "(a message was lost or sent twice); this reader cannot continue"
            )
            raise QueueOutOfSyncError(self._out_of_sync)

    # ---- shutdown -----------------------------------------------------------------

    def close(self, unlink: bool | None = None) -> None:
        """Idempotent. The writer marks the queue closed (waking every reader) and,
        by default, unlinks the segment; a reader only detaches."""
        if self._closed:
            return
        self._closed = True
        if self.is_writer and self._segment is not None:
            self._segment.buf[0] = 1
            self._bells.ring()  # readers asleep on their doorbells see the flag now
        # Wait for a dequeue/enqueue in another thread to notice the flag (<= ~1 ms).
        acquired = self._lock.acquire(timeout=2.0)
        try:
            if self.is_writer:
                if self._remote_pub is not None:
                    try:
                        header = _REMOTE_HEADER.pack(_REMOTE_CLOSE, self._seq)
                        self._remote_pub.send_multipart([header, b""], flags=zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
                for sock in (self._local_pub, self._remote_pub):
                    if sock is not None:
                        sock.close(linger=_ZMQ_LINGER_MS)
                if self._curve_server is not None:
                    self._curve_server.stop()
            else:
                self._sub.close(linger=0)
            if not terminate_context(self._zmq):
                logger.warning("message queue: its ZMQ context did not terminate within the bound; left to exit")
            for bells in (getattr(self, "_bells", None), getattr(self, "_bell", None)):
                if bells is not None and acquired:  # else a waiter may still use them: the process exit closes them
                    bells.close()
            if self._segment is not None:
                if acquired:
                    self._segment.close()
                if unlink if unlink is not None else self.is_writer:
                    unlink_segment(self._segment.name)
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


def _poll_slice_ms(backoff: _Backoff) -> int:
    # Short at first for latency, then up to 10 ms: a ZMQ poll sleeps in the
    # kernel, so long slices cost no CPU; they only bound how late close() is seen.
    elapsed = time.perf_counter() - backoff.start
    return 1 if elapsed < 0.01 else 10
