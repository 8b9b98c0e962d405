"""Who may connect to a rank's K/V server (raylm.kv_transfer.server): a
connection is admitted at its handshake, with a fresh token sealed with the
transfer key, or closed by libzmq before it can send anything
(`SealedAdmission`); an admitted peer that stops answering ZMTP's
heartbeats is dropped; what is refused is counted and logged apart
(`Refusals`).

Here is kept the third rule of faults and operations that interleave
(docs/failures.md, "Faults and operations that interleave"): *the K/V server admits a
peer only by an authenticated offer*, a fresh token sealed with the transfer
key, checked during the connection's handshake (`SealedAdmission._admits`);
a connection without one is closed before libzmq takes a message from it.

What strangers can still cost the rank, bounded: a connection each for at
most _HANDSHAKE_TIMEOUT_MS (so as many file descriptors as connections they
open in that time; libzmq cannot cap them, nor drop one peer of a ROUTER),
a kilobyte of handshake each (MAXMSGSIZE), and the CPU of refusing them
(the I/O thread's accept and close, the ZAP handler's check), which is
counted and logged apart (`Refusals`) and not charged to the copies' CPU
budget (their I/O threads are charged at most stage_send._SEND_CPU_PER_MIB_S per MiB
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
import logging
import math
import struct
import threading
import time
from collections.abc import Callable

import zmq

from raylm.kv_transfer import frames
from raylm.kv_transfer.background import no_wakeup_preemption
from raylm.kv_transfer.frames import FETCH_TIMEOUT_S, _Wakeup
from raylm.kv_transfer.sealed_frames import REQUEST_LIFETIME_S, Replayed, SealBroken, SeenRequests, TransferKey
from raylm.thread_accounting import name_this_thread, thread_cpu_s

logger = logging.getLogger(__name__)


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
        stale = (
            f" ('stale': sealed more than {REQUEST_LIFETIME_S:.0f} s from this host's clock: played back, "
            "or the hosts' clocks that far apart)"
            if "stale" in unlogged
            else ""
        )
        logger.warning(
            "%s refused %s%s%s: strangers without the transfer key (or a flood of them); "
            "nothing was served to them%s (at most one such line every %.0f s)",
            self.what,
            ", ".join(f"{n} {reason}" for reason, n in sorted(unlogged.items())),
            since,
            f", the last from {peer}" if peer else "",
            stale,
            _REFUSAL_LOG_S,
        )


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

    def __init__(
        self,
        context: zmq.Context,
        sock: zmq.Socket,
        key: TransferKey,
        seen: SeenRequests,
        refusals: Refusals,
        max_message_bytes: int,
        on_asking_closed: Callable[[], None] | None = None,
    ):
        """Configures `sock`, which must not be bound yet. `on_asking_closed`:
        called (on the admission's thread) when connections that asked have closed."""
        self._key, self._seen, self.refusals = key, seen, refusals
        self._on_asking_closed = on_asking_closed
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

    def open_asking(self) -> int:
        """Connections that asked for something and have not closed yet (as
        far as the monitor has told; it is read every _MONITOR_BATCH_S)."""
        with self._lock:
            return sum(self._asked.values())

    @property
    def cpu_s(self) -> float:
        """The CPU its thread has taken: all of it refusals' but the rightful handshakes' ZAP checks."""
        tid = self._tid
        return self._cpu_s + ((thread_cpu_s(tid) or 0.0) if tid is not None else 0.0)

    def keep_running(self) -> None:
        """Start its thread again if it has ended (a fault no handler caught)."""
        if not self._thread.is_alive() and not self._closed.is_set():
            logger.error("%s: the admission's thread had ended (%s); started again", self.refusals.what, self._ended_by)
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
                    self._closed.wait(frames._FAULT_PAUSE_S)
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
        refused = asking_closed = 0
        while True:
            try:
                event_frames = self._events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            _, fd = _MONITOR_EVENT.unpack_from(event_frames[0])  # a connection closed
            with self._lock:
                if self._asked[fd] > 0:
                    self._asked[fd] -= 1
                    asking_closed += 1
                else:
                    refused += 1
        if refused:
            self.refusals.add("connection", count=refused)
        if asking_closed and self._on_asking_closed is not None:
            self._on_asking_closed()

    def close(self) -> None:
        """After its socket is closed."""
        self._closed.set()
        self._wakeup.wake()
        self._thread.join(timeout=5)
        self._wakeup.close()
        self._zap.close(linger=0)
        self._events.close(linger=0)
