"""K/V blocks between ranks over the network (raylm.kv_transfer.network), here
on loopback: the blocks arrive bit for bit in the reserved blocks, an offer
is handed out once, only a request sealed with the supervisor's key gets
it, an answer that does not open with the key fails the fetch, and what
cannot be imported (another layout, a withdrawn offer) is refused with the
reason. A stranger flooding the socket gets nothing and holds no connection
once it stops, and one that connects and stays silent is dropped at the
handshake timeout."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from concurrent.futures import Future

import pytest
import torch
import zmq

from raylm import thread_accounting
from raylm.kv_transfer import admission as kv_admission
from raylm.kv_transfer import background as kv_background
from raylm.kv_transfer import fetch as kv_fetch
from raylm.kv_transfer import files as kv_transfer
from raylm.kv_transfer import frames as kv_frames
from raylm.kv_transfer import network as kv_network
from raylm.kv_transfer import sealed_frames
from raylm.kv_transfer.sealed_frames import TransferKey
from tests.conftest import wait_until

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, LAYERS = 12, 4, 2, 8, 3


def _key() -> TransferKey:
    return TransferKey(sealed_frames.new_key())


def _caches(
    seed: int | None, dtype=torch.float32, block_size: int = BLOCK_SIZE, num_blocks: int = NUM_BLOCKS
) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, KV_HEADS, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(LAYERS)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_arrive_bit_for_bit_in_the_reserved_blocks(endpoint, dtype):
    key = _key()
    source, destination = _caches(0, dtype), _caches(None, dtype)
    sent, reserved = [7, 2, 9], [0, 5, 11]
    num_bytes, address = endpoint.serve(source, "m-0.rank0", sent, "127.0.0.1", key)
    assert address.startswith("tcp://127.0.0.1:")
    got = kv_network.KVNetworkEndpoint().fetch_into(destination, "m-0.rank0", reserved, address, key)
    assert got == num_bytes
    for src, dst in zip(source, destination):
        assert torch.equal(dst[:, reserved], src[:, sent])
        untouched = [b for b in range(NUM_BLOCKS) if b not in reserved]
        assert not dst[:, untouched].any()
    # Handed out once: a second fetch of the same name is refused.
    with pytest.raises(kv_transfer.KVTransferError, match="offers no K/V blocks"):
        kv_fetch.fetch(address, "m-0.rank0", key, timeout_s=5)
    time.sleep(0.5)  # the fetches' connections closed, and the server's monitor read
    assert not endpoint._server.refusals.counts  # a rightful fetch is no refusal


def _zmq_threads_and_policy(tids: set[int]) -> dict[int, int]:
    out = {}
    for tid in tids:
        try:
            comm = open(f"/proc/self/task/{tid}/comm").read()
            if comm.startswith(("raylm-kv-IO/", "raylm-kv-Reaper")):
                out[tid] = os.sched_getscheduler(tid)
        except OSError:
            pass
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux: per-thread scheduling policies")
def test_the_transfer_threads_yield_to_the_steps(endpoint, monkeypatch):
    """ZMQ's I/O threads move a stage's frames to and from TCP: the
    K/V contexts' threads run as SCHED_BATCH (waking, they do not preempt a
    step) but while a final stage, its request paused, needs them; so does
    the thread that waits for the paced frames to leave. The server's own
    thread, which answers a final stage's request, keeps the steps' policy
    and niceness."""
    urgent = []  # whose threads a final stage asked for, at which policy then
    urgent_begin = kv_background.ThreadsBesideTheSteps.urgent_begin

    def recording_urgent_begin(threads):
        urgent_begin(threads)
        urgent.append({tid: os.sched_getscheduler(tid) for tid in threads.tids})

    monkeypatch.setattr(kv_background.ThreadsBesideTheSteps, "urgent_begin", recording_urgent_begin)
    before = {int(t) for t in os.listdir("/proc/self/task")}
    key = _key()
    _, address = endpoint.serve(_caches(0), "m-6.rank0", [1, 2], "127.0.0.1", key)  # a final stage
    destination = _caches(None)
    kv_network.KVNetworkEndpoint().fetch_into(destination, "m-6.rank0", [4, 7], address, key)
    assert torch.equal(destination[1][:, [4, 7]], _caches(0)[1][:, [1, 2]])
    # The source's I/O threads and the fetch's, at the default policy while they carried it.
    assert len(urgent) == 2 and all(policy == os.SCHED_OTHER for threads in urgent for policy in threads.values())
    new = _zmq_threads_and_policy({int(t) for t in os.listdir("/proc/self/task")} - before)
    assert new
    wait_until(
        lambda: all(policy == os.SCHED_BATCH for policy in _zmq_threads_and_policy(set(new)).values()),
        10,
        message="the final stage's send to end",
    )
    (server_thread,) = [t for t in threading.enumerate() if t.name == "raylm-kv-server"]
    assert os.getpriority(os.PRIO_PROCESS, server_thread.native_id) == os.getpriority(os.PRIO_PROCESS, 0)
    assert os.sched_getscheduler(server_thread.native_id) == os.sched_getscheduler(0)
    (sent_thread,) = [t for t in threading.enumerate() if t.name == "raylm-kv-sent"]
    assert os.sched_getscheduler(sent_thread.native_id) == os.SCHED_BATCH


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_threads_beside_the_steps_go_back_to_the_steps_policy_while_a_final_stage_needs_them():
    ready, done = threading.Event(), threading.Event()
    helper = threading.Thread(target=lambda: (ready.set(), done.wait(10)))
    helper.start()
    ready.wait(10)
    try:
        threads = kv_background.ThreadsBesideTheSteps([helper.native_id])
        assert os.sched_getscheduler(helper.native_id) == os.SCHED_BATCH
        threads.urgent_begin()
        threads.urgent_begin()  # two final stages at once
        assert os.sched_getscheduler(helper.native_id) == os.SCHED_OTHER
        threads.urgent_end()
        assert os.sched_getscheduler(helper.native_id) == os.SCHED_OTHER  # one still needs it
        threads.urgent_end()
        assert os.sched_getscheduler(helper.native_id) == os.SCHED_BATCH
    finally:
        done.set()
        helper.join()


def test_a_client_without_the_key_gets_nothing(endpoint):
    key = _key()
    _, address = endpoint.serve(_caches(0), "m-1.rank0", [1], "127.0.0.1", key)
    stranger = _key()
    # The server admits only connections whose token opens with the supervisor's key: none comes.
    with pytest.raises(kv_transfer.KVTransferError, match="did not send"):
        kv_fetch.fetch(address, "m-1.rank0", stranger, timeout_s=0.5)
    # Nor to the name in the clear, or to a request of another form, from a client with no token.
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:  # without waiting: refused, the connection leaves the socket nowhere to send
        sock.send(b"m-1.rank0", zmq.NOBLOCK)
        sock.send_multipart([b"m-1.rank0", b"m-1.rank0"], zmq.NOBLOCK)
    except zmq.Again:
        pass
    assert not sock.poll(500)
    sock.close()
    refusals = endpoint._server.refusals.counts
    assert refusals["token"] == 1 and endpoint._server.requests_received == 0
    # Each connection refused at its handshake.
    wait_until(lambda: refusals["connection"] >= 2, 10, message=lambda: f"connections refused: {refusals}")
    # The offer is still there for the rightful destination.
    destination = _caches(None)
    kv_network.KVNetworkEndpoint().fetch_into(destination, "m-1.rank0", [3], address, key)
    assert torch.equal(destination[0][:, 3], _caches(0)[0][:, 1])


def _forged_answer(forgery: str, key: TransferKey, request: bytes) -> list[bytes]:
    """What someone posing as the source, or changing its answer on the way,
    sends back to `request`."""
    data = bytes(range(200))
    header = kv_frames._FRAME_META.pack(0, 1)
    if forgery == "junk":
        return [b"ok", header, data + bytes(16)]
    if forgery == "missing, not sealed":
        return [b"missing", b""]
    if forgery == "another request's answer":  # recorded on the wire, played back
        _, other = key.seal_request(b"m-1.rank0")
        return [b"ok", header, other.seal(0, b"ok" + header, data)]
    _, seal = key.open_request(request, sealed_frames.SeenRequests())  # the rightful answer, then changed
    sealed = bytearray(seal.seal(0, b"ok" + header, data))
    if forgery == "a byte changed":
        sealed[100] ^= 1
        return [b"ok", header, bytes(sealed)]
    if forgery == "its index changed":
        return [b"ok", kv_frames._FRAME_META.pack(0, 2), bytes(sealed)]
    raise AssertionError(forgery)


@pytest.mark.parametrize(
    "forgery", ["junk", "missing, not sealed", "another request's answer", "a byte changed", "its index changed"]
)
def test_an_answer_that_does_not_open_with_the_key_fails_the_fetch(forgery):
    """The destination takes nothing that was not sealed for its request by
    a holder of the key: a stranger at the source's address, a recorded
    answer played back, or the rightful answer changed on the way fail the
    fetch (the migration is then abandoned, its request left at the source)."""
    key = _key()
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.setsockopt(zmq.PLAIN_SERVER, 1)
    zap = ctx.socket(zmq.REP)  # a ZAP handler that admits any token
    zap.setsockopt(zmq.LINGER, 0)
    zap.bind("inproc://zeromq.zap.01")
    port = rogue.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        if zap.poll(10_000):
            version, request_id, *_ = zap.recv_multipart()
            zap.send_multipart([version, request_id, b"200", b"", b"", b""])
        if rogue.poll(10_000):
            identity, request = rogue.recv_multipart()
            rogue.send_multipart([identity] + _forged_answer(forgery, key, request))

    answering = threading.Thread(target=answer, daemon=True)
    answering.start()
    try:
        with pytest.raises(kv_transfer.KVTransferError, match="does not open with the transfer key"):
            kv_fetch.fetch(f"tcp://127.0.0.1:{port}", "m-1.rank0", key, timeout_s=10)
    finally:
        answering.join(15)
        rogue.close(linger=0)
        zap.close(linger=0)
        ctx.term()


def _admitted_dealer(address: str, key: TransferKey, token: bytes | None = None) -> zmq.Socket:
    """A client as a destination's fetch makes it, presenting `token` (a fresh one by default)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    kv_admission.SealedAdmission.present(sock, key)
    if token is not None:
        sock.setsockopt(zmq.PLAIN_PASSWORD, token)
    sock.connect(address)
    return sock


