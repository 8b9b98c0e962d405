"""MessageQueue: one writer, N readers, over a shared-memory ring of fixed-size
chunks; payloads larger than a chunk, and readers on other nodes, use ZMQ.

Shared-memory layout (one segment in /dev/shm, named ``raylm_mq_<pid>_<hex>``)::

    [header: closed flag, padding]                      _HEADER_BYTES
    [flags: per chunk, 1 written flag + 1 per reader]   max_chunks * (1 + readers)
    [chunks: per chunk, kind u8 | length u32 | payload] max_chunks * chunk_bytes

The protocol is lock-free. The writer takes chunk i once every reader has set
its read flag (or the chunk was never written): it clears the written flag,
writes the payload, clears the read flags and sets the written flag last.
Reader r takes chunk i when the written flag is set and its own read flag is
not, reads, then sets its read flag. x86 keeps stores in program order (and
loads in program order), so a reader that sees the written flag sees the
payload; weaker memory models would need explicit fences.
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

from raylm.distributed.message_codec import MessageCodec

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "raylm_mq_"
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_CHUNKS = 8

_HEADER_BYTES = 64
_CHUNK_HEADER = struct.Struct("<BI")  # kind, payload length
_KIND_INLINE = 0
_KIND_OVERFLOW = 1  # the payload travels on the local ZMQ socket
_REMOTE_DATA = b"\x00"
_REMOTE_CLOSE = b"\x01"

# Waiting policy: spin this long (a step's reply usually lands within it), then
# sleep with intervals doubling up to the cap, so an idle reader costs ~1% CPU.
_SPIN_S = 50e-6
_FIRST_SLEEP_S = 10e-6
_MAX_SLEEP_S = 1e-3
# How long close() lets undelivered ZMQ messages drain.
_ZMQ_LINGER_MS = 200


class QueueClosedError(RuntimeError):
    """The queue was closed (by its writer, or locally) while waiting on it."""


@dataclass
class MessageQueueHandle:
    """Everything a reader needs to attach; picklable, so it can travel to a
    spawned process or a Ray actor."""

    shm_name: str | None
    chunk_bytes: int
    max_chunks: int
    local_reader_ranks: list[int]
    local_overflow_address: str | None
    remote_address: str | None
    num_remote_readers: int = 0


class _Backoff:
    """Spin, then sleep with growing intervals; raises TimeoutError at the deadline."""

    __slots__ = ("deadline", "start", "sleep_s")

    def __init__(self, timeout: float | None):
        self.start = time.perf_counter()
        self.deadline = None if timeout is None else self.start + timeout
        self.sleep_s = _FIRST_SLEEP_S

    def wait(self) -> None:
        now = time.perf_counter()
        if self.deadline is not None and now >= self.deadline:
            raise TimeoutError("timed out waiting on the message queue")
        if now - self.start < _SPIN_S:
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
    ):
        if num_local_readers < 0 or num_remote_readers < 0 or num_local_readers + num_remote_readers == 0:
            raise ValueError("a MessageQueue needs at least one reader")
        if chunk_bytes <= _CHUNK_HEADER.size or max_chunks < 1:
            raise ValueError(f"chunk_bytes must exceed {_CHUNK_HEADER.size} and max_chunks be >= 1")
        if local_reader_ranks is None:
            local_reader_ranks = list(range(num_local_readers))
        if len(local_reader_ranks) != num_local_readers:
            raise ValueError("local_reader_ranks must name one rank per local reader")
        self.is_writer = True
        self.codec = codec or MessageCodec()
        self._closed = False
        self._lock = threading.Lock()
        self._chunk_bytes = chunk_bytes
        self._max_chunks = max_chunks
        self._num_local = num_local_readers
        self._num_remote = num_remote_readers
        self._local_ranks = list(local_reader_ranks)
        self._index = 0
        self._all_read = b"\x01" * num_local_readers
        self._zmq = zmq.Context()
        self._segment: _Segment | None = None
        self._local_pub = self._remote_pub = None
        local_address = remote_address = None
        if num_local_readers:
            name = f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
            self._segment = _Segment(name, self._layout_size(), create=True)
            self._local_pub, local_address = self._bind_xpub("127.0.0.1")
        if num_remote_readers:
            self._remote_pub, remote_address = self._bind_xpub(host_ip)
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
        )

    # ---- construction -------------------------------------------------------------

    def _layout_size(self) -> int:
        return _HEADER_BYTES + self._max_chunks * (1 + self._num_local) + self._max_chunks * self._chunk_bytes

    def _bind_xpub(self, host: str) -> tuple[zmq.Socket, str]:
        sock = self._zmq.socket(zmq.XPUB)
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
        self._zmq = zmq.Context()
        self._segment = None
        self._sub = self._zmq.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        if rank in handle.local_reader_ranks:
            self._reader_slot = handle.local_reader_ranks.index(rank)
            self._segment = _Segment(handle.shm_name, self._layout_size(), create=False)
            self._sub.connect(handle.local_overflow_address)
        else:
            if handle.remote_address is None:
                raise ValueError(f"rank {rank} is not a local reader and the queue has no remote readers")
            self._reader_slot = None
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
        """Send `obj` to every reader; blocks while the ring is full."""
        if not self.is_writer:
            raise RuntimeError("only the writer enqueues")
        payload = self.codec.encode(obj)
        with self._lock:
            if self._closed:
                raise QueueClosedError("message queue is closed")
            backoff = _Backoff(timeout)
            if self._num_remote:
                self._count_subscriptions("remote", self._num_remote, backoff)
                self._remote_pub.send_multipart([_REMOTE_DATA, payload], copy=False)
            if self._num_local:
                self._write_local(payload, backoff)

    def _write_local(self, payload: bytes, backoff: _Backoff) -> None:
        buf = self._segment.buf
        chunk = self._index
        flags = _HEADER_BYTES + chunk * (1 + self._num_local)
        while buf[flags] and buf[flags + 1 : flags + 1 + self._num_local] != self._all_read:
            if self._closed:
                raise QueueClosedError("message queue is closed")
            backoff.wait()
        base = _HEADER_BYTES + self._max_chunks * (1 + self._num_local) + chunk * self._chunk_bytes
        buf[flags] = 0
        if len(payload) + _CHUNK_HEADER.size > self._chunk_bytes:
            self._count_subscriptions("local", self._num_local, backoff)
            # Sent before the marker is published, so a reader that sees the
            # marker finds the payload already on its way.
            self._local_pub.send(payload, copy=False)
            _CHUNK_HEADER.pack_into(buf, base, _KIND_OVERFLOW, len(payload))
        else:
            _CHUNK_HEADER.pack_into(buf, base, _KIND_INLINE, len(payload))
            start = base + _CHUNK_HEADER.size
            buf[start : start + len(payload)] = payload
        buf[flags + 1 : flags + 1 + self._num_local] = bytes(self._num_local)
        buf[flags] = 1  # last: publishes the chunk
        self._index = (chunk + 1) % self._max_chunks

    # ---- reader -------------------------------------------------------------------

    def dequeue(self, timeout: float | None = None) -> Any:
        """The next message; TimeoutError after `timeout` seconds, QueueClosedError
        once the queue is closed and drained."""
        if self.is_writer:
            raise RuntimeError("the writer does not dequeue")
        with self._lock:
            if self._closed:
                raise QueueClosedError("message queue is closed")
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
            backoff.wait()
        base = _HEADER_BYTES + self._max_chunks * (1 + self._num_local) + chunk * self._chunk_bytes
        try:
            kind, length = _CHUNK_HEADER.unpack_from(buf, base)
            if kind == _KIND_OVERFLOW:
                return self.codec.decode(self._recv_overflow())
            start = base + _CHUNK_HEADER.size
            with buf[start : start + length] as view:
                return self.codec.decode(view)
        finally:
            # Even if decoding failed: the writer must not wait on this chunk forever.
            buf[mine] = 1
            self._index = (chunk + 1) % self._max_chunks

    def _recv_overflow(self) -> bytes:
        # The writer sent the payload before publishing the marker we just saw,
        # so it is already on its way: wait for it regardless of the caller's
        # timeout (giving up now would lose the message), but notice close().
        while not self._sub.poll(timeout=10):
            if self._closed:
                raise QueueClosedError("message queue is closed")
        return self._sub.recv(copy=True)

    def _read_remote(self, backoff: _Backoff) -> Any:
        while True:
            if self._closed:
                raise QueueClosedError("message queue is closed")
            timeout = backoff.remaining_ms()
            if self._sub.poll(timeout=min(_poll_slice_ms(backoff), timeout) if timeout is not None else _poll_slice_ms(backoff)):
                kind, payload = self._sub.recv_multipart(copy=True)
                if kind == _REMOTE_CLOSE:
                    raise QueueClosedError("message queue is closed by its writer")
                return self.codec.decode(payload)
            if timeout == 0:
                raise TimeoutError("timed out waiting on the message queue")

    # ---- shutdown -----------------------------------------------------------------

    def close(self, unlink: bool | None = None) -> None:
        """Idempotent. The writer marks the queue closed (waking every reader) and,
        by default, unlinks the segment; a reader only detaches."""
        if self._closed:
            return
        self._closed = True
        if self.is_writer and self._segment is not None:
            self._segment.buf[0] = 1
        # Wait for a dequeue/enqueue in another thread to notice the flag (<= ~1 ms).
        acquired = self._lock.acquire(timeout=2.0)
        try:
            if self.is_writer:
                if self._remote_pub is not None:
                    try:
                        self._remote_pub.send_multipart([_REMOTE_CLOSE, b""], flags=zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
                for sock in (self._local_pub, self._remote_pub):
                    if sock is not None:
                        sock.close(linger=_ZMQ_LINGER_MS)
            else:
                self._sub.close(linger=0)
            self._zmq.term()
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
