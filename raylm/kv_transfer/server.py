"""A source rank's K/V server: offers the packed blocks of its stages by
name on one ROUTER socket (admitted connections only,
raylm.kv_transfer.admission) and answers each sealed request once, a
frame per message, a pre-copy stage paced by the process's copy budget
(raylm.kv_transfer.background), a final stage at once.

It listens only while it holds offers or sends (on a fresh port each
time, which each offer names): between transfers a stranger's connection
is refused by the kernel, at no cost to the rank, where a server that
listened for the rank's life paid the accept, the handshake's refusal and
its counting for every one (a flood of 2k junk connections a second took
~19% of a core from the rank's steps, here). While it listens, only the
addresses its offers are for can connect (raylm.kv_transfer.peer_filter:
the kernel drops anyone else's SYN), so that a stranger who follows the
port costs the rank no more than one who knocks on a closed one."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from concurrent.futures import Future

import torch
import zmq

from raylm.distributed.tcp_auth import terminate_context
from raylm.kv_transfer import frames, peer_filter
from raylm.kv_transfer.admission import Refusals, SealedAdmission
from raylm.kv_transfer.background import (
    CopyBudget,
    CPUAllowance,
    ThreadsBesideTheSteps,
    process_copy_budget,
)
from raylm.kv_transfer.files import KVTransferError
from raylm.kv_transfer.frames import (
    _MAX_REQUEST_BYTES,
    _STATUS_MISSING,
    _STATUS_SEAL_INDEX,
    FETCH_TIMEOUT_S,
    StageBuffers,
    _context_yielding_to_the_steps,
    _Wakeup,
)
from raylm.kv_transfer.sealed_frames import Replayed, SealBroken, SeenRequests, TransferKey
from raylm.kv_transfer.stage_send import SentFrames, StageSend
from raylm.thread_accounting import name_this_thread

logger = logging.getLogger(__name__)


# An offer nobody fetched (its destination died, and the supervisor that
# would withdraw it too) is dropped after this long.
_OFFER_TTL_S = 300.0


# The server stops listening once it has held no offer and sent nothing for
# this long (the stages of one migration come one after another: a pause
# shorter than this keeps the port).
_IDLE_UNBIND_S = 0.2


# How long an offer waits for the server's thread to listen again (it binds
# when woken: a millisecond, unless the thread is down and started again).
_LISTEN_WAIT_S = 5.0


# The server's thread wakes when a request comes, a packing ends, a paced
# frame has been sent (SentFrames) or its copy budget allows the next;
# with none of those due it still looks this often whether a send has stalled.
_STALL_CHECK_S = 1.0


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
        self._wakeup = _Wakeup()
        self._admission = SealedAdmission(
            self._context,
            self._sock,
            key,
            self._seen,
            self.refusals,
            _MAX_REQUEST_BYTES,
            on_asking_closed=self._wakeup.wake,
        )
        self.host = host
        # The endpoint it listens on ("" while it does not), bound and
        # unbound by the server's thread only (a ZMQ socket is one thread's).
        self.address = ""
        # The addresses its listening socket admits (None: any), and that
        # socket's fd (libzmq's, valid while `address` is, under the lock).
        self.admitted: set[str] | None = None
        self._listen_fd = -1
        self._listen_wanted = False
        self._listening = threading.Event()
        self._idle_since = time.monotonic()
        # Final stages libzmq still sends (their trackers): unbinding drops
        # the connections a listener accepted, so it waits for them.
        self._final_sends: list[zmq.MessageTracker] = []
        self.refusals.what = f"the K/V server on {host}"
        # name -> (packed blocks, or the Future of a packing still running;
        # when offered; the pool's buffer they are packed into, or None)
        self._offers: dict[bytes, tuple[torch.Tensor | Future, float, torch.Tensor | None]] = {}
        # name -> the address of the destination an offer is for ("": anyone's)
        self._offer_peers: dict[bytes, str] = {}
        self.buffers = StageBuffers()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.requests_received = 0  # requests answered (opened with the key)
        self.faults = 0  # faults of the server thread's own, each logged
        # They send the frames, and refuse strangers: charged for the frames only.
        self._io_allowance = CPUAllowance(ttl_s=FETCH_TIMEOUT_S)
        self._budget.count(self._io_threads, allowance=self._io_allowance)
        self._io_policy = ThreadsBesideTheSteps(self._io_threads)
        self._sent_frames = SentFrames(self._wakeup, self._budget)
        self._start()

    def offer(
        self, name: str, packed: torch.Tensor | Future, buffer: torch.Tensor | None = None, peer: str = ""
    ) -> str:
        """Offer `packed` as `name`; the address to fetch it from (the server
        listens from now until it has held no offer for _IDLE_UNBIND_S).
        `buffer`: the one `packed` is (being) packed into, from `self.buffers`:
        handed back once sent, or once the offer is dropped. `peer`: the
        address its destination connects from, admitted from now on ("":
        anyone's, the handshake's check alone)."""
        now = time.monotonic()
        with self._lock:
            stale = [n for n, (_, at, _) in self._offers.items() if now - at > _OFFER_TTL_S]
            dropped = [self._offers.pop(n) for n in stale]
            for n in stale:
                self._offer_peers.pop(n, None)
            self._offers[name.encode()] = (packed, now, buffer)
            self._offer_peers[name.encode()] = peer
            address = self.address
            if address:
                self._admit(peer)
            if not address:
                self._listen_wanted = True
                self._listening.clear()
        for packed_or_future, _, old_buffer in dropped:
            self._give_back_when_packed(packed_or_future, old_buffer)
        if address:
            return address
        self._wakeup.wake()
        if not self._listening.wait(_LISTEN_WAIT_S):
            self.withdraw(name)
            raise KVTransferError(f"{self.refusals.what} did not listen within {_LISTEN_WAIT_S:g} s")
        with self._lock:
            return self.address

    def withdraw(self, prefix: str) -> int:
        """Drop the offers whose name starts with `prefix`; how many."""
        key = prefix.encode()
        with self._lock:
            names = [n for n in self._offers if n.startswith(key)]
            dropped = [self._offers.pop(n) for n in names]
            for n in names:
                self._offer_peers.pop(n, None)
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
            logger.error(
                "%s: its thread had ended (%s); started again, its offers kept", self.refusals.what, self._ended_by
            )
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
        sends: list[StageSend] = []
        try:
            while not self._closed.is_set():
                try:
                    self._serve_until_closed(sends)
                except Exception:
                    if self._closed.is_set():
                        break
                    self.faults += 1
                    logger.exception(
                        "%s failed; it drops the %d sends under way and serves again", self.refusals.what, len(sends)
                    )
                    for send in sends:
                        send.abandon()
                    sends.clear()
                    self._closed.wait(frames._FAULT_PAUSE_S)
        except BaseException as ended:
            self._ended_by = repr(ended)
            raise
        finally:
            self._budget.forget([threading.get_native_id()])

    def _serve_until_closed(self, sends: list[StageSend]) -> None:
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
            unbind_in = self._listen_or_unbind(sends)
            wait_s = min([send.due_in() for send in sends] + [_STALL_CHECK_S, unbind_in])
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

    def _listen_or_unbind(self, sends: list[StageSend]) -> float:
        """On the server's thread: listen where an offer asked for it; stop
        listening once it has held no offer, no send and no connection
        that asked for a stage for _IDLE_UNBIND_S (unbinding ends the
        connections it accepted: none has anything left to fetch then).
        How long until it looks again (inf: not before it is woken)."""
        now = time.monotonic()
        with self._lock:
            if self._listen_wanted:
                self._bind()
                self.refusals.what = f"the K/V server at {self.address}"
                self._listen_wanted = False
                self._listening.set()
            if not self.address:
                return math.inf
            self._final_sends = [t for t in self._final_sends if not t.done]
            # A connection that asked for a stage stays until its destination
            # hangs up: libzmq has handed the stage to TCP, but a paced
            # destination may not have read it all yet.
            asking = self._admission.open_asking()
            if self._offers or sends or self._final_sends or asking:
                self._idle_since = now
                return math.inf  # woken when a final stage has left, or an asking connection closed
            if now - self._idle_since < _IDLE_UNBIND_S:
                return self._idle_since + _IDLE_UNBIND_S - now
            self._sock.unbind(self.address)  # libzmq closes the listening fd
            self.address, self.admitted, self._listen_fd = "", None, -1
            return math.inf

    def _bind(self) -> None:
        """Listen on a fresh port (under the lock, on the server's thread),
        admitting only the offers' destinations where the kernel can say so."""
        peers = set(self._offer_peers.values())
        if "" in peers or not peer_filter.can_filter(self.host, peers):
            port = self._sock.bind_to_random_port(f"tcp://{self.host}")
            self.admitted, self._listen_fd = None, -1
        else:
            fd, port = peer_filter.listen(self.host, peers)
            try:
                self._sock.setsockopt(zmq.USE_FD, fd)  # libzmq listens on it (and closes it at unbind)
                try:
                    self._sock.bind(f"tcp://{self.host}:{port}")
                finally:
                    self._sock.setsockopt(zmq.USE_FD, -1)
            except BaseException:
                os.close(fd)
                raise
            self.admitted, self._listen_fd = peers, fd
        self.address = f"tcp://{self.host}:{port}"

    def _admit(self, peer: str) -> None:
        """An offer for `peer` while listening (under the lock): admit its
        address too, before the offer's address is handed out (a dropped
        SYN is sent again only after a second)."""
        if self.admitted is None or peer in self.admitted:
            return
        wanted = self.admitted | {peer}
        if peer and peer_filter.can_filter(self.host, wanted) and peer_filter.attach(self._listen_fd, wanted):
            self.admitted = wanted
        else:
            peer_filter.detach(self._listen_fd)
            self.admitted = None

    def _answer(self, sends: list[StageSend]) -> None:
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
            self._offer_peers.pop(name, None)
        if entry is None:
            self._sock.send_multipart([identity, _STATUS_MISSING, seal.seal(_STATUS_SEAL_INDEX, _STATUS_MISSING, b"")])
            return
        packed, _, buffer = entry
        if isinstance(packed, Future):  # still packing, maybe: the server is woken when it ends
            packed.add_done_callback(lambda _: self._wakeup.wake())
            # Packed beside the steps: a pre-copy stage, paced as its packing was.
            sends.append(
                StageSend(
                    identity, seal, packed, buffer, self.buffers, self._budget, self._sent_frames, self._io_allowance
                )
            )
            return
        # A final stage (its request paused): sent at once, the I/O thread at the steps' priority.
        self._io_policy.urgent_begin()
        send = StageSend(identity, seal, packed, buffer, self.buffers, io_allowance=self._io_allowance)
        try:
            send.advance(self._sock)
        finally:
            if send.sending is None:  # nothing left to send
                self._io_policy.urgent_end()
            else:
                self._final_sends.append(send.sending)
                self._sent_frames.watch(send.sending, then=self._end_final_send)

    def _end_final_send(self) -> None:
        """A final stage has left (on SentFrames' thread): the I/O thread
        yields again, and the server looks whether it may stop listening."""
        self._io_policy.urgent_end()
        self._wakeup.wake()

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
            self._offer_peers.clear()
        self.buffers = StageBuffers()  # the kept buffers' memory goes with the server
