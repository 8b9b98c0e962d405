"""MessageQueue: order, several readers, the ZMQ overflow path, back-pressure from
a slow reader, readers in another process, close, timeouts and /dev/shm cleanup;
a peer killed or closing mid-overflow, and sequence numbers on every message."""

from __future__ import annotations

import multiprocessing
import os
import signal
import struct
import threading
import time

import pytest

from raylm.distributed.mq_wait import QueueClosedError, QueueOutOfSyncError
from raylm.distributed.shm_broadcast import SEGMENT_PREFIX, MessageQueue
from raylm.distributed.shm_ring import unlink_segment
from raylm.messages import CachedRequestData, NewRequestData, SchedulerOutput
from raylm.sampling_params import SamplingParams
from tests.child_processes import preloaded_spawn_context

CHUNK = 4096


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(SEGMENT_PREFIX)}


@pytest.fixture
def queue_factory():
    """Make writer + readers; close everything at the end, even on failure."""
    made: list[MessageQueue] = []

    def make(num_readers: int, **kwargs):
        writer = MessageQueue(num_readers, chunk_bytes=kwargs.pop("chunk_bytes", CHUNK), **kwargs)
        readers = [MessageQueue.create_from_handle(writer.export_handle(), r) for r in range(num_readers)]
        made.extend([writer, *readers])
        return writer, readers

    yield make
    for q in made:
        q.close()


def _read_all(reader: MessageQueue, count: int, into: list, delay: float = 0.0) -> None:
    for _ in range(count):
        into.append(reader.dequeue(timeout=10))
        if delay:
            time.sleep(delay)


def _scheduler_output(i: int) -> SchedulerOutput:
    new = NewRequestData(f"r{i}", list(range(i, i + 5)), [], SamplingParams(temperature=0.0, max_tokens=4), [i], 0)
    cached = CachedRequestData(f"c{i}", [i], [], i)
    return SchedulerOutput([new], [cached], {f"r{i}": 5, f"c{i}": 1}, 6, {f"done{i}"})


def test_order_and_typed_messages_with_three_readers(queue_factory):
    writer, readers = queue_factory(3, max_chunks=4)
    messages = [(i, _scheduler_output(i), {"k": (i, "x")}) for i in range(40)]
    got = [[] for _ in readers]
    threads = [threading.Thread(target=_read_all, args=(r, len(messages), got[i])) for i, r in enumerate(readers)]
    for t in threads:
        t.start()
    for m in messages:
        writer.enqueue(m, timeout=10)
    for t in threads:
        t.join(10)
    for received in got:
        assert received == messages
        assert isinstance(received[3][1], SchedulerOutput) and isinstance(received[3][2]["k"], tuple)


def test_payload_larger_than_a_chunk_takes_the_overflow_path(queue_factory):
    writer, readers = queue_factory(2, max_chunks=2)
    big = [bytes([i]) * (3 * CHUNK) for i in range(5)]
    messages = [big[0], "small", big[1], big[2], 7, big[3], big[4]]
    got = [[] for _ in readers]
    threads = [threading.Thread(target=_read_all, args=(r, len(messages), got[i])) for i, r in enumerate(readers)]
    for t in threads:
        t.start()
    for m in messages:
        writer.enqueue(m, timeout=10)
    for t in threads:
        t.join(10)
    assert got == [messages, messages]


def test_slow_reader_blocks_the_writer_and_loses_nothing(queue_factory):
    writer, (fast, slow) = queue_factory(2, max_chunks=3)
    sent: list[int] = []

    def write():
        for i in range(12):
            writer.enqueue(i, timeout=20)
            sent.append(i)

    fast_got: list = []
    threading.Thread(target=_read_all, args=(fast, 12, fast_got)).start()
    w = threading.Thread(target=write)
    w.start()
    time.sleep(0.3)
    # The slow reader has read nothing yet: the ring holds 3 messages, no more.
    assert len(sent) == 3
    slow_got: list = []
    _read_all(slow, 12, slow_got, delay=0.005)
    w.join(10)
    assert slow_got == list(range(12)) and sent == list(range(12))


def _child_reader(handle, rank, conn):
    reader = MessageQueue.create_from_handle(handle, rank)
    try:
        received = [reader.dequeue(timeout=60) for _ in range(4)]
        conn.send(received)
    finally:
        reader.close()