def test_a_request_played_back_gets_nothing_it_can_use(endpoint):
    """An offer is handed out once, and a sealed request or admission token
    is taken once: a request recorded on the wire and sent again gets no
    answer at all (a second answer under the first one's key would reuse
    its nonces), and a token played back admits no connection."""
    key = _key()
    _, address = endpoint.serve(_caches(0), "m-1.rank0", [1], "127.0.0.1", key)
    endpoint.serve(_caches(0), "m-2.rank0", [1], "127.0.0.1", key)
    request, seal = key.seal_request(b"m-1.rank0")
    token = key.admission_token()
    sock = _admitted_dealer(address, key, token)
    try:
        sock.send(request)
        assert sock.poll(10_000)
        status, header, sealed = sock.recv_multipart()
        assert status == b"ok"
        index, count = kv_frames._FRAME_META.unpack(header)
        assert seal.open(index, status + header, sealed) == kv_transfer.pack_blocks(_caches(0), [1]).numpy().tobytes()
        sock.send(request)  # played back on an admitted connection
        assert not sock.poll(500)
    finally:
        sock.close()
    refusals = endpoint._server.refusals.counts
    assert refusals["replayed"] == 1
    # The token played back: its connection is refused at the handshake, its request never read.
    replayed = _admitted_dealer(address, key, token)
    try:
        try:
            replayed.send(key.seal_request(b"m-2.rank0")[0], zmq.NOBLOCK)
        except zmq.Again:  # refused already
            pass
        assert not replayed.poll(500)
    finally:
        replayed.close()
    assert refusals["replayed"] == 2
    assert endpoint._server.requests_received == 1
    assert endpoint._server.num_offers == 1  # m-2 is still there for its rightful fetch


