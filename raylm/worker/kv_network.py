"""KV blocks between ranks on different nodes (live migration across hosts;
on one node they go through files in shared memory, raylm.worker.kv_transfer).

The source rank packs the blocks of a stage in memory (the same bytes as a
transfer file: header, then each layer's K and V) and offers them, by name,
on a ZMQ ROUTER socket of its own, bound on its node's address. The
destination's rank of the same index connects, asks for the name once, and
scatters the answer into the blocks it reserved. An offer is handed out once
and then dropped; one never asked for is withdrawn when its migration ends
(and, as a safety net, expires).

Trust: ZMQ CURVE with a keypair the supervisor makes and sends both sides
inside their migration messages, which travel on the cores' authenticated
input sockets (the pre-shared-key scheme of the step queues,
raylm.distributed.tcp_auth). The server admits only clients presenting that
key, the client accepts only a server holding it, and the K/V is encrypted
on the wire. Measured against Ray's object store on the two-host harness:
benchmarks/bench_kv_transport.py.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import Future

import torch
import zmq

from raylm.distributed.tcp_auth import CurveKeys, CurveServer, secure_client, terminate_context
from raylm.worker import kv_transfer
from raylm.worker.cpu_placement import thread_ids

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
# A stage travels as frames of at most this many bytes. CURVE encrypts and
# decrypts frame by frame into messages libzmq allocates: a 64 MiB stage as
# one frame cost the sender 89-94 ms and the receiver 56-60 ms of CPU, as 64
# frames of 1 MiB 36-37 and 29-30 (the allocator keeps blocks of that size
# and hands them out again; one larger than 32 MiB is mapped fresh and
# unmapped after, every time).
_FRAME_BYTES = 1 << 20


class StageBuffers:
    """Buffers of stages, each used again once nothing reads it any more: a
    source rank packs its stages into them (free again once ZMQ's tracker
    says the send is done), a destination joins a stage's frames in them. A
    fresh buffer the size of a long request's first stage (35 MiB for 2k
    tokens of the ~111M model) is paged in and zeroed a fault at a time, and
    unmapped again when freed: the cost kv_transfer's spare files save on
    one node, here on cores that step."""

    MAX_BUFFERS = 3  # a long request's first stage, a later one, a final one
    MAX_BUFFER_BYTES = 128 << 20  # a larger stage's buffer is not kept

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
            if len(self._kept) >= self.MAX_BUFFERS:
                # Room for it only in place of a smaller free one.
                free = [e for e in self._kept if (e[1] is None or e[1].done) and e[0].numel() < buffer.numel()]
                if not free:
                    return
                self._drop(min(free, key=lambda e: e[0].numel()))
            self._kept.append((buffer, sending))

    def _drop(self, entry: tuple) -> None:
        # By identity: list.remove would compare the tensors element-wise.
        self._kept = [kept for kept in self._kept if kept is not entry]

    @property
    def num_kept(self) -> int:
        with self._lock:
            return len(self._kept)


class KVBlockServer:
    """Offers packed blocks by name on one CURVE ROUTER socket, answered by a
    daemon thread (the rank's loop never waits on a destination)."""

    def __init__(self, host: str, keys: CurveKeys):
        self.keys = keys
        # (Niced before the handshakes' authenticator is made: it keeps its priority.)
        self._context, self._sock = _context_yielding_to_the_steps(zmq.ROUTER)
        self._curve = CurveServer(self._context, keys)  # before bind: no client connects unchecked
        self._curve.secure(self._sock)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        # name -> (packed blocks, or the Future of a packing still running;
        # when offered; the pool's buffer they are packed into, or None)
        self._offers: dict[bytes, tuple[torch.Tensor | Future, float, torch.Tensor | None]] = {}
        self.buffers = StageBuffers()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # Requests that reached this thread: only clients holding the key get
        # past the handshake, which libzmq's I/O thread runs, so a stranger's
        # traffic never wakes the thread (tests count on it).
        self.requests_received = 0
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
        while not self._closed.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart()
            self.requests_received += 1
            if len(frames) != 2:
                continue  # not a request of ours
            identity, name = frames
            with self._lock:
                entry = self._offers.pop(name, None)
            if entry is None:
                self._sock.send_multipart([identity, _STATUS_MISSING, b""])
                continue
            packed, _, buffer = entry
            try:
                if isinstance(packed, Future):
                    packed = packed.result()
            except Exception as e:  # the packing failed: the destination says why
                self._sock.send_multipart([identity, _STATUS_FAILED, f"{type(e).__name__}: {e}".encode()])
                if buffer is not None:
                    self.buffers.give_back(buffer)
                continue
            # Zero-copy: ZMQ holds the frames until they are sent, which their trackers tell.
            data = packed.numpy()
            frames = [zmq.Frame(data[at : at + _FRAME_BYTES], copy=False, track=True)
                      for at in range(0, len(data), _FRAME_BYTES)]
            self._sock.send_multipart([identity, _STATUS_OK, *frames], copy=False)
            sending = zmq.MessageTracker(*frames)
            # A frame's send is done only once this thread holds it no more either.
            del frames, data, packed
            if buffer is not None:
                self.buffers.give_back(buffer, sending)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._curve.stop()
        terminate_context(self._context)
        with self._lock:
            self._offers.clear()
        self.buffers = StageBuffers()  # the kept buffers' memory goes with the server


def _context_yielding_to_the_steps(socket_type: int) -> tuple[zmq.Context, zmq.Socket]:
    """A ZMQ context for K/V transfers and its first socket (which starts the
    context's threads), those threads at nice 10. CURVE encrypts and decrypts
    a stage's blocks on its I/O thread, a whole message at a time (35 MiB for
    2k tokens of the ~111M model, ~90 ms of CPU at each end): where no core is
    spare, at the default priority that burst took its share of a core that
    was stepping. At nice 10 the kernel runs it in what the steps leave; where
    cores are spare it makes no difference. Linux only."""
    before = set(thread_ids())
    context = zmq.Context()
    sock = context.socket(socket_type)
    _lower_priority_of_zmq_threads(set(thread_ids()) - before)
    return context, sock


def _lower_priority_of_zmq_threads(new_threads: set[int]) -> None:
    """Nice 10 for the threads among `new_threads` that name themselves
    ZMQbg/... (a new thread does so as it starts: waited for briefly), so
    that no other thread started meanwhile is slowed."""
    deadline = time.monotonic() + 0.2
    while new_threads:
        for tid in list(new_threads):
            name = _thread_name(tid)
            if name is not None and not name.startswith("ZMQbg/"):
                continue  # not named yet, or another's: looked at again
            new_threads.discard(tid)
            if name is not None:
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), _KV_IO_NICE))
                except OSError:  # gone, or not allowed: the transfer works all the same
                    pass
        if not new_threads or time.monotonic() >= deadline:
            return
        time.sleep(0.005)