@pytest.mark.slow
def test_reader_in_another_process():
    writer = MessageQueue(2, chunk_bytes=CHUNK)
    ctx = preloaded_spawn_context()
    pipes, procs = [], []
    try:
        for rank in range(2):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child_reader, args=(writer.export_handle(), rank, child_end), daemon=True)
            p.start()
            pipes.append(parent_end)
            procs.append(p)
        messages = ["hello", _scheduler_output(1), b"z" * (2 * CHUNK), (1, 2.5, None)]
        for m in messages:
            writer.enqueue(m, timeout=60)
        for conn in pipes:
            assert conn.poll(60)
            assert conn.recv() == messages
        for p in procs:
            p.join(10)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        writer.close()


def test_close_wakes_a_blocked_reader_promptly(queue_factory):
    writer, (reader,) = queue_factory(1)
    writer.enqueue("last")
    errors: list[BaseException] = []

    def wait_forever():
        assert reader.dequeue() == "last"  # a close still lets readers drain
        try:
            reader.dequeue()
        except QueueClosedError as e:
            errors.append(e)

    t = threading.Thread(target=wait_forever)
    t.start()
    time.sleep(0.3)  # long enough for the reader to reach its sleeping backoff
    writer.close()
    t.join(5)
    assert errors and "closed" in str(errors[0])


def test_local_close_wakes_a_blocked_reader(queue_factory):
    _, (reader,) = queue_factory(1)
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(QueueClosedError, reader.dequeue).value))
    t.start()
    time.sleep(0.1)
    reader.close()
    t.join(5)
    assert not t.is_alive() and errors


def test_dequeue_timeout(queue_factory):
    writer, (reader,) = queue_factory(1)
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.1)
    writer.enqueue("after")  # a timed-out dequeue leaves the queue usable
    assert reader.dequeue(timeout=5) == "after"


def test_writer_enqueue_times_out_when_the_ring_is_full(queue_factory):
    writer, _ = queue_factory(1, max_chunks=2)
    writer.enqueue(0)
    writer.enqueue(1)
    with pytest.raises(TimeoutError):
        writer.enqueue(2, timeout=0.1)


def test_remote_reader_over_zmq():
    writer = MessageQueue(1, num_remote_readers=1, chunk_bytes=CHUNK)
    local = MessageQueue.create_from_handle(writer.export_handle(), 0)
    remote = MessageQueue.create_from_handle(writer.export_handle(), 1)
    try:
        writer.wait_until_ready(timeout=10)
        messages = ["a", b"b" * (2 * CHUNK), _scheduler_output(2)]
        for m in messages:
            writer.enqueue(m, timeout=10)
        assert [local.dequeue(timeout=10) for _ in messages] == messages
        assert [remote.dequeue(timeout=10) for _ in messages] == messages
        writer.close()
        with pytest.raises(QueueClosedError):
            remote.dequeue(timeout=10)
    finally:
        for q in (local, remote, writer):
            q.close()


def test_no_segment_left_in_dev_shm_after_close():
    writer = MessageQueue(2, chunk_bytes=CHUNK)
    readers = [MessageQueue.create_from_handle(writer.export_handle(), r) for r in range(2)]
    name = writer.shm_name
    assert name in _segments()
    for r in readers:
        r.close()
    assert name in _segments()  # readers detach; only the writer unlinks
    writer.close()
    assert name not in _segments()


# ---- a peer dying or closing mid-overflow; sequence numbers ------------------------

BIG = 8 << 20  # far larger than CHUNK: always the overflow path
SLACK_S = 5.0  # generous: only "it returned, and raised", not how fast


def _timed(fn, *args, **kwargs) -> tuple[BaseException | None, float]:
    start = time.monotonic()
    try:
        fn(*args, **kwargs)
    except BaseException as e:  # the caller asserts on it
        return e, time.monotonic() - start
    return None, time.monotonic() - start


def _drop_overflow_payloads(writer: MessageQueue) -> list:
    """Make the writer publish overflow markers whose payloads never leave it,
    as when it is killed (or its linger expires) before the bytes go out; the
    dropped frames are returned so a test can deliver them late."""
    dropped: list = []
    writer._local_pub.sock.send_multipart = lambda frames, **kwargs: dropped.append(frames)
    return dropped


def _reap(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)
    assert not any(p.is_alive() for p in procs)
    assert not multiprocessing.active_children()


def _child_reader_reporting(handle, conn):
    reader = MessageQueue.create_from_handle(handle, 0)
    conn.send("attached")
    while True:
        conn.send("reading")
        reader.dequeue(timeout=60)


