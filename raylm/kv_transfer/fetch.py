"""A destination rank's side of a K/V transfer between nodes: it connects
to the source rank's server (raylm.kv_transfer.server) with a token of the
transfer key, asks for a stage once, and opens its sealed frames into one
buffer as they come (`fetch`, `_JoinedStage`); a paced fetch reads no
faster than the process's copy budget allows, which holds the source back."""

from __future__ import annotations

import threading
import time

import torch
import zmq

from raylm.kv_transfer import frames
from raylm.kv_transfer.admission import SealedAdmission
from raylm.kv_transfer.background import ThreadsBesideTheSteps, process_copy_budget
from raylm.kv_transfer.files import KVTransferError
from raylm.kv_transfer.frames import (
    _CANCEL_CHECK_S,
    _FRAME_META,
    _STATUS_FAILED,
    _STATUS_MISSING,
    _STATUS_OK,
    _STATUS_SEAL_INDEX,
    FETCH_TIMEOUT_S,
    StageBuffers,
    _context_yielding_to_the_steps,
)
from raylm.kv_transfer.sealed_frames import AnswerSeal, SealBroken, TransferKey

# A paced fetch's socket holds at most this many messages ahead of its
# reading: libzmq's I/O thread stops reading (and the source, its TCP window
# full, stops sending) while the socket's queue is full, so the
# destination's reading, paced by its CPU budget, paces the source's sending.
_PACED_RECEIVE_QUEUE = 2


_fetch_context: zmq.Context | None = None


_fetch_threads = ThreadsBesideTheSteps([])  # its I/O threads


_fetch_context_lock = threading.Lock()


def _fetch_zmq_context() -> zmq.Context:
    """The context every fetch of this process uses, its threads yielding to
    the steps (see above) and counted in the process's copy budget (they take the frames in)."""
    global _fetch_context, _fetch_threads
    with _fetch_context_lock:
        if _fetch_context is None:
            context, first, io_threads = _context_yielding_to_the_steps(zmq.DEALER)
            first.close(linger=0)
            process_copy_budget().count(io_threads)
            _fetch_threads = ThreadsBesideTheSteps(io_threads)
            _fetch_context = context
        return _fetch_context


def fetch(
    address: str,
    name: str,
    key: TransferKey,
    timeout_s: float = FETCH_TIMEOUT_S,
    cancelled: threading.Event | None = None,
    pause=None,
    into=None,
) -> list[bytearray]:
    """The packed blocks offered as `name` at `address`, as the frames they
    came in, opened; the wait gives up once nothing came for `timeout_s` (a
    paced stage takes longer than that as a whole), or once `cancelled` is
    set. `pause`: called after each message (a paced copy beside the steps:
    no more is taken in meanwhile, see _PACED_RECEIVE_QUEUE). `into(index,
    count, size)`: a writable view of `size` bytes to open frame `index` of
    `count` into (none is returned), so that a stage is joined as it comes
    and each message's memory goes back at once; without it, each frame is
    opened into a bytearray of its own. A message that does not open with
    the key fails the fetch."""
    sock = _fetch_zmq_context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, AnswerSeal.sealed_size(frames._FRAME_BYTES))  # no larger frame is ours
    SealedAdmission.present(sock, key)
    if pause is not None:
        sock.setsockopt(zmq.RCVHWM, _PACED_RECEIVE_QUEUE)
    request, seal = key.seal_request(name.encode())
    sock.connect(address)
    parts: list[bytearray] = []
    if into is None:

        def into(index: int, count: int, size: int) -> memoryview:
            parts.append(bytearray(size))
            return memoryview(parts[-1])

    received = 0
    urgent = pause is None  # a final stage, its request paused: taken in at the steps' priority
    if urgent:
        _fetch_threads.urgent_begin()
    try:
        try:
            # Queued at once on the connection connect() made: with no
            # reconnection (a token admits once) a connection whose handshake
            # has already been refused leaves the socket none, and a send would wait for ever.
            sock.send(request, zmq.NOBLOCK)
        except zmq.Again:
            raise KVTransferError(
                f"the source rank at {address} refused the connection to fetch {name!r} "
                "(its handshake: the transfer key, or the source gone)"
            ) from None
        count = None
        while count is None or received < count:
            message = _next_message(sock, address, name, timeout_s, cancelled)
            status = message[0].bytes
            if status in (_STATUS_MISSING, _STATUS_FAILED) and len(message) == 2:
                try:
                    reason = seal.open(_STATUS_SEAL_INDEX, status, message[1].buffer)
                except SealBroken:
                    raise _broken(address, name) from None
                if status == _STATUS_MISSING:
                    raise KVTransferError(f"the source rank at {address} offers no K/V blocks {name!r}")
                raise KVTransferError(
                    f"the source rank at {address} failed to pack {name!r}: {reason.decode(errors='replace')}"
                )
            if status != _STATUS_OK or len(message) != 3 or len(message[1].bytes) != _FRAME_META.size:
                raise KVTransferError(f"the source rank at {address} answered {name!r} out of form")
            header = message[1].bytes
            index, total = _FRAME_META.unpack(header)
            if index != received or (count is not None and total != count):
                raise KVTransferError(f"the K/V blocks {name!r} from {address} came out of order")
            count = total
            received += 1
            sealed = message[2].buffer
            size = len(sealed) - AnswerSeal.sealed_size(0)
            if size < 0:
                raise KVTransferError(f"the source rank at {address} answered {name!r} out of form")
            try:
                seal.open_into(index, status + header, sealed, into(index, count, size))
            except SealBroken:
                raise _broken(address, name) from None
            del message, sealed
            if pause is not None:
                pause()
    finally:
        sock.close(linger=0)
        if urgent:
            _fetch_threads.urgent_end()
    return parts


