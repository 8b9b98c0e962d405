"""What a process on the network can do to a step queue's TCP side: without
the executor's CURVE key it can neither subscribe nor pose as the writer; a
pickle sent to a reader is refused, never run; sequence numbers catch a lost,
repeated or reordered message on an authenticated remote reader. And code (a
callable) rides only inline in a local shared-memory ring."""

from __future__ import annotations

import pickle
import threading

import msgspec
import pytest
import zmq

from raylm.distributed.message_codec import CallableNotAllowedError, UntrustedPayloadError
from raylm.distributed.mq_sockets import REMOTE_DATA, REMOTE_HEADER
from raylm.distributed.mq_wait import QueueOutOfSyncError
from raylm.distributed.shm_broadcast import MessageQueue, MessageQueueHandle
from raylm.distributed.tcp_auth import UNAUTHENTICATED_TCP_ENV, CurveKeys
from raylm.messages import KVCacheConfig

CHUNK = 4096
NOTHING_WITHIN_S = 1.0  # how long a test waits for something that must not come


def _remote_queue(**kwargs) -> tuple[MessageQueue, MessageQueue]:
    writer = MessageQueue(0, num_remote_readers=1, chunk_bytes=CHUNK, **kwargs)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready(timeout=10)
    return writer, reader


def _remote_handle(address: str, keys: CurveKeys | None) -> MessageQueueHandle:
    return MessageQueueHandle(
        shm_name=None,
        chunk_bytes=CHUNK,
        max_chunks=4,
        local_reader_ranks=[],
        local_overflow_address=None,
        remote_address=address,
        num_remote_readers=1,
        tcp_keys=keys,
    )


def _nothing_arrives(sock: zmq.Socket) -> bool:
    return sock.poll(timeout=int(NOTHING_WITHIN_S * 1000)) == 0


@pytest.fixture(autouse=True)
def curve_on_by_default(monkeypatch):
    # The default under test: a developer's benchmarking setting must not leak in.
    monkeypatch.delenv(UNAUTHENTICATED_TCP_ENV, raising=False)


@pytest.fixture
def zmq_context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def test_remote_sockets_are_curve_by_default_and_the_auth_thread_ends_with_the_queue():
    writer, reader = _remote_queue()
    try:
        assert writer.export_handle().tcp_keys is not None
        assert "secret" not in repr(writer.export_handle().tcp_keys)  # a logged handle leaks no secret
        auth_thread = writer._curve_server.thread
        assert auth_thread.is_alive()
        writer.enqueue(KVCacheConfig(7, 16), timeout=10)
        assert reader.dequeue(timeout=10) == KVCacheConfig(7, 16)
    finally:
        reader.close()
        writer.close()
    auth_thread.join(5)
    assert not auth_thread.is_alive()


@pytest.mark.parametrize("client_keys", ["none", "own keypair"])
def test_a_subscriber_without_the_key_gets_nothing_and_is_not_counted(zmq_context, client_keys):
    writer = MessageQueue(0, num_remote_readers=1, chunk_bytes=CHUNK)
    intruder = zmq_context.socket(zmq.SUB)
    intruder.setsockopt(zmq.SUBSCRIBE, b"")
    if client_keys == "own keypair":
        # Knows the writer's public key (as if leaked) but not its secret.
        intruder.curve_publickey, intruder.curve_secretkey = zmq.curve_keypair()
        intruder.curve_serverkey = writer.export_handle().tcp_keys.public
    intruder.connect(writer.export_handle().remote_address)
    reader = None
    try:
        # The intruder is not taken for the one remote reader the writer awaits.
        with pytest.raises(TimeoutError):
            writer.wait_until_ready(timeout=NOTHING_WITHIN_S)
        reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
        writer.wait_until_ready(timeout=10)
        for i in range(3):
            writer.enqueue(("step", i), timeout=10)
        assert [reader.dequeue(timeout=10) for _ in range(3)] == [("step", i) for i in range(3)]
        assert _nothing_arrives(intruder)
    finally:
        # The intruder first: its handshakes, retried while it is connected,
        # could hold up the writer's context as it terminates.
        intruder.close(linger=0)
        for q in (reader, writer):
            if q is not None:
                q.close()


def test_without_curve_anyone_can_subscribe_which_is_why_it_is_the_default(zmq_context, monkeypatch):
    monkeypatch.setenv(UNAUTHENTICATED_TCP_ENV, "1")
    writer = MessageQueue(0, num_remote_readers=1, chunk_bytes=CHUNK)
    assert writer.export_handle().tcp_keys is None and writer._curve_server is None
    eavesdropper = zmq_context.socket(zmq.SUB)
    eavesdropper.setsockopt(zmq.SUBSCRIBE, b"")
    eavesdropper.connect(writer.export_handle().remote_address)
    try:
        writer.wait_until_ready(timeout=10)  # the eavesdropper counts as the reader
        writer.enqueue("secret step", timeout=10)
        assert eavesdropper.poll(timeout=10_000)
        assert writer.codec.decode(eavesdropper.recv_multipart()[1]) == "secret step"
    finally:
        writer.close()


