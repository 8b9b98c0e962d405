"""The wire of a K/V transfer between nodes, shared by its server
(raylm.kv_transfer.server), its fetch (raylm.kv_transfer.fetch) and its
admission (raylm.kv_transfer.admission): how a stage is cut into sealed
frames and answered, how long a destination waits, the buffers stages are
packed, sealed and joined into, the pipe that wakes a thread beside the
steps, and the ZMQ contexts whose I/O threads yield to the steps.

The constants the tests change (`_FRAME_BYTES`, `_FAULT_PAUSE_S`) are read
through this module by the others (`frames._FRAME_BYTES`), so that one
setting reaches both ends."""

from __future__ import annotations

import os
import struct
import threading
import time

import torch
import zmq

from raylm.thread_accounting import name_thread, thread_ids, thread_name

# How long a destination waits for the source's answer: the transfer of a
# long request's blocks over a slow link fits; a source that died does not
# hold the destination's loop much longer.
FETCH_TIMEOUT_S = 30.0


# The final stage's fetch runs on the destination's loop (the request is
# paused) and its few blocks are packed before the source reports: a source
# that does not answer soon has died, and must not hold the loop for long.
FINAL_FETCH_TIMEOUT_S = 5.0


# How often a waiting fetch looks whether it was cancelled.
_CANCEL_CHECK_S = 0.1


_STATUS_OK, _STATUS_MISSING, _STATUS_FAILED = b"ok", b"missing", b"failed"


# A stage travels as frames of at most this many bytes (sealed, each
# TAG_BYTES more): a paced stage goes a frame at a time, so this is about
# the burst a copy may take from a step before it looks at its budget again.
_FRAME_BYTES = 1 << 20


# Each frame is a message of its own ([status, index and count, sealed
# bytes]), so that a pre-copy stage can be paced frame by frame (see
# _StageSend) and a final stage of another migration is answered between its
# frames. Status, index and count travel in the clear, bound to the frame by
# its seal.
_FRAME_META = struct.Struct("<II")


# The seal index of an answer's one message that is not a frame (missing,
# failed): frames number theirs from 0.
_STATUS_SEAL_INDEX = (1 << 32) - 1


# A request is a stage's name sealed: a message longer than this is no
# request, and libzmq drops its connection before taking it in (a
# handshake's commands too).
_MAX_REQUEST_BYTES = 1024


# After a fault of its own code a server's or admission's thread drops what
# it was doing and goes on after this pause (a fault on every message logs
# at most once a second).
_FAULT_PAUSE_S = 1.0


class StageBuffers:
    """Buffers of stages, each used again once nothing reads it any more: a
    source rank packs its stages into them and seals their frames into
    others (free again once ZMQ's tracker says the send is done), a
    destination opens a stage's frames into them. A
    fresh buffer the size of a long request's first stage (35 MiB for 2k
    tokens of the ~111M model) is paged in and zeroed a fault at a time, and
    unmapped again when freed: the cost kv_transfer's spare files save on
    one node, here on cores that step."""

    MAX_BUFFERS = 6  # a long request's first stage, a later one, a final one; each packed and sealed
    MAX_BUFFER_BYTES = 128 << 20  # a larger stage's buffer is not kept
    MAX_KEPT_BYTES = 256 << 20  # all kept buffers together (each rank holds its pools as long as it lives)

    def __init__(self):
        self._lock = threading.Lock()
        # (buffer, the tracker of its last send or None); free once that send is done.
        self._kept: list[tuple[torch.Tensor, zmq.MessageTracker | None]] = []

    def take(self, size: int) -> torch.Tensor:
        """A flat uint8 buffer of at least `size` bytes, nobody else's until given back."""
        with self._lock:
            free = [entry for entry in self._kept if entry[1] is None or entry[1].done]
            fitting = [entry for entry in free if entry[0].numel() >= size]
            if fitting:
                entry = min(fitting, key=lambda e: e[0].numel())
                self._drop(entry)
                return entry[0]
        return torch.empty(size, dtype=torch.uint8)

    def give_back(self, buffer: torch.Tensor, sending: zmq.MessageTracker | None = None) -> None:
        """`sending`: the tracker of a send that still reads `buffer`."""
        if buffer.numel() > self.MAX_BUFFER_BYTES:
            return
        with self._lock:
            # Past either limit, room for it only in place of smaller free ones, the smallest first.
            count = len(self._kept) + 1
            total = sum(e[0].numel() for e in self._kept) + buffer.numel()
            smaller_free = sorted(
                (e for e in self._kept if (e[1] is None or e[1].done) and e[0].numel() < buffer.numel()),
                key=lambda e: e[0].numel(),
            )
            dropped = []
            for entry in smaller_free:
                if count <= self.MAX_BUFFERS and total <= self.MAX_KEPT_BYTES:
                    break
                dropped.append(entry)
                count, total = count - 1, total - entry[0].numel()
            if count > self.MAX_BUFFERS or total > self.MAX_KEPT_BYTES:
                return
            for entry in dropped:
                self._drop(entry)
            self._kept.append((buffer, sending))

    def _drop(self, entry: tuple) -> None:
        # By identity: list.remove would compare the tensors element-wise.
        self._kept = [kept for kept in self._kept if kept is not entry]

    @property
    def num_kept(self) -> int:
        with self._lock:
            return len(self._kept)


class _Wakeup:
    """A pipe whose reading end the server's poll watches: any thread (a
    packing's callback, _SentFrames) writes a byte to wake it at once."""

    def __init__(self):
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()  # no write once closed: the number may be another file's by then
        self._closed = False

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._write_fd, b"\0")
            except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
                pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            os.close(self._write_fd)
            os.close(self.fd)


def _context_yielding_to_the_steps(socket_type: int) -> tuple[zmq.Context, zmq.Socket, list[int]]:
    """A ZMQ context for K/V transfers and its first socket (which starts the
    context's threads), and those threads' ids, named raylm-kv-... . Its I/O
    threads move a stage's frames between the socket and TCP; the caller
    makes them yield to the steps but for a final stage
    (raylm.kv_transfer.background.ThreadsBesideTheSteps). They were at nice 10 until the
    final stage's encryption and decryption (CURVE's, then), at a tenth of
    the steps' weight, stretched the pause. Linux only."""
    before = set(thread_ids())
    context = zmq.Context()
    sock = context.socket(socket_type)
    return context, sock, _name_zmq_threads(set(thread_ids()) - before)


def _name_zmq_threads(new_threads: set[int]) -> list[int]:
    """The threads among `new_threads` that name themselves ZMQbg/... (a new
    thread does so as it starts: waited for briefly), so that no other
    thread started meanwhile is taken for one, renamed raylm-kv-... (told
    from the step queues' ZMQ threads where one looks at a process's
    threads); their ids."""
    deadline = time.monotonic() + 0.2
    found = []
    while new_threads:
        for tid in list(new_threads):
            name = thread_name(tid)
            if name is not None and not name.startswith("ZMQbg/"):
                continue  # not named yet, or another's: looked at again
            new_threads.discard(tid)
            if name is not None:
                found.append(tid)
                name_thread(tid, "raylm-kv-" + name.removeprefix("ZMQbg/"))
        if not new_threads or time.monotonic() >= deadline:
            return found
        time.sleep(0.005)
    return found