def _broken(address: str, name: str) -> KVTransferError:
    return KVTransferError(
        f"an answer for the K/V blocks {name!r} from {address} does not open with the transfer key "
        "(not sent by the source rank, or changed on the way)"
    )


def _next_message(
    sock: zmq.Socket, address: str, name: str, timeout_s: float, cancelled: threading.Event | None
) -> list[zmq.Frame]:
    deadline = time.monotonic() + timeout_s
    while not sock.poll(int(1000 * max(0.0, min(_CANCEL_CHECK_S, deadline - time.monotonic())))):
        if cancelled is not None and cancelled.is_set():
            raise KVTransferError(f"the fetch of the K/V blocks {name!r} from {address} was cancelled")
        if time.monotonic() >= deadline:
            raise KVTransferError(
                f"the source rank at {address} did not send the K/V blocks {name!r} within {timeout_s:.0f} s"
            )
    return sock.recv_multipart(copy=False)


# Where a destination joins a stage's frames (process-wide: the fetches of
# all its migrations).
_joined_stages = StageBuffers()


class _JoinedStage:
    """A stage's frames opened into one buffer as they arrive, each
    message's memory (libzmq's) let go once opened rather than the whole
    stage held to its end. `limit`: the bytes of the blocks reserved for it;
    a stage of more frames than those fill is refused at its first frame,
    before any buffer is taken for it."""

    def __init__(self, what: str, limit: int):
        self._what, self._limit = what, limit
        self._buffer: torch.Tensor | None = None
        self._view: memoryview | None = None
        self._size = 0

    def into(self, index: int, count: int, size: int) -> memoryview:
        """Where frame `index` of `count`, of `size` bytes, is opened (see fetch)."""
        if self._buffer is None:
            if (count - 1) * frames._FRAME_BYTES >= self._limit:
                raise KVTransferError(
                    f"{self._what} come in {count} frames, more than the {self._limit} bytes of the blocks "
                    "reserved for them fill (another KV layout, or other blocks)"
                )
            # The sender's frames are at most frames._FRAME_BYTES (the same code at both ends).
            self._buffer = _joined_stages.take(count * frames._FRAME_BYTES)
            self._view = memoryview(self._buffer.numpy())
        if size > frames._FRAME_BYTES or self._size + size > len(self._view):
            raise KVTransferError(f"{self._what} came in frames over {frames._FRAME_BYTES} bytes")
        out = self._view[self._size : self._size + size]
        self._size += size
        return out

    def joined(self):
        return self._view[: self._size] if self._view is not None else b""

    def release(self) -> None:
        self._view = None
        if self._buffer is not None:
            _joined_stages.give_back(self._buffer)
            self._buffer = None
