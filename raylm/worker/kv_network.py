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
(raylm.distributed.tcp_auth). The server's socket admits a connection only
at its handshake, and only one that presents a fresh token sealed with that
key (`SealedAdmission`; ZMQ's PLAIN mechanism carries the token to a ZAP
handler): anything else, junk, a silent connection, another mechanism, a
token that does not open or was used before, is closed by libzmq before it
can send a single message. An admitted destination seals its request with
the key too, and the source answers only a request that opens and that it
has not taken before, with every message of the answer sealed for that
request (raylm.distributed.sealed_frames, AES-256-GCM): a stranger's
request gets nothing, a request played back gets nothing, the K/V is
encrypted on the wire, and a message changed on the way fails the fetch.

What strangers can still cost the rank, bounded: a connection each for at
most _HANDSHAKE_TIMEOUT_MS (so as many file descriptors as connections they
open in that time; libzmq cannot cap them, nor drop one peer of a ROUTER),
a kilobyte of handshake each (MAXMSGSIZE), and the CPU of refusing them
(the I/O thread's accept and close, the ZAP handler's check), which is
counted and logged apart (`Refusals`) and not charged to the copies' CPU
budget (their I/O threads are charged at most _SEND_CPU_PER_MIB_S per MiB
they send). Not bounded: whoever reads the wire can race a destination
with a copy of its token (PLAIN sends it in the clear), and a connection so
admitted could send a multipart message without end, which libzmq keeps
until its last part comes (see `SealedAdmission`). An admitted peer that
stops answering ZMTP's heartbeats is dropped after _HEARTBEAT_TIMEOUT_MS.
Measured against Ray's object store on the two-host harness:
benchmarks/bench_kv_transport.py; under a flood of strangers:
benchmarks/bench_kv_flood.py.
"""

from __future__ import annotations

import collections
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

from raylm.distributed.sealed_frames import (REQUEST_LIFETIME_S, AnswerSeal, Replayed, SealBroken, SeenRequests,
                                             TransferKey)
from raylm.distributed.tcp_auth import terminate_context
from raylm.worker import kv_transfer
from raylm.thread_accounting import name_this_thread, name_thread, thread_cpu_s, thread_ids, thread_name
from raylm.worker.kv_background import (CopyBudget, CPUAllowance, ThreadsBesideTheSteps, no_wakeup_preemption,
                                        process_copy_budget)

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
# request, and libzmq drops its connection before taking it in (a
# handshake's commands too).
_MAX_REQUEST_BYTES = 1024
# A connection that has not been admitted this long after it connected (a
# stranger's: silent, sending junk, or waiting on a handshake it cannot
# finish) is closed. A rightful handshake takes two round trips and a ZAP
# check: milliseconds, or a second or so where a segment is lost and sent
# again. It bounds what strangers hold: their connections' rate times this.
_HANDSHAKE_TIMEOUT_MS = 2000
# An admitted peer is sent a ZMTP heartbeat this often, and dropped when it
# has sent nothing back for _HEARTBEAT_TIMEOUT_MS (its host gone without a
# word: TCP alone would keep an idle connection for ever). As long as a
# stalled send's wait (FETCH_TIMEOUT_S): a paced destination stops reading,
# heartbeats included, while its copy budget holds it back.
_HEARTBEAT_IVL_MS = 5000
_HEARTBEAT_TIMEOUT_MS = int(1000 * FETCH_TIMEOUT_S)
# What a server's I/O threads may charge the copy budget for each MiB of
# frames they send: they also accept and refuse every stranger's connection,
# which is no copy's work. Sending costs them 0.16-0.41 ms a MiB over
# loopback (4 runs of 128 MiB, the 2-core AMD EPYC VM); more than this is
# the refusals' (counted in CPUAllowance.excess_s).
_SEND_CPU_PER_MIB_S = 0.5e-3
# The user name a K/V connection's handshake gives beside its token (PLAIN's
# password); any other is refused.
_ADMISSION_USER = b"raylm-kv"
# Refusals are logged at most this often (a summary since the last line).
_REFUSAL_LOG_S = 60.0
# How many events of its socket's monitor the admission keeps unread (about
# 100 bytes each; one per connection): past that libzmq drops them, which
# only loses counts.
_MONITOR_QUEUE = 50_000
# The admission reads its socket's monitor (counts) at most this often.
_MONITOR_BATCH_S = 0.05
# A monitor event's first frame: the event, and its value (for a closed
# connection, its file descriptor).
_MONITOR_EVENT = struct.Struct("=HI")
# After a fault of its own code a server's or admission's thread drops what
# it was doing and goes on after this pause (a fault on every message logs
# at most once a second).
_FAULT_PAUSE_S = 1.0
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
                 sent_frames: _SentFrames | None = None, io_allowance: CPUAllowance | None = None):
        self.identity = identity
        self._io_allowance = io_allowance  # what the I/O threads may charge the budget for sending
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
            if self._io_allowance is not None:
                self._io_allowance.allow(_SEND_CPU_PER_MIB_S * len(sealed) / (1 << 20))
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
        """Give up the send; its sealed buffer, which ZMQ may still read, is
        not kept, nor the packing's while a packing may still write to it."""
        self._sealed = None
        if isinstance(self._packed, Future) and not self._packed.done():
            self._buffer = None
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