def test_withdrawn_offers_and_other_layouts_are_refused(endpoint):
    key = _key()
    _, address = endpoint.serve(_caches(0), "m-2-0.rank0", [1, 2], "127.0.0.1", key)
    endpoint.serve(_caches(0), "m-2-1.rank0", [3], "127.0.0.1", key)
    endpoint.serve(_caches(0), "m-20-0.rank0", [4], "127.0.0.1", key)
    assert endpoint.withdraw("m-2-") == 2  # that migration's offers, not m-20's
    with pytest.raises(kv_transfer.KVTransferError, match="offers no K/V blocks"):
        kv_fetch.fetch(address, "m-2-0.rank0", key, timeout_s=5)
    other_layout = _caches(None, block_size=2 * BLOCK_SIZE)
    with pytest.raises(kv_transfer.KVTransferError, match="KV layouts differ"):
        kv_network.KVNetworkEndpoint().fetch_into(other_layout, "m-20-0.rank0", [0], address, key)
    endpoint.serve(_caches(0), "m-3.rank0", [1, 2], "127.0.0.1", key)
    with pytest.raises(kv_transfer.KVTransferError, match="holds 2 blocks, 1 were reserved"):
        kv_network.KVNetworkEndpoint().fetch_into(_caches(None), "m-3.rank0", [0], address, key)


def test_a_stage_in_more_frames_than_its_blocks_fill_is_refused_at_its_first(endpoint, monkeypatch):
    """The frame count is the source's word: more frames than the reserved
    blocks' bytes fill is refused before a buffer is taken for them."""
    monkeypatch.setattr(kv_frames, "_FRAME_BYTES", 1000)
    key = _key()
    _, address = endpoint.serve(_caches(0), "m-12.rank0", [1, 2, 3], "127.0.0.1", key)
    kept = kv_fetch._joined_stages.num_kept
    with pytest.raises(kv_transfer.KVTransferError, match="more than the .* bytes of the blocks reserved"):
        kv_network.KVNetworkEndpoint().fetch_into(_caches(None), "m-12.rank0", [0], address, key)
    assert kv_fetch._joined_stages.num_kept == kept
    endpoint.serve(_caches(0), "m-13.rank0", [1], "127.0.0.1", key)
    with pytest.raises(kv_transfer.KVTransferError, match="no KV cache"):
        kv_network.KVNetworkEndpoint().fetch_into([], "m-13.rank0", [0], address, key)


