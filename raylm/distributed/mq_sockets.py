"""The message queue's ZMQ paths (shm_broadcast): payloads larger than a chunk
reach the local readers on a loopback socket (ordered by a marker in the ring,
shm_ring), and readers on other nodes get every message on a TCP socket, with
ZMQ CURVE when the writer has keys (raylm.distributed.tcp_auth).

Every message carries its sequence number (0, 1, 2, ... per writer): in the
first frame of an overflow payload and of a remote message. ZMQ delivers in
order but silently drops what a disconnected peer missed, so a reader checks
the number instead of trusting arrival order, and raises QueueOutOfSyncError
rather than return another message's payload. These sockets never carry code.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

import zmq

from raylm.distributed.mq_wait import Backoff, QueueClosedError, QueueOutOfSyncError
from raylm.distributed.tcp_auth import CurveKeys, CurveServer, secure_client

OVERFLOW_HEADER = struct.Struct("<Q")  # seq: first frame of an overflow payload
REMOTE_HEADER = struct.Struct("<BQ")  # kind, seq: first frame of a remote message
REMOTE_DATA = 0
REMOTE_CLOSE = 1

# How long close() lets undelivered ZMQ messages drain.
ZMQ_LINGER_MS = 200
# How long a reader still waits for an overflow payload once the writer has
# closed: what it sent before closing arrives within its linger, or never.
_CLOSED_GRACE_S = ZMQ_LINGER_MS / 1000 + 0.5


class Publisher:
    """One of the writer's XPUB sockets (the local overflow one, or the remote
    one) and the subscribers it has seen. ZMQ drops what a PUB socket sends
    before a subscriber is connected, so the writer waits for them before the
    first message that needs them."""

    def __init__(self, context: zmq.Context, host: str, curve: CurveServer | None = None):
        self.sock = context.socket(zmq.XPUB)
        if curve is not None:
            curve.secure(self.sock)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # count every subscriber, not distinct topics
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop: the ring already bounds what is in flight
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.subscribed = 0

    def wait_for_subscribers(self, needed: int, backoff: Backoff, is_closed: Callable[[], bool]) -> None:
        while self.subscribed < needed:
            if is_closed():
                raise QueueClosedError("message queue is closed")
            timeout = backoff.remaining_ms()
            if not self.sock.poll(timeout=min(10, timeout) if timeout is not None else 10):
                backoff.wait()
                continue
            event = self.sock.recv()
            if event[:1] == b"\x01":
                self.subscribed += 1

    def send_overflow(self, seq: int, payload: bytes) -> None:
        self.sock.send_multipart([OVERFLOW_HEADER.pack(seq), payload], copy=False)

    def send_remote(self, seq: int, payload: bytes) -> None:
        self.sock.send_multipart([REMOTE_HEADER.pack(REMOTE_DATA, seq), payload], copy=False)

    def send_close(self, seq: int) -> None:
        """Tell remote readers the queue is closed (best effort: never blocks)."""
        try:
            self.sock.send_multipart([REMOTE_HEADER.pack(REMOTE_CLOSE, seq), b""], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        self.sock.close(linger=ZMQ_LINGER_MS)


class Subscriber:
    """A reader's SUB socket: the writer's local overflow socket, or (for a
    reader on another node) its remote one. Once a message went missing,
    `out_of_sync` says so and the reader is done."""

    def __init__(self, context: zmq.Context, address: str, tcp_keys: CurveKeys | None = None):
        self.sock = context.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        if tcp_keys is not None:
            secure_client(self.sock, tcp_keys)
        self.sock.connect(address)
        self.out_of_sync: str | None = None

    def recv_overflow(
        self, seq: int, backoff: Backoff, writer_closed: Callable[[], bool], is_closed: Callable[[], bool]
    ) -> bytes:
        """The payload of message `seq`, whose overflow marker the reader has seen."""
        # The writer sent it before publishing the marker, so it is normally on
        # its way; but a writer killed before it left the process, or closed
        # with it still queued past the linger, never delivers it: so this wait
        # ends at the timeout too, and after a grace once the writer has closed.
        writer_closed_seen = None
        while True:
            if is_closed():
                raise QueueClosedError("message queue is closed")
            if self._poll(backoff):
                seq_frame, payload = self.sock.recv_multipart(copy=True)
                self._check_seq(OVERFLOW_HEADER.unpack(seq_frame)[0], seq)
                return payload
            if writer_closed():
                now = time.perf_counter()
                if writer_closed_seen is None:
                    writer_closed_seen = now
                elif now - writer_closed_seen > _CLOSED_GRACE_S:
                    raise QueueClosedError(f"message queue closed by its writer before message {seq}'s payload arrived")

    def recv_remote(self, seq: int, backoff: Backoff, is_closed: Callable[[], bool]) -> bytes:
        """The payload of message `seq` from the remote socket."""
        while True:
            if is_closed():
                raise QueueClosedError("message queue is closed")
            if self._poll(backoff):
                header, payload = self.sock.recv_multipart(copy=True)
                kind, got = REMOTE_HEADER.unpack(header)
                if kind == REMOTE_CLOSE:
                    raise QueueClosedError("message queue is closed by its writer")
                self._check_seq(got, seq)
                return payload

    def _poll(self, backoff: Backoff) -> bool:
        """Poll for one slice; TimeoutError once the deadline has passed (after
        a last zero-wait poll, so timeout=0 still takes what is there)."""
        timeout = backoff.remaining_ms()
        slice_ms = backoff.poll_slice_ms()
        if self.sock.poll(timeout=slice_ms if timeout is None else min(slice_ms, timeout)):
            return True
        if timeout == 0:
            raise TimeoutError("timed out waiting on the message queue")
        return False

    def _check_seq(self, got: int, expected: int) -> None:
        if got != expected:
            self.out_of_sync = (
                f"message queue out of sync: got message {got} where {expected} was due "
                "(a message was lost or sent twice); this reader cannot continue"
            )
            raise QueueOutOfSyncError(self.out_of_sync)

    def close(self) -> None:
        self.sock.close(linger=0)