class Refusals:
    """What a listening socket refused, kept apart from the work it does for
    its peers: counts by reason, and a warning at most every _REFUSAL_LOG_S
    (a summary of those since the last one; a flood writes a line a minute,
    not one per stranger). Reasons: 'connection', every connection that
    closed without asking anything, whatever refused it (junk, silence,
    another mechanism, a refused token, the handshake's timeout); 'token',
    an admission refused for a token that does not open; 'replayed',
    'stale' and 'too many', a token or a request that opens but is not
    taken (sealed_frames.Replayed); 'request', an admitted connection's
    message that is no request or does not open."""

    def __init__(self, what: str):
        self.what = what
        self.counts: collections.Counter[str] = collections.Counter()
        self.server_cpu_s = 0.0  # the server thread's, excused from the copy budget
        self._lock = threading.Lock()
        self._unlogged: collections.Counter[str] = collections.Counter()
        self._logged_at = -math.inf
        self._last_peer = ""

    def add(self, reason: str, peer: str = "", count: int = 1) -> None:
        with self._lock:
            self.counts[reason] += count
            self._unlogged[reason] += count
            self._last_peer = peer or self._last_peer
            now = time.monotonic()
            if now - self._logged_at < _REFUSAL_LOG_S:
                return
            since = "" if self._logged_at == -math.inf else f" in the last {now - self._logged_at:.0f} s"
            unlogged, self._unlogged, self._logged_at = self._unlogged, collections.Counter(), now
            peer = self._last_peer
        stale = (f" ('stale': sealed more than {REQUEST_LIFETIME_S:.0f} s from this host's clock: played back, "
                 "or the hosts' clocks that far apart)" if "stale" in unlogged else "")
        logger.warning("%s refused %s%s%s: strangers without the transfer key (or a flood of them); "
                       "nothing was served to them%s (at most one such line every %.0f s)", self.what,
                       ", ".join(f"{n} {reason}" for reason, n in sorted(unlogged.items())), since,
                       f", the last from {peer}" if peer else "", stale, _REFUSAL_LOG_S)