def test_reader_killed_mid_overflow_the_writer_raises_within_its_timeout():
    writer = MessageQueue(1, chunk_bytes=CHUNK, max_chunks=2)
    name = writer.shm_name
    ctx = preloaded_spawn_context()
    parent_end, child_end = ctx.Pipe(duplex=False)
    reader = ctx.Process(target=_child_reader_reporting, args=(writer.export_handle(), child_end), daemon=True)
    reader.start()
    try:
        assert parent_end.poll(60) and parent_end.recv() == "attached"
        writer.enqueue(b"a" * BIG, timeout=60)
        writer.enqueue(b"b" * BIG, timeout=60)
        for _ in range(2):  # the second "reading": the first reply is in, the second on its way
            assert parent_end.poll(60) and parent_end.recv() == "reading"
        os.kill(reader.pid, signal.SIGKILL)
        reader.join(10)
        # The dead reader holds its chunk for ever: within a ring's worth of
        # messages the writer must hit it, and give up at its timeout.
        for i in range(3):
            error, took = _timed(writer.enqueue, bytes([i]) * BIG, timeout=1.0)
            assert took < 1.0 + SLACK_S
            if error is not None:
                break
        assert isinstance(error, TimeoutError)
    finally:
        _reap([reader])
        writer.close()
    assert name not in _segments()


def _child_writer_dying_mid_overflow(conn):
    writer = MessageQueue(1, chunk_bytes=CHUNK, max_chunks=2)
    conn.send(writer.export_handle())
    writer.wait_until_ready(timeout=60)
    _drop_overflow_payloads(writer)  # the SIGKILL lands before the payload leaves
    writer.enqueue(b"x" * BIG, timeout=60)
    conn.send("published")
    time.sleep(600)


def test_writer_killed_mid_overflow_the_reader_raises_within_its_timeout():
    ctx = preloaded_spawn_context()
    parent_end, child_end = ctx.Pipe(duplex=False)
    writer = ctx.Process(target=_child_writer_dying_mid_overflow, args=(child_end,), daemon=True)
    writer.start()
    reader = handle = None
    try:
        assert parent_end.poll(60)
        handle = parent_end.recv()
        reader = MessageQueue.create_from_handle(handle, 0)
        assert parent_end.poll(60) and parent_end.recv() == "published"
        error, took = _timed(reader.dequeue, timeout=1.0)  # marker seen, payload never comes
        assert isinstance(error, TimeoutError) and took < 1.0 + SLACK_S
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(10)
        error, took = _timed(reader.dequeue, timeout=1.0)  # a dead writer closes nothing
        assert isinstance(error, TimeoutError) and took < 1.0 + SLACK_S
    finally:
        _reap([writer])
        if reader is not None:
            reader.close()
        if handle is not None:
            # The killed writer could not unlink its segment; the spawned child
            # shared this process's resource tracker, so unregister here too.
            unlink_segment(handle.shm_name)
            assert handle.shm_name not in _segments()


def test_writer_close_while_a_reader_waits_on_an_overflow_payload(queue_factory):
    writer, (reader,) = queue_factory(1)
    writer.wait_until_ready(timeout=10)
    _drop_overflow_payloads(writer)
    writer.enqueue(b"x" * BIG, timeout=10)
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: errors.append(_timed(reader.dequeue)[0]), daemon=True)  # no timeout
    t.start()
    time.sleep(0.3)  # the reader is waiting on the payload now
    writer.close()
    t.join(10)
    assert not t.is_alive()
    assert isinstance(errors[0], QueueClosedError)


def test_overflow_payload_sent_just_before_close_is_still_delivered(queue_factory):
    writer, (reader,) = queue_factory(1)
    writer.enqueue(b"y" * BIG, timeout=10)
    writer.close()
    assert reader.dequeue(timeout=10) == b"y" * BIG  # a close lets readers drain
    with pytest.raises(QueueClosedError):
        reader.dequeue(timeout=10)


def test_overflow_timeout_keeps_the_message_for_the_next_dequeue(queue_factory):
    writer, (reader,) = queue_factory(1)
    writer.wait_until_ready(timeout=10)
    send = writer._local_pub.sock.send_multipart
    late = _drop_overflow_payloads(writer)
    writer.enqueue(b"z" * BIG, timeout=10)
    for timeout in (0, 0.2):
        error, took = _timed(reader.dequeue, timeout=timeout)
        assert isinstance(error, TimeoutError) and took < timeout + SLACK_S
    send(late.pop(), copy=False)  # the payload arrives after all
    writer._local_pub.sock.send_multipart = send
    writer.enqueue("next", timeout=10)
    assert reader.dequeue(timeout=10) == b"z" * BIG
    assert reader.dequeue(timeout=10) == "next"


def _remote_pair(max_chunks: int = 4):
    writer = MessageQueue(1, num_remote_readers=1, chunk_bytes=CHUNK, max_chunks=max_chunks)
    local = MessageQueue.create_from_handle(writer.export_handle(), 0)
    remote = MessageQueue.create_from_handle(writer.export_handle(), 1)
    writer.wait_until_ready(timeout=10)
    return writer, local, remote