def test_packed_blocks_equal_the_transfer_file(tmp_path):
    """One format both ways: a file export and an in-memory pack hold the same bytes."""
    source = _caches(1)
    path = str(tmp_path / "stage.rank0")
    kv_transfer.export_blocks(source, [4, 0], path)
    with open(path, "rb") as f:
        exported = f.read()
    assert exported == kv_transfer.pack_blocks(source, [4, 0]).numpy().tobytes()
    # Packed into a used buffer larger than the stage: its start, every old byte overwritten.
    used = torch.full((len(exported) + 999,), 0xAB, dtype=torch.uint8)
    packed = kv_transfer.pack_blocks(source, [4, 0], into=used)
    assert packed.data_ptr() == used.data_ptr() and packed.numpy().tobytes() == exported
    with pytest.raises(ValueError, match="cannot pack"):
        kv_transfer.pack_blocks(source, [4, 0], into=used[:100])


def _assert_arrives(source, name: str, sent: list[int], address: str, key: TransferKey) -> None:
    destination = _caches(None)
    reserved = list(range(len(sent)))
    kv_network.KVNetworkEndpoint().fetch_into(destination, name, reserved, address, key)
    assert all(torch.equal(d[:, reserved], s[:, sent]) for s, d in zip(source, destination))


def test_a_pool_keeps_at_most_its_count_and_bytes_the_larger_buffers_first(monkeypatch):
    """A rank keeps its pools as long as it lives: past either limit a
    buffer given back takes the place of smaller free ones, or is not kept;
    one still being sent is never dropped."""
    monkeypatch.setattr(kv_frames.StageBuffers, "MAX_BUFFERS", 3)
    monkeypatch.setattr(kv_frames.StageBuffers, "MAX_KEPT_BYTES", 1000)
    pool = kv_frames.StageBuffers()

    def kept() -> list[int]:
        return sorted(buffer.numel() for buffer, _ in pool._kept)

    class Sending:
        done = False

    for size in (100, 200, 300):
        pool.give_back(torch.empty(size, dtype=torch.uint8))
    pool.give_back(torch.empty(50, dtype=torch.uint8))  # three kept, none smaller
    assert kept() == [100, 200, 300]
    pool.give_back(torch.empty(600, dtype=torch.uint8))  # 1200 bytes: the 100 and the 200 make room
    assert kept() == [300, 600]
    pool.give_back(torch.empty(400, dtype=torch.uint8), Sending())  # over the bytes, the 300 goes
    assert kept() == [400, 600]
    pool.give_back(torch.empty(500, dtype=torch.uint8))  # only the 400 is smaller, and it is being sent
    assert kept() == [400, 600]
    assert pool.take(450).numel() == 600 and kept() == [400]


def test_a_sent_stage_lends_its_buffer_to_the_next(endpoint):
    """A source packs each stage into a buffer of its pool and seals it into
    another, each used again once ZMQ has sent it (a fresh one is paged in a
    fault at a time, on cores that step); an offer not yet sent keeps its
    own, and the bytes arrive exact."""
    key = _key()
    source = _caches(8)
    _, address = endpoint.serve(source, "m-1.rank0", [1, 2, 3], "127.0.0.1", key)
    server = endpoint._server
    first = server._offers[b"m-1.rank0"][2]
    endpoint.serve(source, "m-2.rank0", [4, 5], "127.0.0.1", key)
    second = server._offers[b"m-2.rank0"][2]
    assert first.data_ptr() != second.data_ptr()  # the first is not sent yet
    _assert_arrives(source, "m-1.rank0", [1, 2, 3], address, key)
    _assert_arrives(source, "m-2.rank0", [4, 5], address, key)
    wait_until(
        lambda: server.buffers.num_kept == 3 and all(t is None or t.done for _, t in server.buffers._kept),
        within_s=10,
        message="both sends done, each stage's packed and sealed buffers kept",
    )
    # The smallest buffer that fits packs the next stage (its old bytes overwritten).
    endpoint.serve(source, "m-3.rank0", [6], "127.0.0.1", key)
    assert server._offers[b"m-3.rank0"][2].data_ptr() == second.data_ptr()
    _assert_arrives(source, "m-3.rank0", [6], address, key)
    # A stage larger than every kept buffer gets a new one.
    endpoint.serve(source, "m-4.rank0", [0, 1, 2, 3, 4], "127.0.0.1", key)
    assert server._offers[b"m-4.rank0"][2].data_ptr() not in (first.data_ptr(), second.data_ptr())
    assert endpoint.withdraw("m-4") == 1


