"""MessageQueue: order, several readers, the ZMQ overflow path, back-pressure from
a slow reader, readers in another process, close, timeouts and /dev/shm cleanup."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest

from raylm.distributed.shm_broadcast import SEGMENT_PREFIX, MessageQueue, QueueClosedError
from raylm.messages import CachedRequestData, NewRequestData, SchedulerOutput
from raylm.sampling_params import SamplingParams

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


def test_reader_in_another_process():
    writer = MessageQueue(2, chunk_bytes=CHUNK)
    ctx = multiprocessing.get_context("spawn")
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
    woke_at: list[float] = []

    def wait_forever():
        assert reader.dequeue() == "last"  # a close still lets readers drain
        try:
            reader.dequeue()
        except QueueClosedError as e:
            woke_at.append(time.monotonic())
            errors.append(e)

    t = threading.Thread(target=wait_forever)
    t.start()
    time.sleep(0.3)  # long enough for the reader to reach its sleeping backoff
    closed_at = time.monotonic()
    writer.close()
    t.join(5)
    assert errors and "closed" in str(errors[0])
    assert woke_at[0] - closed_at < 0.5


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
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.1)
    assert time.monotonic() - start >= 0.1
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
