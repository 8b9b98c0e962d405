"""The shared-memory ring under the message queue (shm_broadcast): its segment
in /dev/shm, the layout, and the lock-free handoff of each chunk from the
writer to its local readers.

One segment (named by the queue, shm_broadcast.SEGMENT_PREFIX), mode 0600
(only this user can open it)::

    [header: closed flag, padding]                      HEADER_BYTES
    [flags: per chunk, 1 written flag + 1 per reader]   max_chunks * (1 + readers)
    [chunks: per chunk, kind u8 | length u32 | seq u64 | payload]
                                                        max_chunks * chunk_bytes

The writer takes chunk i once every reader has set its read flag (or the chunk
was never written): it clears the written flag, writes the payload, clears the
read flags and sets the written flag last. Reader r takes chunk i when the
written flag is set and its own read flag is not, reads, then sets its read
flag. x86 keeps stores in program order (and loads in program order), so a
reader that sees the written flag sees the payload; weaker memory models would
need explicit fences. A chunk of kind overflow carries no payload: it travels
on the writer's local ZMQ socket (mq_sockets), the chunk only orders it.
"""

from __future__ import annotations

import _posixshmem
import mmap
import os
import struct
from collections.abc import Callable
from multiprocessing import resource_tracker

from raylm.distributed.doorbell import DoorbellReader
from raylm.distributed.mq_wait import Backoff, QueueClosedError

HEADER_BYTES = 64
CHUNK_HEADER = struct.Struct("<BIQ")  # kind, payload length, seq
KIND_INLINE = 0
KIND_OVERFLOW = 1  # the payload travels on the local ZMQ socket


class Segment:
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


class ShmRing:
    """The ring as one process sees it (the writer, or one local reader): the
    segment and the chunk this process takes next. `is_closed` tells a wait
    that the process closed its queue meanwhile."""

    def __init__(self, segment: Segment, chunk_bytes: int, max_chunks: int, num_readers: int):
        self.segment = segment
        self.index = 0
        self._chunk_bytes = chunk_bytes
        self._max_chunks = max_chunks
        self._num_readers = num_readers
        self._all_read = b"\x01" * num_readers

    @staticmethod
    def layout_size(chunk_bytes: int, max_chunks: int, num_readers: int) -> int:
        return HEADER_BYTES + max_chunks * (1 + num_readers) + max_chunks * chunk_bytes

    @classmethod
    def create(cls, name: str, chunk_bytes: int, max_chunks: int, num_readers: int) -> ShmRing:
        segment = Segment(name, cls.layout_size(chunk_bytes, max_chunks, num_readers), create=True)
        return cls(segment, chunk_bytes, max_chunks, num_readers)

    @classmethod
    def attach(cls, name: str, chunk_bytes: int, max_chunks: int, num_readers: int) -> ShmRing:
        segment = Segment(name, cls.layout_size(chunk_bytes, max_chunks, num_readers), create=False)
        return cls(segment, chunk_bytes, max_chunks, num_readers)

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def writer_closed(self) -> bool:
        return bool(self.segment.buf[0])

    def mark_closed(self) -> None:
        """The writer's last word: every reader's wait ends with QueueClosedError."""
        self.segment.buf[0] = 1

    def _flags(self, chunk: int) -> int:
        return HEADER_BYTES + chunk * (1 + self._num_readers)

    def _base(self, chunk: int) -> int:
        return HEADER_BYTES + self._max_chunks * (1 + self._num_readers) + chunk * self._chunk_bytes

    # ---- writer -------------------------------------------------------------------

    def wait_for_free_chunk(self, backoff: Backoff, is_closed: Callable[[], bool]) -> None:
        """Wait until every reader has read the next chunk (or it was never written)."""
        buf = self.segment.buf
        flags = self._flags(self.index)
        while buf[flags] and buf[flags + 1 : flags + 1 + self._num_readers] != self._all_read:
            if is_closed():
                raise QueueClosedError("message queue is closed")
            backoff.wait()

    def publish(self, seq: int, payload: bytes, overflow: bool) -> None:
        """Write message `seq` into the next chunk (whose wait is over) and
        publish it; an overflow chunk records only the payload's length, the
        caller has sent the payload on the socket before."""
        buf = self.segment.buf
        chunk = self.index
        flags, base = self._flags(chunk), self._base(chunk)
        buf[flags] = 0
        if overflow:
            CHUNK_HEADER.pack_into(buf, base, KIND_OVERFLOW, len(payload), seq)
        else:
            CHUNK_HEADER.pack_into(buf, base, KIND_INLINE, len(payload), seq)
            start = base + CHUNK_HEADER.size
            buf[start : start + len(payload)] = payload
        buf[flags + 1 : flags + 1 + self._num_readers] = bytes(self._num_readers)
        buf[flags] = 1  # last: publishes the chunk
        self.index = (chunk + 1) % self._max_chunks

    # ---- reader -------------------------------------------------------------------

    def wait_for_chunk(
        self, slot: int, backoff: Backoff, bell: DoorbellReader | None, is_closed: Callable[[], bool]
    ) -> tuple[int, int, int]:
        """Wait until the next chunk is written and unread by reader `slot`;
        its (kind, payload length, seq)."""
        buf = self.segment.buf
        flags = self._flags(self.index)
        mine = flags + 1 + slot
        while not buf[flags] or buf[mine]:
            if buf[0] or is_closed():
                raise QueueClosedError("message queue is closed by its writer" if buf[0] else "message queue is closed")
            backoff.wait(bell)
        kind, length, seq = CHUNK_HEADER.unpack_from(buf, self._base(self.index))
        return kind, length, seq

    def inline_payload(self, length: int) -> memoryview:
        """The next chunk's inline payload, in place (release it before mark_read)."""
        start = self._base(self.index) + CHUNK_HEADER.size
        return self.segment.buf[start : start + length]

    def mark_read(self, slot: int) -> None:
        """Reader `slot` is done with the next chunk: the writer may reuse it."""
        self.segment.buf[self._flags(self.index) + 1 + slot] = 1
        self.index = (self.index + 1) % self._max_chunks