def _serve(ctx: zmq.Context, frames_for_the_subscriber, stop: threading.Event, curve_keys: CurveKeys | None = None):
    """A rogue writer: an XPUB at a TCP address that a reader's handle points at."""
    sock = ctx.socket(zmq.XPUB)
    if curve_keys is not None:
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = curve_keys.secret, curve_keys.public, True
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def run():
        subscribed = False
        while not stop.is_set():
            if sock.poll(timeout=20) and sock.recv()[:1] == b"\x01":
                subscribed = True
            if subscribed or curve_keys is not None:
                for frames in frames_for_the_subscriber:
                    sock.send_multipart(frames)
                if subscribed:
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{port}", thread


def _exploit_file_pickle(path) -> bytes:
    class Exploit:
        def __reduce__(self):
            return (open, (str(path), "w"))

    return pickle.dumps(Exploit(), protocol=5)


def test_a_crafted_pickle_sent_to_a_remote_reader_is_refused_and_never_runs(zmq_context, tmp_path):
    target = tmp_path / "created-by-unpickling"
    evil = _exploit_file_pickle(target)
    header = REMOTE_HEADER.pack(REMOTE_DATA, 0)
    # The codec's old pickle extension, exactly as the previous wire format sent it.
    stop = threading.Event()
    address, server = _serve(zmq_context, [[header, msgspec.msgpack.encode(msgspec.msgpack.Ext(3, evil))]], stop)
    reader = MessageQueue.create_from_handle(_remote_handle(address, keys=None), 0)
    try:
        with pytest.raises(UntrustedPayloadError):
            reader.dequeue(timeout=10)
    finally:
        stop.set()
        server.join(5)
        reader.close()
    assert not target.exists()


def test_a_reader_ignores_a_writer_without_the_executors_key(zmq_context, tmp_path):
    """A rogue server at the address (plain, or CURVE with keys of its own):
    the reader's handshake fails, so nothing it sends is ever decoded."""
    target = tmp_path / "created-by-unpickling"
    exploit = msgspec.msgpack.encode(msgspec.msgpack.Ext(3, _exploit_file_pickle(target)))
    frames = [[REMOTE_HEADER.pack(REMOTE_DATA, 0), exploit]]
    for rogue_keys in (None, CurveKeys.generate()):
        stop = threading.Event()
        address, server = _serve(zmq_context, frames, stop, curve_keys=rogue_keys)
        reader = MessageQueue.create_from_handle(_remote_handle(address, keys=CurveKeys.generate()), 0)
        try:
            with pytest.raises(TimeoutError):
                reader.dequeue(timeout=NOTHING_WITHIN_S)
        finally:
            stop.set()
            server.join(5)
            reader.close()
    assert not target.exists()


@pytest.mark.parametrize("fault", ["lost", "repeated"])
def test_an_authenticated_remote_reader_detects_a_lost_or_repeated_message(fault):
    writer, reader = _remote_queue()
    try:
        assert writer.export_handle().tcp_keys is not None
        writer.enqueue("zero", timeout=10)
        writer._seq += 1 if fault == "lost" else -1  # message 1 skipped, or message 0 sent again
        writer.enqueue("next", timeout=10)
        assert reader.dequeue(timeout=10) == "zero"
        expected = "got message 2 where 1 was due" if fault == "lost" else "got message 0 where 1 was due"
        with pytest.raises(QueueOutOfSyncError, match=expected):
            reader.dequeue(timeout=10)
    finally:
        reader.close()
        writer.close()


def test_a_remote_reader_detects_reordered_messages(zmq_context):
    stop = threading.Event()
    frames = [[REMOTE_HEADER.pack(REMOTE_DATA, seq), msgspec.msgpack.encode(f"m{seq}")] for seq in (0, 2, 1)]
    address, server = _serve(zmq_context, frames, stop)
    reader = MessageQueue.create_from_handle(_remote_handle(address, keys=None), 0)
    try:
        assert reader.dequeue(timeout=10) == "m0"
        with pytest.raises(QueueOutOfSyncError, match="got message 2 where 1 was due"):
            reader.dequeue(timeout=10)
        with pytest.raises(QueueOutOfSyncError):  # and it stays out of sync
            reader.dequeue(timeout=10)
    finally:
        stop.set()
        server.join(5)
        reader.close()


# ---- callables: the local shared-memory ring only --------------------------------------


def _times(worker, factor):
    return worker * factor


def test_a_callable_rides_inline_on_a_local_callables_ring():
    writer = MessageQueue(1, chunk_bytes=CHUNK, local_callables=True)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        writer.enqueue((_times, (3,)), timeout=10)
        fn, args = reader.dequeue(timeout=10)
        assert fn(2, *args) == 6
        # Too big for a chunk, it would take the overflow socket: refused before sending.
        with pytest.raises(CallableNotAllowedError, match="never on a socket"):
            writer.enqueue((_times, b"x" * (2 * CHUNK)), timeout=10)
        writer.enqueue("still in step", timeout=10)
        assert reader.dequeue(timeout=10) == "still in step"
    finally:
        reader.close()
        writer.close()


def test_a_callable_is_refused_by_a_plain_queue_and_by_one_with_remote_readers():
    with pytest.raises(ValueError, match="local_callables"):
        MessageQueue(1, num_remote_readers=1, local_callables=True)
    writer, reader = _remote_queue()
    try:
        with pytest.raises(CallableNotAllowedError, match="_times"):
            writer.enqueue(_times, timeout=10)
    finally:
        reader.close()
        writer.close()