class SealedAdmission:
    """Admits a connection to a ROUTER socket at its handshake, and only one
    that presents a fresh token sealed with the transfer key (`present`):
    the socket speaks ZMQ's PLAIN mechanism, and libzmq hands each
    connection's user name and password, before it takes any message from
    it, to this ZAP handler (a thread of its own, raylm-kv-admit), which
    admits a password that opens as a token and that `seen` takes (each
    admits one connection). libzmq closes any other connection at its
    handshake: junk, a NULL or CURVE peer, a refused token, one not admitted
    within _HANDSHAKE_TIMEOUT_MS; and, with no handler (closed), every one.

    Why at the handshake and not at a connection's first message: libzmq
    shows a ROUTER a message only once its last part has come, and bounds
    the socket's queue by whole messages (MAXMSGSIZE by frames), so a
    stranger's endless multipart message grew the rank until the OOM killer
    took it, and a ROUTER cannot drop one peer. A peer that cannot finish
    its handshake sends no message at all.

    Reusable by any server whose peers hold the transfer key: a context has
    one ZAP handler, so one admission per context (the K/V server has a
    context of its own). `refusals` counts what was refused; the socket's
    monitor (an event per closed connection, read in batches: 7 us of this
    thread's a junk connection, here) counts those that left without
    asking anything; the server says which asked (`asked`)."""

    def __init__(self, context: zmq.Context, sock: zmq.Socket, key: TransferKey, seen: SeenRequests,
                 refusals: Refusals, max_message_bytes: int):
        """Configures `sock`, which must not be bound yet."""
        self._key, self._seen, self.refusals = key, seen, refusals
        self._zap = context.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind("inproc://zeromq.zap.01")  # the context's ZAP handler (RFC 27)
        sock.setsockopt(zmq.PLAIN_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, b"raylm")
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler, no admission
        sock.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_TIMEOUT_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        monitor = f"inproc://raylm-admission-{id(self)}"
        sock.monitor(monitor, zmq.EVENT_DISCONNECTED)
        self._events = context.socket(zmq.PAIR)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.setsockopt(zmq.RCVHWM, _MONITOR_QUEUE)
        self._events.connect(monitor)
        self._lock = threading.Lock()
        # Connections that sent something (only admitted ones can), until the
        # monitor tells they closed: how many on each file descriptor (one
        # closes and the next opens on it before the monitor's events are
        # read), and the routing id that asked last on it.
        self._asked: collections.Counter[int] = collections.Counter()
        self._asked_by: dict[int, bytes] = {}
        self._cpu_s = 0.0  # the thread's CPU, of its runs before this one
        self._closed = threading.Event()
        self._wakeup = _Wakeup()
        self._start()

    @staticmethod
    def present(sock: zmq.Socket, key: TransferKey) -> None:
        """The connecting side, before connect: a token of `key` for the handshake.
        It admits one connection: the socket is not to connect again."""
        sock.setsockopt(zmq.PLAIN_USERNAME, _ADMISSION_USER)
        sock.setsockopt(zmq.PLAIN_PASSWORD, key.admission_token())
        sock.setsockopt(zmq.RECONNECT_IVL, -1)

    def asked(self, fd: int, routing_id: bytes) -> None:
        """The connection of `fd` and `routing_id` sent a message: not a
        refusal when it closes. (Should the monitor tell of its closing
        first, it is counted as one, and the next connection on that
        descriptor that closes without asking is not: the count stays right.)"""
        with self._lock:
            if self._asked_by.get(fd) != routing_id:  # its first message
                self._asked_by[fd] = routing_id
                self._asked[fd] += 1

    @property
    def cpu_s(self) -> float:
        """The CPU its thread has taken: all of it refusals' but the rightful handshakes' ZAP checks."""
        tid = self._tid
        return self._cpu_s + ((thread_cpu_s(tid) or 0.0) if tid is not None else 0.0)

    def keep_running(self) -> None:
        """Start its thread again if it has ended (a fault no handler caught)."""
        if not self._thread.is_alive() and not self._closed.is_set():
            logger.error("%s: the admission's thread had ended (%s); started again", self.refusals.what,
                         self._ended_by)
            self._start()

    def _start(self) -> None:
        self._ended_by = None
        self._tid: int | None = None
        self._thread = threading.Thread(target=self._run, name="raylm-kv-admit", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """Refusing strangers is not the copies' work: this thread is not counted in the copy budget,
        and yields to the steps (SCHED_BATCH: a flood's wake-ups do not preempt them)."""
        name_this_thread("raylm-kv-admit")
        no_wakeup_preemption()
        self._tid = threading.get_native_id()
        # The monitor's events are read in batches, at most every
        # _MONITOR_BATCH_S: read as each came (a flood's junk connections, 2k a
        # second) a wake-up and a poll each cost this thread 37 us a
        # connection, here; the ZAP requests are answered at once.
        zap_only, everything = zmq.Poller(), zmq.Poller()
        for watched in (self._zap, self._wakeup.fd):
            zap_only.register(watched, zmq.POLLIN)
            everything.register(watched, zmq.POLLIN)
        everything.register(self._events, zmq.POLLIN)
        events_due = 0.0
        try:
            while not self._closed.is_set():
                try:
                    wait_s = events_due - time.monotonic()
                    if wait_s > 0:
                        ready = dict(zap_only.poll(math.ceil(1000 * wait_s)))
                    else:
                        ready = dict(everything.poll())
                    if self._zap in ready:
                        self._answer_zap()
                    if self._events in ready:
                        self._count_events()
                        events_due = time.monotonic() + _MONITOR_BATCH_S
                    if self._wakeup.fd in ready:
                        self._wakeup.drain()
                except Exception:
                    if self._closed.is_set():
                        break
                    logger.exception("%s: the admission failed; it goes on", self.refusals.what)
                    self._closed.wait(_FAULT_PAUSE_S)
        except BaseException as ended:
            self._ended_by = repr(ended)
            raise
        finally:
            self._cpu_s += thread_cpu_s(threading.get_native_id()) or 0.0
            self._tid = None

    def _answer_zap(self) -> None:
        # A ZAP request: version, request id, domain, address, routing id, mechanism, credentials.
        version, request_id, *request = self._zap.recv_multipart()
        status = b"400"
        try:
            status = self._admits(request)
        finally:  # answered whatever happens: libzmq waits for it (REP: one answer per request)
            self._zap.send_multipart([version, request_id, status, b"", b"", b""])

    def _admits(self, request: list[bytes]) -> bytes:
        address = request[1].decode(errors="replace") if len(request) > 1 else ""
        if len(request) != 6 or request[3] != b"PLAIN" or request[4] != _ADMISSION_USER:
            self.refusals.add("token", address)
            return b"400"
        try:
            self._key.admit(request[5], self._seen)
        except Replayed as refused:
            self.refusals.add(refused.reason, address)
            return b"400"
        except SealBroken:
            self.refusals.add("token", address)
            return b"400"
        return b"200"

    def _count_events(self) -> None:
        refused = 0
        while True:
            try:
                event_frames = self._events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            _, fd = _MONITOR_EVENT.unpack_from(event_frames[0])  # a connection closed
            with self._lock:
                if self._asked[fd] > 0:
                    self._asked[fd] -= 1
                else:
                    refused += 1
        if refused:
            self.refusals.add("connection", count=refused)

    def close(self) -> None:
        """After its socket is closed."""
        self._closed.set()
        self._wakeup.wake()
        self._thread.join(timeout=5)
        self._wakeup.close()
        self._zap.close(linger=0)
        self._events.close(linger=0)



class KVBlockServer:
    """Offers packed blocks by name on one ROUTER socket, answered by a
    daemon thread (the rank's loop never waits on a destination) to
    requests sealed with `key` only, on connections admitted with it
    (SealedAdmission). The thread goes on after a fault of its own (logged;
    the sends under way are dropped), and the endpoint starts it again
    should it end (`keep_serving`)."""

    def __init__(self, host: str, key: TransferKey, budget: CopyBudget | None = None):
        self.key = key
        # What paces a pre-copy stage's frames: with the packing, the process's copies' CPU.
        self._budget = budget or process_copy_budget()
        self._context, self._sock, self._io_threads = _context_yielding_to_the_steps(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        # The admission's tokens and the requests: each taken once.
        self._seen = SeenRequests()
        self.refusals = Refusals("the K/V server")
        self._admission = SealedAdmission(self._context, self._sock, key, self._seen, self.refusals,
                                          _MAX_REQUEST_BYTES)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.refusals.what = f"the K/V server at {self.address}"
        # name -> (packed blocks, or the Future of a packing still running;
        # when offered; the pool's buffer they are packed into, or None)
        self._offers: dict[bytes, tuple[torch.Tensor | Future, float, torch.Tensor | None]] = {}
        self.buffers = StageBuffers()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.requests_received = 0  # requests answered (opened with the key)
        self.faults = 0  # faults of the server thread's own, each logged
        # They send the frames, and refuse strangers: charged for the frames only.
        self._io_allowance = CPUAllowance(ttl_s=FETCH_TIMEOUT_S)
        self._budget.count(self._io_threads, allowance=self._io_allowance)
        self._io_policy = ThreadsBesideTheSteps(self._io_threads)
        self._wakeup = _Wakeup()
        self._sent_frames = _SentFrames(self._wakeup, self._budget)
        self._start()

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

    def keep_serving(self) -> None:
        """Start the server's threads again if one has ended (a fault that
        its own handling did not catch), saying why."""
        if self._closed.is_set():
            return
        if not self._thread.is_alive():
            logger.error("%s: its thread had ended (%s); started again, its offers kept", self.refusals.what,
                         self._ended_by)
            self._start()
        self._admission.keep_running()

    def _start(self) -> None:
        self._ended_by = None
        self._thread = threading.Thread(target=self._serve, name="raylm-kv-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Serves until closed. A fault of this code (a peer's message is
        refused, never raised) drops the sends under way, whose
        destinations' fetches then fail and their migrations are given up,
        and the thread goes on with the offers it holds."""
        name_this_thread("raylm-kv-server")
        self._budget.count_this_thread()
        sends: list[_StageSend] = []
        try:
            while not self._closed.is_set():
                try:
                    self._serve_until_closed(sends)
                except Exception:
                    if self._closed.is_set():
                        break
                    self.faults += 1
                    logger.exception("%s failed; it drops the %d sends under way and serves again",
                                     self.refusals.what, len(sends))
                    for send in sends:
                        send.abandon()
                    sends.clear()
                    self._closed.wait(_FAULT_PAUSE_S)
        except BaseException as ended:
            self._ended_by = repr(ended)
            raise
        finally:
            self._budget.forget([threading.get_native_id()])

    def _serve_until_closed(self, sends: list[_StageSend]) -> None:
        """Asleep but when there is something to do: a request, a send that
        may go on (its packing ended, its last frame sent, the budget
        allows the next). Every wake-up of a thread beside the steps takes
        a core from them where none is spare, and polled (every 1-10 ms while
        a frame waited for its destination) this thread spent more CPU than
        the packing and about as much as the encryption (CURVE's, then)."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        while not self._closed.is_set():
            wait_s = min([send.due_in() for send in sends] + [_STALL_CHECK_S])
            ready = dict(poller.poll(math.ceil(1000 * wait_s)))
            if self._wakeup.fd in ready:
                self._wakeup.drain()
            if self._sock in ready:
                self._answer(sends)
            now = time.monotonic()
            for send in list(sends):
                if send.stalled(now):
                    logger.warning("a destination stopped reading the K/V blocks sent to it: the send is dropped")
                    send.abandon()
                    sends.remove(send)
                elif send.advance(self._sock):
                    sends.remove(send)

    def _answer(self, sends: list[_StageSend]) -> None:
        """A request that opens with the key, and was not taken before, is
        answered; anything else gets no answer (a stranger learns nothing,
        not even whether a name is offered)."""
        started = time.thread_time()
        frames = self._sock.recv_multipart(copy=False)
        self._admission.asked(frames[0].get(zmq.SRCFD), frames[0].bytes)
        try:
            if len(frames) != 2:
                raise SealBroken("not a request")
            identity, request = frames[0].bytes, frames[1].bytes
            name, seal = self.key.open_request(request, self._seen)
        except SealBroken as refused:
            # Only an admitted connection gets here: a holder of the key, or
            # someone who raced one with a copy of its token. Not the copies' work either.
            self.refusals.add(refused.reason if isinstance(refused, Replayed) else "request")
            spent = time.thread_time() - started
            self.refusals.server_cpu_s += spent
            self._budget.excuse(spent)
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
            sends.append(_StageSend(identity, seal, packed, buffer, self.buffers, self._budget, self._sent_frames,
                                    self._io_allowance))
            return
        # A final stage (its request paused): sent at once, the I/O thread at the steps' priority.
        self._io_policy.urgent_begin()
        send = _StageSend(identity, seal, packed, buffer, self.buffers, io_allowance=self._io_allowance)
        try:
            send.advance(self._sock)
        finally:
            if send.sending is None:  # nothing left to send
                self._io_policy.urgent_end()
            else:
                self._sent_frames.watch(send.sending, then=self._io_policy.urgent_end)

    @property
    def refusal_cpu_s(self) -> float:
        """The CPU refusing strangers has taken, none of it charged to the copy
        budget: the admission's thread, the I/O threads' beyond what the frames
        they sent allow, and the server thread's refusals of admitted connections' messages."""
        return self._admission.cpu_s + self._io_allowance.excess_s + self.refusals.server_cpu_s

    def close(self) -> None:
        self._closed.set()
        self._wakeup.wake()
        self._thread.join(timeout=5)
        self._sent_frames.close()
        self._wakeup.close()
        self._sock.disable_monitor()
        self._sock.close(linger=0)
        self._admission.close()
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
            raise kv_transfer.KVTransferError(
                f"the source rank at {address} refused the connection to fetch {name!r} "
                "(its handshake: the transfer key, or the source gone)") from None
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
        if self._server is None:
            return 0
        self._server.keep_serving()
        return self._server.withdraw(prefix)

    def _server_for(self, host: str, key: TransferKey) -> KVBlockServer:
        server = self._server
        if server is not None and (server.key != key or not server.address.startswith(f"tcp://{host}:")):
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