def test_a_stage_travels_in_frames_joined_exactly_at_the_destination(endpoint, monkeypatch):
    """A stage goes in frames of at most _FRAME_BYTES, each sealed on its
    own, and the destination opens them into a kept buffer."""
    monkeypatch.setattr(kv_frames, "_FRAME_BYTES", 1000)
    key = _key()
    source = _caches(10, torch.bfloat16)
    num_bytes, address = endpoint.serve(source, "m-6.rank0", [7, 2, 9], "127.0.0.1", key)
    frames = kv_fetch.fetch(address, "m-6.rank0", key, timeout_s=5)
    assert [len(f) for f in frames] == [1000] * (num_bytes // 1000) + [num_bytes % 1000]
    assert b"".join(frames) == kv_transfer.pack_blocks(source, [7, 2, 9]).numpy().tobytes()
    for name, sent in (("m-7.rank0", [1, 0, 11]), ("m-8.rank0", [5, 6])):
        endpoint.serve(source, name, sent, "127.0.0.1", key)
        destination = _caches(None, torch.bfloat16)
        kv_network.KVNetworkEndpoint().fetch_into(destination, name, [3, 4, 8][: len(sent)], address, key)
        assert all(torch.equal(d[:, [3, 4, 8][: len(sent)]], s[:, sent]) for s, d in zip(source, destination))
        assert kv_fetch._joined_stages.num_kept >= 1  # the join's buffer, kept for the next stage


def _packed_at_once(fn, *args) -> Future:
    future = Future()
    future.set_result(fn(*args))
    return future


def test_a_pre_copy_stage_is_paced_and_a_final_stage_goes_between_its_frames(monkeypatch):
    """A stage packed beside the steps goes a frame at a time, each once the
    last has been sent and the copy budget allows: the server's sealing and
    sending (its thread's and its I/O threads' CPU, counted in the budget)
    take no more than the budget's share of the time the stage takes. A
    final stage, whose request is paused, is answered between its frames."""
    monkeypatch.setattr(kv_frames, "_FRAME_BYTES", 256 << 10)
    share = 0.01
    budget = kv_background.CopyBudget(share=share)
    endpoint = kv_network.KVNetworkEndpoint(budget)
    key = _key()
    source = _caches(11, num_blocks=2048)  # 3 MiB, 12 frames
    try:
        started = time.monotonic()
        num_bytes, address = endpoint.serve(
            source, "m-9-0.rank0", list(range(2048)), "127.0.0.1", key, run_in_background=_packed_at_once
        )
        first_frame, done_at = threading.Event(), {}

        def fetch_pre_copy() -> None:
            frames = []

            def into(index, count, size):
                frames.append(bytearray(size))
                first_frame.set()
                return memoryview(frames[-1])

            kv_fetch.fetch(address, "m-9-0.rank0", key, into=into)
            done_at["pre-copy"] = time.monotonic()
            assert b"".join(frames) == kv_transfer.pack_blocks(source, list(range(2048))).numpy().tobytes()

        pre_copy = threading.Thread(target=fetch_pre_copy)
        pre_copy.start()
        assert first_frame.wait(30)
        endpoint.serve(source, "m-10-1.rank0", [7], "127.0.0.1", key)
        _assert_arrives(source, "m-10-1.rank0", [7], address, key)
        done_at["final"] = time.monotonic()
        pre_copy.join(60)
        assert "pre-copy" in done_at and done_at["final"] < done_at["pre-copy"]
        assert budget.spent_s > 0
        # Within the share, less the bursts it allows (and the last frame's, paid after).
        assert budget.spent_s - 2 * budget.burst_s <= share * (done_at["pre-copy"] - started) * 1.1
    finally:
        endpoint.close()


def test_a_paced_fetch_takes_in_no_more_than_it_reads(endpoint):
    """A destination's reading paced by its budget paces its I/O thread too:
    while its pause holds it after the first frame, libzmq's I/O thread
    takes in at most the few messages its socket's queue holds, not the
    stage (the source waits on TCP meanwhile)."""
    key = _key()
    source = _caches(12, num_blocks=16384)  # 24 MiB, 24 frames
    num_bytes, address = endpoint.serve(source, "m-11.rank0", list(range(16384)), "127.0.0.1", key)
    kv_fetch._fetch_zmq_context()
    io_threads = list(kv_fetch._fetch_threads.tids)

    def receiving_cpu_s() -> float:
        return sum(thread_accounting.thread_cpu_s(tid) or 0.0 for tid in io_threads)

    cpu_at = {}

    def pause() -> None:
        if "first" not in cpu_at:
            cpu_at["first"] = receiving_cpu_s()
            time.sleep(1.0)  # the destination's budget holds its reading
            cpu_at["held"] = receiving_cpu_s()

    frames = kv_fetch.fetch(address, "m-11.rank0", key, pause=pause)
    spent = receiving_cpu_s() - cpu_at["first"]
    assert b"".join(frames) == kv_transfer.pack_blocks(source, list(range(16384))).numpy().tobytes()
    assert spent > 0
    # Held a second: a few frames of the 24 taken in meanwhile, at most (the
    # stage in all, were its intake not held). The first frames cost more
    # than their share, libzmq's messages landing on pages glibc has just
    # mapped: held, 0.1-0.3 of the whole.
    assert cpu_at["held"] - cpu_at["first"] <= 0.5 * spent


def _context_switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        return sum(int(line.split()[1]) for line in f if line.split(":")[0].endswith("ctxt_switches"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux: per-thread context switches")
def test_the_server_sleeps_while_a_paced_frame_waits_for_its_destination():
    """While a destination holds its reading (its budget pauses it), the
    source's server thread sleeps until the frame it sent last has gone: a
    thread waking beside the steps takes a core from them where none is
    spare (it used to look every 1-10 ms, hundreds of times a stage)."""
    endpoint = kv_network.KVNetworkEndpoint(kv_background.CopyBudget(share=1.0))
    key = _key()
    source = _caches(13, num_blocks=16384)  # 24 MiB, 24 frames
    try:
        _, address = endpoint.serve(
            source, "m-12-0.rank0", list(range(16384)), "127.0.0.1", key, run_in_background=_packed_at_once
        )
        (server,) = [t for t in threading.enumerate() if t.name == "raylm-kv-server"]
        switches = {}

        def pause() -> None:
            if not switches:
                time.sleep(0.5)  # the source sends what TCP's buffers take, then waits
                switches["held"] = _context_switches(server.native_id)
                time.sleep(1.0)
                switches["later"] = _context_switches(server.native_id)

        frames = kv_fetch.fetch(address, "m-12-0.rank0", key, pause=pause)
        assert b"".join(frames) == kv_transfer.pack_blocks(source, list(range(16384))).numpy().tobytes()
        # A second held: the server looked whether its send had stalled once, not every few ms.
        assert switches["later"] - switches["held"] <= 3, switches
    finally:
        endpoint.close()


def test_a_buffer_withdrawn_while_packing_is_kept_only_once_packed(endpoint):
    key = _key()
    source = _caches(9)
    packing, release = threading.Event(), threading.Event()

    def slow_background(fn, *args) -> Future:
        future = Future()

        def run() -> None:
            packing.set()
            release.wait(30)
            future.set_result(fn(*args))

        threading.Thread(target=run, daemon=True).start()
        return future

    endpoint.serve(source, "m-5.rank0", [1, 2], "127.0.0.1", key, run_in_background=slow_background)
    assert packing.wait(10)
    assert endpoint.withdraw("m-5") == 1
    assert endpoint._server.buffers.num_kept == 0  # still written to: nobody may take it
    release.set()
    wait_until(lambda: endpoint._server.buffers.num_kept == 1, within_s=10, message="the buffer kept once packed")


def test_an_import_waits_for_the_file_its_source_is_still_filling(tmp_path):
    """The overlapped pre-copy: the source's thread gathers into a file whose
    header it writes last; the destination's thread waits for that header."""
    source, destination = _caches(2), _caches(None)
    path = str(tmp_path / "stage.rank0")
    kv_transfer.create_file(source, 2, path)
    filler = threading.Timer(0.2, kv_transfer.fill_file, args=(source, [5, 6], path))
    filler.start()
    kv_transfer.import_blocks(destination, [1, 2], path, wait_s=30)
    filler.join()
    assert all(torch.equal(d[:, [1, 2]], s[:, [5, 6]]) for s, d in zip(source, destination))
    # Without waiting, a blank header is refused.
    kv_transfer.create_file(source, 1, path + "b")
    with pytest.raises(kv_transfer.KVTransferError, match="no valid header"):
        kv_transfer.import_blocks(destination, [0], path + "b")


def test_a_transfer_file_is_filled_again_once_its_transfer_is_over(tmp_path):
    """A source keeps the files it made (their pages stay allocated) and fills
    one again under the next transfer's name once the last one's name is gone;
    a file whose transfer still holds its name is never reused, and a reused
    file's header is blank until it is filled (its last contents are never read)."""
    source, destination = _caches(3), _caches(None)
    first = str(tmp_path / "m1-0.rank0")
    kv_transfer.export_blocks(source, [1, 2, 3], first)
    inode = os.stat(first).st_ino
    # The first transfer still holds its name: the next gets a file of its own.
    second = str(tmp_path / "m2-0.rank0")
    kv_transfer.export_blocks(source, [4], second)
    assert os.stat(second).st_ino != inode
    os.unlink(first)  # as the supervisor does at the migration's end
    third = str(tmp_path / "m3-0.rank0")
    kv_transfer.create_file(source, 2, third)
    assert os.stat(third).st_ino == inode
    assert os.path.getsize(third) == kv_transfer.packed_size(source, 2)
    with pytest.raises(kv_transfer.KVTransferError, match="no valid header"):
        kv_transfer.import_blocks(destination, [0, 1], third)
    kv_transfer.fill_file(source, [7, 5], third)
    kv_transfer.import_blocks(destination, [0, 1], third)
    assert all(torch.equal(d[:, [0, 1]], s[:, [7, 5]]) for s, d in zip(source, destination))
    # At most two kept per folder: a third concurrent transfer's file is not kept.
    fourth = str(tmp_path / "m4-0.rank0")
    kv_transfer.export_blocks(source, [0], fourth)
    assert os.stat(fourth).st_nlink == 1
    assert sorted(p.name.split("-", 2)[2] for p in tmp_path.glob("spare-*")) == ["m1-0.rank0", "m2-0.rank0"]


def test_a_file_being_filled_is_not_handed_out_even_once_its_transfer_is_withdrawn(tmp_path, monkeypatch):
    """A transfer withdrawn (its name unlinked) while its fill runs: the fill
    may still be writing into the file, so the next transfer gets another."""
    source = _caches(6)
    first = str(tmp_path / "m1-0.rank0")
    kv_transfer.create_file(source, 2, first)
    inode = os.stat(first).st_ino
    gathering, release = threading.Event(), threading.Event()
    real_copy = kv_transfer._copy_blocks

    def slow_copy(*args):
        gathering.set()
        release.wait(30)
        real_copy(*args)

    monkeypatch.setattr(kv_transfer, "_copy_blocks", slow_copy)
    outcome = []

    def fill() -> None:
        try:
            kv_transfer.fill_file(source, [1, 2], first)
        except FileNotFoundError as e:  # its header has no name to go to any more
            outcome.append(e)

    filler = threading.Thread(target=fill)
    filler.start()
    assert gathering.wait(30)
    os.unlink(first)  # withdrawn mid-fill
    second = str(tmp_path / "m2-0.rank0")
    kv_transfer.create_file(source, 2, second)
    assert os.stat(second).st_ino != inode
    release.set()
    filler.join(30)
    assert len(outcome) == 1, "the withdrawn fill ends in an error, as before"
    os.unlink(second)
    third = str(tmp_path / "m3-0.rank0")  # the fill is over: now it may be reused
    kv_transfer.create_file(source, 2, third)
    assert os.stat(third).st_ino == inode


def test_a_large_transfer_file_is_not_kept(tmp_path, monkeypatch):
    """A long request's first stage can be large: its pages are not held on to."""
    source = _caches(5)
    monkeypatch.setattr(kv_transfer._SpareFiles, "_MAX_SPARE_BYTES", kv_transfer.packed_size(source, 2))
    large = str(tmp_path / "m1-0.rank0")
    kv_transfer.export_blocks(source, [1, 2, 3], large)
    assert os.stat(large).st_nlink == 1
    small = str(tmp_path / "m2-0.rank0")
    kv_transfer.export_blocks(source, [1, 2], small)
    assert os.stat(small).st_nlink == 2  # kept
    os.unlink(small)
    # Not handed out for a transfer larger than the limit either.
    again = str(tmp_path / "m3-0.rank0")
    kv_transfer.create_file(source, 3, again)
    assert os.stat(again).st_nlink == 1


def test_kept_files_go_with_their_folder(tmp_path):
    source = _caches(4)
    folder = tmp_path / "engine"
    folder.mkdir()
    kv_transfer.export_blocks(source, [1], str(folder / "m1-0.rank0"))
    shutil.rmtree(folder)  # the supervisor removes its folder at shutdown
    folder.mkdir()
    path = str(folder / "m1-0.rank0")
    kv_transfer.export_blocks(source, [2], path)
    destination = _caches(None)
    kv_transfer.import_blocks(destination, [0], path)
    assert all(torch.equal(d[:, 0], s[:, 2]) for s, d in zip(source, destination))


def test_a_failed_gather_is_named_at_the_destination(tmp_path):
    source = _caches(2)
    path = str(tmp_path / "stage.rank0")
    kv_transfer.create_file(source, 1, path)
    with pytest.raises(kv_transfer.KVTransferError, match="block 17 is out of bounds"):
        kv_transfer.fill_file(source, [NUM_BLOCKS + 5], path)  # no such block
    with pytest.raises(kv_transfer.KVTransferError, match="could not export.*block 17 is out of bounds"):
        kv_transfer.import_blocks(_caches(None), [0], path, wait_s=30)
    # Nor below: a negative id would count from the cache's end.
    kv_transfer.create_file(source, 1, path + "b")
    with pytest.raises(kv_transfer.KVTransferError, match="block -1 is out of bounds"):
        kv_transfer.fill_file(source, [-1], path + "b")


class KVSocketStranger(threading.Thread):
    """Hammers a K/V socket until told to stop, as someone on the network
    without the supervisor's key could: raw TCP connections that send junk
    or nothing at all, and ZMQ clients asking for the offers by name in the
    clear, sealed with a key of their own, or in a message larger than any
    request. `rounds` counts the rounds done, `answers` whatever any of
    them got back (a ZMQ reply, never expected)."""

    def __init__(self, address: str, names: list[str]):
        super().__init__(name="kv-stranger", daemon=True)
        self.address, self.names = address, names
        self.rounds = 0
        self.answers: list = []
        self.stop = threading.Event()

    def run(self) -> None:
        host, port = self.address.removeprefix("tcp://").rsplit(":", 1)
        ctx = zmq.Context()
        own_key = _key()
        try:
            while not self.stop.is_set():
                with socket.create_connection((host, int(port)), timeout=2) as raw:
                    raw.sendall(bytes(range(256)) * 4)  # not a ZMTP greeting
                clients = []
                for ask in (
                    lambda name: name,
                    lambda name: own_key.seal_request(name)[0],
                    lambda name: name * (kv_frames._MAX_REQUEST_BYTES // len(name) + 1),
                ):
                    client = ctx.socket(zmq.DEALER)
                    client.setsockopt(zmq.LINGER, 0)
                    client.connect(self.address)
                    for name in self.names:
                        client.send(ask(name.encode()), flags=zmq.NOBLOCK)
                    clients.append(client)
                for client in clients:
                    if client.poll(50):
                        self.answers.append(client.recv_multipart())
                    client.close(linger=0)
                self.rounds += 1
        finally:
            ctx.term()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_strangers_reach_nothing_and_hold_nothing(endpoint):
    """A flood of strangers at the K/V socket: none gets an answer or has an
    offer handed out, the rightful destination still fetches its blocks
    meanwhile, and once the flood stops every connection it made is gone."""
    key = _key()
    names = [f"m-9-{i}.rank0" for i in range(3)]
    _, address = endpoint.serve(_caches(0), names[0], [1, 2], "127.0.0.1", key)
    fds_before = _open_fds()
    stranger = KVSocketStranger(address, names)
    stranger.start()
    try:
        for i, name in enumerate(names):
            if i:
                endpoint.serve(_caches(0), name, [1, 2], "127.0.0.1", key)
            # Each fetch while the flood goes on: a hang guard, not a speed check.
            wait_until(lambda i=i: stranger.rounds >= 3 * (i + 1), 60, message="the stranger's rounds")
            destination = _caches(None)
            kv_network.KVNetworkEndpoint().fetch_into(destination, name, [4, 7], address, key)
            assert torch.equal(destination[1][:, [4, 7]], _caches(0)[1][:, [1, 2]])
    finally:
        stranger.stop.set()
        stranger.join(30)
    assert not stranger.is_alive()
    assert stranger.answers == []
    assert endpoint._server.requests_received == len(names)  # the rightful fetches only
    refusals = endpoint._server.refusals.counts
    wait_until(
        lambda: refusals["connection"] >= 4 * stranger.rounds,
        30,  # refused at their handshakes
        message=lambda: f"{4 * stranger.rounds} connections refused: {refusals}",
    )
    wait_until(lambda: _open_fds() <= fds_before, 30, message=lambda: f"fds back to {fds_before}: {_open_fds()}")


def test_a_connection_that_never_finishes_its_handshake_is_dropped(monkeypatch):
    """A stranger who connects and stays silent does not keep the connection
    (and a file descriptor of the rank's process) beyond the handshake timeout."""
    monkeypatch.setattr(kv_admission, "_HANDSHAKE_TIMEOUT_MS", 300)
    ep = kv_network.KVNetworkEndpoint()
    try:
        _, address = ep.serve(_caches(0), "m-10.rank0", [1], "127.0.0.1", _key())
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as silent:
            received = b""
            while True:  # the server's greeting, then the end of the connection
                chunk = silent.recv(4096)
                if not chunk:
                    break
                received += chunk
        assert len(received) < 4096
    finally:
        ep.close()
