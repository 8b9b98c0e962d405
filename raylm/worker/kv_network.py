"""KV blocks between ranks on different nodes (live migration across hosts;
on one node they go through files in shared memory, raylm.worker.kv_transfer).

The source rank packs the blocks of a stage in memory (the same bytes as a
transfer file: header, then each layer's K and V; into buffers it keeps) and
offers them, by name, on a ZMQ ROUTER socket of its own, bound on its node's
address. The destination's rank of the same index connects, asks for the
name once, and gets the stage as messages of up to 1 MiB each, which it
opens and joins, then scatters into the blocks it reserved. A pre-copy
stage's messages go no faster than each end's copy budget allows
(raylm.worker.kv_background: the source's packing and sealing, the
destination's opening, joining and unpacking, each end within the copy's
CPU share); a final stage's go at once, between them if need be. An offer is
handed out once and then dropped; one never asked for is withdrawn when its
migration ends (and, as a safety net, expires).

Trust: a key the supervisor makes and sends both sides inside their
migration messages, which travel on the cores' authenticated input sockets
(raylm.distributed.tcp_auth). The destination seals its request with it, and
the source answers only a request that opens, with every message of the
answer sealed for that request (raylm.distributed.sealed_frames, AES-256-GCM):
a stranger's request gets nothing, the K/V is encrypted on the wire, and a
message changed on the way fails the fetch. Measured against Ray's object
store on the two-host harness: benchmarks/bench_kv_transport.py.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import queue
import struct
import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch
import zmq

from raylm.distributed import tcp_auth
from raylm.distributed.sealed_frames import AnswerSeal, SealBroken, TransferKey
from raylm.distributed.tcp_auth import terminate_context
from raylm.worker import kv_transfer
from raylm.worker.cpu_placement import name_this_thread, name_thread, thread_ids, thread_name
from raylm.worker.kv_background import CopyBudget, ThreadsBesideTheSteps, no_wakeup_preemption, process_copy_budget

logger = logging.getLogger(__name__)

# An offer nobody fetched (its destination died, and the supervisor that
# would withdraw it too) is dropped after this long.
_OFFER_TTL_S = 300.0
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
# request, and libzmq drops its connection before taking it in.
_MAX_REQUEST_BYTES = 1024
# A paced fetch's socket holds at most this many messages ahead of its
# reading: libzmq's I/O thread stops reading (and the source, its TCP window
# full, stops sending) while the socket's queue is full, so the
# destination's reading, paced by its CPU budget, paces the source's sending.
_PACED_RECEIVE_QUEUE = 2
# The server's thread wakes when a request comes, a packing ends, a paced
# frame has been sent (_SentFrames) or its copy budget allows the next;
# with none of those due it still looks this often whether a send has stalled.
_STALL_CHECK_S = 1.0


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
                key=lambda e: e[0].numel())
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


class _StageSend:
    """One stage on its way to a destination, a frame per message, each
    sealed for the request it answers just before it goes. A final stage
    goes at once (its request is paused). A pre-copy stage goes a frame at a
    time: the next once the last one has been sent (its tracker done: libzmq
    has written it to the socket, on the I/O thread's clock) and the
    process's copy budget allows, so that sealing and sending, with the
    packing and the rest of the process's copies, stay within their CPU
    share (sent in one burst, a 2k-token stage made the destination's steps
    4-22% slower over its pre-copy on the two-host benchmark). The
    destination paces its reading by its own budget, which holds the frames
    back here (its socket's queue full, then TCP's window)."""

    def __init__(self, identity: bytes, seal: AnswerSeal, packed: torch.Tensor | Future,
                 buffer: torch.Tensor | None, buffers: StageBuffers, budget: CopyBudget | None = None,
                 sent_frames: _SentFrames | None = None):
        self.identity = identity
        self._seal = seal
        self._packed = packed
        self._buffer, self._buffers = buffer, buffers
        self._sealed: torch.Tensor | None = None  # the frames sealed, from `buffers` too
        self._budget = budget  # None: unpaced
        self._sent_frames = sent_frames  # a paced send's: wakes the server once a frame has gone
        self._chunks: list | None = None  # the frames' arrays, once packed
        self._sealed_frames: list[int] = []  # their sealed sizes
        self._next = 0
        # The sent frames' trackers (a frame object kept here would hold its
        # message: its tracker is done only once libzmq and the frame let go).
        self._sent: list[zmq.MessageTracker] = []
        self._last_sent_at = 0.0
        # Every frame's tracker once all are sent (done: the stage has left); None until then,
        # or for a stage that failed.
        self.sending: zmq.MessageTracker | None = None

    def due_in(self) -> float:
        """Seconds until `advance` may have something to send; math.inf:
        not before the server is woken (its packing ends, its last frame goes)."""
        if self._chunks is None:
            return 0.0 if not isinstance(self._packed, Future) or self._packed.done() else math.inf
        if self._budget is None:
            return 0.0
        if self._sent and not self._sent[-1].done:
            return math.inf
        return self._budget.wait_s()

    def stalled(self, now: float) -> bool:
        """A paced frame not taken for FETCH_TIMEOUT_S: its destination has
        stopped reading (hung; one that died closes its connection, which
        ends the send)."""
        return (self._budget is not None and bool(self._sent) and not self._sent[-1].done
                and now - self._last_sent_at > FETCH_TIMEOUT_S)

    def advance(self, sock: zmq.Socket) -> bool:
        """Send what is due; True once the stage has gone (or failed)."""
        if self._chunks is None:
            if isinstance(self._packed, Future):
                if not self._packed.done():
                    return False
                error = self._packed.exception()
                if error is not None:  # the packing failed: the destination says why
                    reason = f"{type(error).__name__}: {error}".encode()
                    sock.send_multipart([self.identity, _STATUS_FAILED,
                                         self._seal.seal(_STATUS_SEAL_INDEX, _STATUS_FAILED, reason)])
                    self._finish(None)
                    return True
                self._packed = self._packed.result()
            data = self._packed.numpy()
            self._chunks = [data[at : at + _FRAME_BYTES] for at in range(0, len(data), _FRAME_BYTES)]
            # Frame i sealed at i * (its sealed size): all but the last are full.
            self._sealed_frames = [AnswerSeal.sealed_size(len(chunk)) for chunk in self._chunks]
            self._sealed = self._buffers.take(sum(self._sealed_frames))
        while self._next < len(self._chunks) and self.due_in() <= 0:
            index, chunk = self._next, self._chunks[self._next]
            header = _FRAME_META.pack(index, len(self._chunks))
            at = index * self._sealed_frames[0]
            sealed = self._sealed.numpy()[at : at + self._sealed_frames[index]]
            self._seal.seal_into(index, _STATUS_OK + header, chunk, sealed)
            # Zero-copy: ZMQ holds the frame until it is sent, which its tracker tells.
            frame = zmq.Frame(sealed, copy=False, track=True)
            sock.send_multipart([self.identity, _STATUS_OK, header, frame], copy=False)
            self._sent.append(frame.tracker)
            if self._sent_frames is not None:  # paced: the next frame waits for this one to go
                self._sent_frames.watch(frame.tracker)
            del frame
            self._last_sent_at = time.monotonic()
            self._next += 1
        if self._next < len(self._chunks):
            return False
        self.sending = zmq.MessageTracker(*self._sent)
        self._finish(self.sending)
        return True

    def abandon(self) -> None:
        """Give up a stalled send; its sealed buffer, which ZMQ may still read, is not kept."""
        self._sealed = None
        self._finish(None)

    def _finish(self, sending: zmq.MessageTracker | None) -> None:
        self._sent = self._chunks = self._packed = None
        if self._buffer is not None:  # only the sealing read it
            self._buffers.give_back(self._buffer)
            self._buffer = None
        if self._sealed is not None:
            self._buffers.give_back(self._sealed, sending)
            self._sealed = None


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


class _SentFrames:
    """Wakes the server once each paced frame has been sent
    (its tracker done: pyzmq sets a threading.Event that no poll can
    watch), so that it sleeps meanwhile instead of looking again and
    again. One thread, asleep on the trackers in turn; counted in the
    copy budget."""

    def __init__(self, wakeup: _Wakeup, budget: CopyBudget):
        self._wakeup, self._budget = wakeup, budget
        self._trackers: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raylm-kv-sent", daemon=True)
        self._thread.start()

    def watch(self, tracker: zmq.MessageTracker, then: Callable[[], None] | None = None) -> None:
        """Once `tracker` is done: `then()`, or wake the server."""
        self._trackers.put((tracker, then or self._wakeup.wake))

    def _run(self) -> None:
        name_this_thread("raylm-kv-sent")
        no_wakeup_preemption()
        self._budget.count_this_thread()
        while True:
            item = self._trackers.get()
            if item is None:
                break
            tracker, then = item
            while not self._closed.is_set():
                try:
                    tracker.wait(_CANCEL_CHECK_S)  # and looks whether the server closed
                    break
                except zmq.NotDone:
                    continue
            then()
        self._budget.forget([threading.get_native_id()])

    def close(self) -> None:
        self._closed.set()
        self._trackers.put(None)
        self._thread.join(timeout=5)


class KVBlockServer:
    """Offers packed blocks by name on one ROUTER socket, answered by a
    daemon thread (the rank's loop never waits on a destination) to requests
    sealed with `key` only."""

    def __init__(self, host: str, key: TransferKey, budget: CopyBudget | None = None):
        self.key = key
        # What paces a pre-copy stage's frames: with the packing, the process's copies' CPU.
        self._budget = budget or process_copy_budget()
        self._context, self._sock, self._io_threads = _context_yielding_to_the_steps(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        # A stranger's connection: dropped at its first message longer than a
        # request, and if it has not finished ZMTP's greeting by then.
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
        self._sock.setsockopt(zmq.HANDSHAKE_IVL, tcp_auth.HANDSHAKE_TIMEOUT_MS)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        # name -> (packed blocks, or the Future of a packing still running;
        # when offered; the pool's buffer they are packed into, or None)
        self._offers: dict[bytes, tuple[torch.Tensor | Future, float, torch.Tensor | None]] = {}
        self.buffers = StageBuffers()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # Requests answered (sealed with the key), and messages refused (not).
        self.requests_received = 0
        self.requests_refused = 0
        self._budget.count(self._io_threads)  # they send the frames
        self._io_policy = ThreadsBesideTheSteps(self._io_threads)
        self._wakeup = _Wakeup()
        self._sent_frames = _SentFrames(self._wakeup, self._budget)
        self._thread = threading.Thread(target=self._serve, name="raylm-kv-server", daemon=True)
        self._thread.start()

    def offer(self, name: str, packed: torch.Tensor | Future, buffer: torch.Tensor | None = None) -> None:
        """`buffer`: the one `packed` is (being) packed into, from `self.buffers`:
        handed back once sent, or once the offer is dropped."""
        now = time.monotonic()
        with self._lock:
            stale = [n for n, (_, at, _) in self._offers.items() if now - at > _OFFER_TTL_S]
            dropped = [self._offers.pop(n) for n in stale]
            self._offers[name.encode()] = (packed, now, buffer)
        for packed_or_future, _, old_buffer in dropped:
            self._give_back_when_packed(packed_or_future, old_buffer)

    def withdraw(self, prefix: str) -> int:
        """Drop the offers whose name starts with `prefix`; how many."""
        key = prefix.encode()
        with self._lock:
            dropped = [self._offers.pop(n) for n in [n for n in self._offers if n.startswith(key)]]
        for packed_or_future, _, buffer in dropped:
            self._give_back_when_packed(packed_or_future, buffer)
        return len(dropped)

    def _give_back_when_packed(self, packed: torch.Tensor | Future, buffer: torch.Tensor | None) -> None:
        """A dropped offer's buffer back to the pool, once no packing writes to it."""
        if buffer is None:
            return
        if isinstance(packed, Future):
            packed.add_done_callback(lambda _: self.buffers.give_back(buffer))
        else:
            self.buffers.give_back(buffer)

    @property
    def num_offers(self) -> int:
        with self._lock:
            return len(self._offers)

    def _serve(self) -> None:
        """Asleep but when there is something to do: a request, a send that
        may go on (its packing ended, its last frame sent, the budget
        allows the next). Every wake-up of a thread beside the steps takes
        a core from them where none is spare, and polled (every 1-10 ms while
        a frame waited for its destination) this thread spent more CPU than
        the packing and about as much as the encryption (CURVE's, then)."""
        name_this_thread("raylm-kv-server")
        self._budget.count_this_thread()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        sends: list[_StageSend] = []
        while not self._closed.is_set():
            wait_s = min([send.due_in() for send in sends] + [_STALL_CHECK_S])
            ready = dict(poller.poll(math.ceil(1000 * wait_s)))
            if self._wakeup.fd in ready:
                self._wakeup.drain()
            if self._sock in ready:
                self._answer(self._sock.recv_multipart(), sends)
            now = time.monotonic()
            for send in list(sends):
                if send.stalled(now):
                    logger.warning("a destination stopped reading the K/V blocks sent to it: the send is dropped")
                    send.abandon()
                    sends.remove(send)
                elif send.advance(self._sock):
                    sends.remove(send)
        self._budget.forget([threading.get_native_id()])

    def _answer(self, frames: list[bytes], sends: list[_StageSend]) -> None:
        """A request that opens with the key is answered; anything else gets
        no answer (a stranger learns nothing, not even whether a name is offered)."""
        try:
            if len(frames) != 2:
                raise SealBroken("not a request")
            identity, request = frames
            name, seal = self.key.open_request(request)
        except SealBroken:
            self.requests_refused += 1
            return
        self.requests_received += 1
        with self._lock:
            entry = self._offers.pop(name, None)
        if entry is None:
            self._sock.send_multipart([identity, _STATUS_MISSING,
                                       seal.seal(_STATUS_SEAL_INDEX, _STATUS_MISSING, b"")])
            return
        packed, _, buffer = entry
        if isinstance(packed, Future):  # still packing, maybe: the server is woken when it ends
            packed.add_done_callback(lambda _: self._wakeup.wake())
            # Packed beside the steps: a pre-copy stage, paced as its packing was.
            sends.append(_StageSend(identity, seal, packed, buffer, self.buffers, self._budget, self._sent_frames))
            return
        # A final stage (its request paused): sent at once, the I/O thread at the steps' priority.
        self._io_policy.urgent_begin()
        send = _StageSend(identity, seal, packed, buffer, self.buffers)
        try:
            send.advance(self._sock)
        finally:
            if send.sending is None:  # nothing left to send
                self._io_policy.urgent_end()
            else:
                self._sent_frames.watch(send.sending, then=self._io_policy.urgent_end)

    def close(self) -> None:
        self._closed.set()
        self._wakeup.wake()
        self._thread.join(timeout=5)
        self._sent_frames.close()
        self._wakeup.close()
        self._sock.close(linger=0)
        terminate_context(self._context)
        self._budget.forget(self._io_threads)
        with self._lock:
            self._offers.clear()
        self.buffers = StageBuffers()  # the kept buffers' memory goes with the server


def _context_yielding_to_the_steps(socket_type: int) -> tuple[zmq.Context, zmq.Socket, list[int]]:
    """A ZMQ context for K/V transfers and its first socket (which starts the
    context's threads), and those threads' ids, named raylm-kv-... . Its I/O
    threads move a stage's frames between the socket and TCP; the caller
    makes them yield to the steps but for a final stage
    (kv_background.ThreadsBesideTheSteps). They were at nice 10 until the
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


def fetch(address: str, name: str, key: TransferKey, timeout_s: float = FETCH_TIMEOUT_S,
          cancelled: threading.Event | None = None, pause=None, into=None) -> list[bytearray]:
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
    sock.setsockopt(zmq.MAXMSGSIZE, AnswerSeal.sealed_size(_FRAME_BYTES))  # no larger frame is ours
    if pause is not None:
        sock.setsockopt(zmq.RCVHWM, _PACED_RECEIVE_QUEUE)
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
        request, seal = key.seal_request(name.encode())
        sock.send(request)
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
                    raise kv_transfer.KVTransferError(f"the source rank at {address} offers no K/V blocks {name!r}")
                raise kv_transfer.KVTransferError(
                    f"the source rank at {address} failed to pack {name!r}: {reason.decode(errors='replace')}")
            if status != _STATUS_OK or len(message) != 3 or len(message[1].bytes) != _FRAME_META.size:
                raise kv_transfer.KVTransferError(f"the source rank at {address} answered {name!r} out of form")
            header = message[1].bytes
            index, total = _FRAME_META.unpack(header)
            if index != received or (count is not None and total != count):
                raise kv_transfer.KVTransferError(f"the K/V blocks {name!r} from {address} came out of order")
            count = total
            received += 1
            sealed = message[2].buffer
            size = len(sealed) - AnswerSeal.sealed_size(0)
            if size < 0:
                raise kv_transfer.KVTransferError(f"the source rank at {address} answered {name!r} out of form")
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


def _broken(address: str, name: str) -> kv_transfer.KVTransferError:
    return kv_transfer.KVTransferError(
        f"an answer for the K/V blocks {name!r} from {address} does not open with the transfer key "
        "(not sent by the source rank, or changed on the way)")


def _next_message(sock: zmq.Socket, address: str, name: str, timeout_s: float,
                  cancelled: threading.Event | None) -> list[zmq.Frame]:
    deadline = time.monotonic() + timeout_s
    while not sock.poll(int(1000 * max(0.0, min(_CANCEL_CHECK_S, deadline - time.monotonic())))):
        if cancelled is not None and cancelled.is_set():
            raise kv_transfer.KVTransferError(f"the fetch of the K/V blocks {name!r} from {address} was cancelled")
        if time.monotonic() >= deadline:
            raise kv_transfer.KVTransferError(
                f"the source rank at {address} did not send the K/V blocks {name!r} within {timeout_s:.0f} s")
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
            if (count - 1) * _FRAME_BYTES >= self._limit:
                raise kv_transfer.KVTransferError(
                    f"{self._what} come in {count} frames, more than the {self._limit} bytes of the blocks "
                    "reserved for them fill (another KV layout, or other blocks)")
            # The sender's frames are at most _FRAME_BYTES (the same code at both ends).
            self._buffer = _joined_stages.take(count * _FRAME_BYTES)
            self._view = memoryview(self._buffer.numpy())
        if size > _FRAME_BYTES or self._size + size > len(self._view):
            raise kv_transfer.KVTransferError(f"{self._what} came in frames over {_FRAME_BYTES} bytes")
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


class KVNetworkEndpoint:
    """A rank's side of cross-node transfers: its server (started on the first
    export, remade if the supervisor's transfer key changes) and its fetches."""

    def __init__(self, budget: CopyBudget | None = None):
        self._server: KVBlockServer | None = None
        self._budget = budget  # what paces its server's pre-copy stages; None: the process's

    def serve(self, kv_caches: list[torch.Tensor], name: str, block_ids: list[int], host: str,
              key: TransferKey, run_in_background=None) -> tuple[int, str]:
        """Pack the blocks and offer them as `name`; (bytes, address to fetch them from).
        `run_in_background(fn, *args) -> Future`: pack on another thread (a
        fetch meanwhile waits for it); None: pack now."""
        server = self._server_for(host, key)
        size = kv_transfer.packed_size(kv_caches, len(block_ids))
        buffer = server.buffers.take(size)
        try:
            if run_in_background is None:
                packed = kv_transfer.pack_blocks(kv_caches, block_ids, into=buffer)
            else:
                packed = run_in_background(functools.partial(kv_transfer.pack_blocks, into=buffer), kv_caches,
                                           block_ids)
        except BaseException:
            server.buffers.give_back(buffer)
            raise
        server.offer(name, packed, buffer)
        return size, server.address

    def fetch_into(self, kv_caches: list[torch.Tensor], name: str, block_ids: list[int], address: str,
                   key: TransferKey, timeout_s: float = FETCH_TIMEOUT_S, cancelled: threading.Event | None = None,
                   pause=None) -> int:
        """Fetch the offer `name` into `block_ids`; `pause`: called between
        frames and between layers of the unpacking (a paced copy beside the steps)."""
        what = f"the K/V blocks {name!r} from {address}"
        if not kv_caches:
            raise kv_transfer.KVTransferError("this rank holds no KV cache")
        join = _JoinedStage(what, kv_transfer.packed_size(kv_caches, len(block_ids)))
        try:
            fetch(address, name, key, timeout_s, cancelled, pause, into=join.into)
            return kv_transfer.unpack_blocks(kv_caches, block_ids, join.joined(), what, pause)
        finally:
            join.release()

    def withdraw(self, prefix: str) -> int:
        return self._server.withdraw(prefix) if self._server is not None else 0

    def _server_for(self, host: str, key: TransferKey) -> KVBlockServer:
        server = self._server
        if server is not None and (server.key != key or not server.address.startswith(f"tcp://{host}:")):
            server.close()
            server = None
        if server is None:
            server = self._server = KVBlockServer(host, key, self._budget)
        return server

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