def _thread_name(tid: int) -> str | None:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # the thread ended
        return None


_KV_IO_NICE = 10
_fetch_context: zmq.Context | None = None
_fetch_context_lock = threading.Lock()


def _fetch_zmq_context() -> zmq.Context:
    """The context every fetch of this process uses, its threads niced (see above)."""
    global _fetch_context
    with _fetch_context_lock:
        if _fetch_context is None:
            context, first = _context_yielding_to_the_steps(zmq.DEALER)
            first.close(linger=0)
            _fetch_context = context
        return _fetch_context


def fetch(address: str, name: str, keys: CurveKeys, timeout_s: float = FETCH_TIMEOUT_S,
          cancelled: threading.Event | None = None) -> list[zmq.Frame]:
    """The packed blocks offered as `name` at `address`, as the read-only
    frames they came in; the wait for them gives up after `timeout_s`, or
    once `cancelled` is set."""
    sock = _fetch_zmq_context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, keys)
    sock.connect(address)
    try:
        sock.send(name.encode())
        deadline = time.monotonic() + timeout_s
        while not sock.poll(int(1000 * max(0.0, min(_CANCEL_CHECK_S, deadline - time.monotonic())))):
            if cancelled is not None and cancelled.is_set():
                raise kv_transfer.KVTransferError(f"the fetch of the K/V blocks {name!r} from {address} was cancelled")
            if time.monotonic() >= deadline:
                raise kv_transfer.KVTransferError(
                    f"the source rank at {address} did not send the K/V blocks {name!r} within {timeout_s:.0f} s")
        frames = sock.recv_multipart(copy=False)
    finally:
        sock.close(linger=0)
    status, payload = frames[0].bytes, frames[1:]
    if status == _STATUS_MISSING:
        raise kv_transfer.KVTransferError(f"the source rank at {address} offers no K/V blocks {name!r}")
    if status != _STATUS_OK or not payload:
        reason = payload[0].bytes.decode(errors="replace") if payload else "no answer"
        raise kv_transfer.KVTransferError(f"the source rank at {address} failed to pack {name!r}: {reason}")
    return payload


# Where a destination joins a stage's frames (process-wide: the fetches of
# all its migrations).
_joined_stages = StageBuffers()


class KVNetworkEndpoint:
    """A rank's side of cross-node transfers: its server (started on the first
    export, remade if the supervisor's key changes) and its fetches."""

    def __init__(self):
        self._server: KVBlockServer | None = None

    def serve(self, kv_caches: list[torch.Tensor], name: str, block_ids: list[int], host: str,
              keys: CurveKeys, run_in_background=None) -> tuple[int, str]:
        """Pack the blocks and offer them as `name`; (bytes, address to fetch them from).
        `run_in_background(fn, *args) -> Future`: pack on another thread (a
        fetch meanwhile waits for it); None: pack now."""
        server = self._server_for(host, keys)
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
                   keys: CurveKeys, timeout_s: float = FETCH_TIMEOUT_S, cancelled: threading.Event | None = None,
                   pause=None) -> int:
        """Fetch the offer `name` into `block_ids`; `pause`: called between
        layers of the unpacking (a paced copy beside the steps)."""
        frames = fetch(address, name, keys, timeout_s, cancelled)
        what = f"the K/V blocks {name!r} from {address}"
        if len(frames) == 1:
            return kv_transfer.unpack_blocks(kv_caches, block_ids, frames[0].buffer, what, pause)
        size = sum(len(frame.buffer) for frame in frames)
        buffer = _joined_stages.take(size)
        try:
            joined = memoryview(buffer.numpy())[:size]
            at = 0
            for frame in frames:
                part = frame.buffer
                joined[at : at + len(part)] = part
                at += len(part)
                if pause is not None:
                    pause()
            del frames  # their memory back before the unpacking
            return kv_transfer.unpack_blocks(kv_caches, block_ids, joined, what, pause)
        finally:
            _joined_stages.give_back(buffer)

    def withdraw(self, prefix: str) -> int:
        return self._server.withdraw(prefix) if self._server is not None else 0

    def _server_for(self, host: str, keys: CurveKeys) -> KVBlockServer:
        server = self._server
        if server is not None and (server.keys != keys or not server.address.startswith(f"tcp://{host}:")):
            server.close()
            server = None
        if server is None:
            server = self._server = KVBlockServer(host, keys)
        return server

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