def test_remote_reader_gets_many_mixed_messages_in_order_with_seqs():
    writer, local, remote = _remote_pair()
    messages = [bytes([i % 256]) * (3 * CHUNK) if i % 3 == 0 else (i, f"small {i}") for i in range(150)]
    got: dict[str, list] = {"local": [], "remote": []}
    threads = [
        threading.Thread(target=_read_all, args=(q, len(messages), got[k]), daemon=True)
        for k, q in (("local", local), ("remote", remote))
    ]
    try:
        for t in threads:
            t.start()
        for m in messages:
            writer.enqueue(m, timeout=10)
        for t in threads:
            t.join(30)
        assert got["local"] == messages and got["remote"] == messages
        assert remote._seq == len(messages)  # every message's seq was the one expected
    finally:
        for q in (local, remote, writer):
            q.close()


def test_remote_reader_raises_on_a_seq_gap_and_keeps_raising():
    writer, local, remote = _remote_pair()
    try:
        writer.enqueue("zero", timeout=10)
        writer._seq += 1  # as if message 1 was lost on the way
        writer.enqueue("two", timeout=10)
        assert remote.dequeue(timeout=10) == "zero"
        with pytest.raises(QueueOutOfSyncError, match="got message 2 where 1 was due"):
            remote.dequeue(timeout=10)
        writer.enqueue("three", timeout=10)
        with pytest.raises(QueueOutOfSyncError):  # never the next payload as if nothing happened
            remote.dequeue(timeout=10)
    finally:
        for q in (local, remote, writer):
            q.close()


def test_local_reader_raises_when_an_overflow_payload_is_not_its_chunks(queue_factory):
    writer, (reader,) = queue_factory(1)
    writer.wait_until_ready(timeout=10)
    # A stray payload ahead of the real one: arrival order alone would return it.
    writer._local_pub.sock.send_multipart([struct.pack("<Q", 7), writer.codec.encode("stray")])
    writer.enqueue(b"w" * BIG, timeout=10)
    with pytest.raises(QueueOutOfSyncError, match="got message 7 where 0 was due"):
        reader.dequeue(timeout=10)


def test_enqueue_that_times_out_reaches_no_reader():
    """A full ring times enqueue out before anything is sent, so a retry
    gives remote readers the message once, not twice."""
    writer, local, remote = _remote_pair(max_chunks=1)
    try:
        writer.enqueue(0, timeout=10)
        with pytest.raises(TimeoutError):
            writer.enqueue(1, timeout=0.2)
        assert local.dequeue(timeout=10) == 0
        writer.enqueue(1, timeout=10)
        assert local.dequeue(timeout=10) == 1
        assert [remote.dequeue(timeout=10) for _ in range(2)] == [0, 1]
        with pytest.raises(TimeoutError):
            remote.dequeue(timeout=0.2)
    finally:
        for q in (local, remote, writer):
            q.close()


def _doorbells(prefix: str) -> list[str]:
    folder, name = os.path.split(prefix)
    return [n for n in os.listdir(folder) if n.startswith(name)]


def test_doorbells_leave_nothing_on_disk(queue_factory):
    """Each attached reader unlinks its pipe at once; the writer unlinks those
    of readers that never attached when it closes."""
    writer, readers = queue_factory(2)
    prefix = writer.export_handle().doorbell_prefix
    assert prefix is not None and _doorbells(prefix) == []
    lonely = MessageQueue(2, chunk_bytes=CHUNK)
    lonely_prefix = lonely.export_handle().doorbell_prefix
    reader = MessageQueue.create_from_handle(lonely.export_handle(), 1)
    assert _doorbells(lonely_prefix) == [os.path.basename(lonely_prefix) + "-0"]  # reader 0 never came
    reader.close()
    lonely.close()
    assert _doorbells(lonely_prefix) == []


def test_a_reader_asleep_on_its_doorbell_gets_every_message(queue_factory):
    """Pauses longer than the readers' spin put them to sleep on their
    doorbells between messages: every message still arrives, in order."""
    import random

    writer, readers = queue_factory(2)
    got: list[list] = [[], []]
    threads = [threading.Thread(target=_read_all, args=(r, 200, got[i])) for i, r in enumerate(readers)]
    for t in threads:
        t.start()
    rng = random.Random(0)
    for i in range(200):
        writer.enqueue(i, timeout=10)
        time.sleep(rng.choice([0, 0, 1e-4, 2e-3]))
    for t in threads:
        t.join(30)
    assert got == [list(range(200))] * 2
