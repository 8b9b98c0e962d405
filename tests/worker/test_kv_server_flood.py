"""Strangers against a rank's K/V server (raylm.kv_transfer.network), at the
transport: an endless multipart message grows nothing and its sender is
dropped, idle connections are closed and their file descriptors come back,
a flood of junk is refused and counted apart from the copies (their CPU
budget is not charged for it) while a rightful fetch goes on, an admitted
peer that stops answering heartbeats is dropped, and the server goes on
after a fault of its own. Counts and structure are asserted, not timings.

The strangers speak raw TCP, some of it ZMTP 3 (greeting, commands and
frames, as rfc.zeromq.org/spec/23 lays them out), so that each can stop
halfway through a handshake or send what no ZMQ socket would."""

from __future__ import annotations

import gc
import os
import socket
import struct
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
from raylm.kv_transfer import server as kv_server
from raylm.kv_transfer import stage_send as kv_stage_send
from raylm.kv_transfer.sealed_frames import TransferKey
from tests.conftest import wait_until

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 2, 64, 16


def _caches(seed: int | None, num_blocks: int = 8) -> list[torch.Tensor]:
    shape = (2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(LAYERS)]


def _key() -> TransferKey:
    return TransferKey(sealed_frames.new_key())


@pytest.fixture
def endpoint():
    ep = kv_network.KVNetworkEndpoint()
    yield ep
    ep.close()
    left = [t.name for t in threading.enumerate() if t.name in ("raylm-kv-server", "raylm-kv-sent", "raylm-kv-admit")]
    assert not left, f"the server's threads live on: {left}"


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


# ZMTP 3.0, as much of it as a stranger needs.


def _greeting(mechanism: bytes) -> bytes:
    """Signature, version 3.0, mechanism, as-server 0, filler: 64 bytes."""
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + b"\0" + bytes(31)


def _command(name: bytes, body: bytes) -> bytes:
    payload = bytes([len(name)]) + name + body
    if len(payload) <= 255:
        return bytes([0x04, len(payload)]) + payload
    return b"\x06" + struct.pack(">Q", len(payload)) + payload


def _metadata(**properties: bytes) -> bytes:
    return b"".join(
        bytes([len(name)]) + name.replace("_", "-").encode() + struct.pack(">I", len(value)) + value
        for name, value in properties.items()
    )


def _ready(socket_type: bytes = b"DEALER") -> bytes:
    return _command(b"READY", _metadata(Socket_Type=socket_type))


def _hello(user: bytes, password: bytes) -> bytes:
    return _command(b"HELLO", bytes([len(user)]) + user + bytes([len(password)]) + password)


def _message_part(data: bytes, more: bool) -> bytes:
    flags = 0x02 | (0x01 if more else 0)  # a long frame: 8-byte size
    return bytes([flags]) + struct.pack(">Q", len(data)) + data


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def _read_frame(sock: socket.socket) -> tuple[int, bytes]:
    flags = _read_exactly(sock, 1)[0]
    size = struct.unpack(">Q", _read_exactly(sock, 8))[0] if flags & 0x02 else _read_exactly(sock, 1)[0]
    return flags, _read_exactly(sock, size)


def _closed_by_the_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes `sock` within `within_s` (what it sends meanwhile is read and dropped)."""
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("mechanism", [b"NULL", b"PLAIN"])
def test_an_endless_multipart_message_grows_nothing_and_its_sender_is_dropped(endpoint, mechanism):
    """10^5 parts of 1 KiB, never a last one: libzmq keeps a message until
    its last part comes and bounds a queue by whole messages, so a
    stranger whose connection were taken in would grow the rank by 100 MiB
    (and on, to the OOM killer). It is not: a NULL peer, or a PLAIN one
    with a forged token, is closed at its handshake, before any part."""
    _, address = endpoint.serve(_caches(0), "m-1.rank0", [1], "127.0.0.1", _key())
    gc.collect()
    rss_before = _rss_mib()
    part = b"".join(_message_part(bytes(1024), more=True) for _ in range(64))  # 64 parts a write
    sent_parts, dropped = 0, False
    with socket.create_connection(_host_port(address), timeout=5) as attacker:
        handshake = _ready() if mechanism == b"NULL" else _hello(kv_admission._ADMISSION_USER, os.urandom(36))
        deadline = time.monotonic() + 10
        try:
            attacker.sendall(_greeting(mechanism))
            _read_exactly(attacker, 64)  # the server's greeting, as a ZMQ peer waits for it
            attacker.sendall(handshake)
            while sent_parts < 100_000 and time.monotonic() < deadline:
                attacker.sendall(part)
                sent_parts += 64
        except ConnectionError:  # reset, or closed (a broken pipe; before its greeting's end)
            dropped = True
        except TimeoutError:  # the server stopped reading without closing
            pass
        dropped = dropped or _closed_by_the_server(attacker, 5)
    grown = _rss_mib() - rss_before
    assert dropped, f"the attacker sent {sent_parts} parts and is still connected"
    assert grown < 64, f"the rank grew {grown:.0f} MiB under {sent_parts} parts of 1 KiB"
    refusals = endpoint._server.refusals.counts
    wait_until(lambda: refusals["connection"] >= 1, 10, message=lambda: f"the refusal counted: {refusals}")
    if mechanism == b"PLAIN":
        assert refusals["token"] == 1  # its handshake reached the admission, which refused the token


def test_idle_connections_are_closed_and_their_descriptors_come_back(monkeypatch):
    """200 connections that go idle, half before their handshake (silent
    since they connected), half after a whole NULL handshake (which a NULL
    server finishes, and then held each for as long as the stranger
    liked): each is closed within the handshake timeout, and the rank's
    file descriptors are back where they were."""
    monkeypatch.setattr(kv_admission, "_HANDSHAKE_TIMEOUT_MS", 500)
    endpoint = kv_network.KVNetworkEndpoint()
    try:
        _, address = endpoint.serve(_caches(0), "m-1.rank0", [1], "127.0.0.1", _key())
        fds_before = _open_fds()
        idle = []
        for i in range(200):
            conn = socket.create_connection(_host_port(address), timeout=5)
            if i % 2:
                conn.sendall(_greeting(b"NULL") + _ready())
            idle.append(conn)
        deadline = time.monotonic() + 10  # for all of them: a few handshake timeouts
        try:
            still_open = [
                i
                for i, conn in enumerate(idle)
                if not _closed_by_the_server(conn, max(0.01, deadline - time.monotonic()))
            ]
        finally:
            for conn in idle:
                conn.close()
        assert not still_open, f"{len(still_open)} idle connections still open, e.g. #{still_open[:5]}"
        wait_until(
            lambda: _open_fds() <= fds_before, 10, message=lambda: f"the fds back to {fds_before}: {_open_fds()}"
        )
        refusals = endpoint._server.refusals.counts
        wait_until(lambda: refusals["connection"] >= 200, 10, message=lambda: f"200 refusals counted: {refusals}")
    finally:
        endpoint.close()


def _admitted_raw(address: str, key: TransferKey) -> socket.socket:
    """A connection admitted with a fresh token (a PLAIN handshake to its
    end), which then answers nothing: a destination whose host froze."""
    conn = socket.create_connection(_host_port(address), timeout=5)
    conn.sendall(_greeting(b"PLAIN") + _hello(kv_admission._ADMISSION_USER, key.admission_token()))
    greeting = _read_exactly(conn, 64)
    assert greeting[12:32].rstrip(b"\0") == b"PLAIN"
    flags, welcome = _read_frame(conn)
    assert flags & 0x04 and welcome.startswith(b"\x07WELCOME"), welcome
    conn.sendall(_command(b"INITIATE", _metadata(Socket_Type=b"DEALER")))
    flags, ready = _read_frame(conn)
    assert flags & 0x04 and ready.startswith(b"\x05READY"), ready
    return conn


def test_an_admitted_peer_that_stops_answering_heartbeats_is_dropped(monkeypatch):
    monkeypatch.setattr(kv_admission, "_HEARTBEAT_IVL_MS", 100)
    monkeypatch.setattr(kv_admission, "_HEARTBEAT_TIMEOUT_MS", 500)
    endpoint = kv_network.KVNetworkEndpoint()
    key = _key()
    try:
        _, address = endpoint.serve(_caches(0), "m-1.rank0", [1], "127.0.0.1", key)
        fds_before = _open_fds()
        with _admitted_raw(address, key) as frozen:
            pings = 0
            frozen.settimeout(10)
            try:
                while True:
                    flags, body = _read_frame(frozen)
                    pings += body.startswith(b"\x04PING")
            except (ConnectionError, TimeoutError):
                pass
            assert pings >= 1
            assert _closed_by_the_server(frozen, 0.1)
        wait_until(
            lambda: _open_fds() <= fds_before, 10, message=lambda: f"the fds back to {fds_before}: {_open_fds()}"
        )
    finally:
        endpoint.close()


class _Junk(threading.Thread):
    """Junk at up to `rate` a second for `seconds`, each a connection of its
    own, by turns: bytes that are no ZMTP, a NULL handshake and a message
    of junk, a PLAIN handshake with a forged token and a message."""

    def __init__(self, address: str, rate: float, seconds: float):
        super().__init__(name="kv-junk", daemon=True)
        self.address, self.rate, self.seconds = _host_port(address), rate, seconds
        self.sent = 0

    def run(self) -> None:
        junk = [
            bytes(range(256)) * 4,
            _greeting(b"NULL") + _ready() + _message_part(b"m-1.rank0", more=False),
            _greeting(b"PLAIN")
            + _hello(kv_admission._ADMISSION_USER, os.urandom(36))
            + _message_part(b"m-1.rank0", more=False),
        ]
        started = time.monotonic()
        while (now := time.monotonic()) - started < self.seconds:
            if self.sent > self.rate * (now - started):
                time.sleep(0.001)
                continue
            try:
                with socket.create_connection(self.address, timeout=2) as conn:
                    conn.sendall(junk[self.sent % len(junk)])
            except OSError:
                pass
            self.sent += 1


def _packed_at_once(fn, *args) -> Future:
    future = Future()
    future.set_result(fn(*args))
    return future


def test_junk_is_refused_and_counted_apart_from_the_copies_while_a_rightful_fetch_goes_on():
    """Junk at ~2k connections a second for 2 s while a destination fetches
    a paced stage: the fetch gets its bytes, every junk connection is
    refused and counted, and the copy budget is charged for the server's
    own threads and for the frames sent, not for the refusals (its I/O
    threads, which accept and close each stranger's connection, 6-11% of a
    core here, were charged all of it: three to five times the copies'
    share, so that every pre-copy stalled)."""
    budget = kv_background.CopyBudget(share=0.5)  # counts; hardly paces
    endpoint = kv_network.KVNetworkEndpoint(budget)
    key = _key()
    source = _caches(3, num_blocks=128)  # 4 MiB: 4 frames
    try:
        num_bytes, address = endpoint.serve(
            source, "m-1-0.rank0", list(range(128)), "127.0.0.1", key, run_in_background=_packed_at_once
        )
        # An offer nobody fetches keeps the server listening after the fetch
        # (it stops once it holds none): all the junk meets it.
        assert endpoint.serve(_caches(0), "m-2.rank0", [1], "127.0.0.1", key)[1] == address
        server = endpoint._server
        own = [server._thread.native_id, server._sent_frames._thread.native_id]

        def own_cpu_s() -> float:
            return sum(thread_accounting.thread_cpu_s(tid) or 0.0 for tid in own)

        budget.wait_s()  # settled: what follows is the flood's and the fetch's
        charged_before, own_before = budget.spent_s, own_cpu_s()
        junk = _Junk(address, rate=2000, seconds=2)
        junk.start()
        wait_until(lambda: junk.sent >= 100, 10, message="the junk to start")
        destination = _caches(None, num_blocks=128)
        got = kv_network.KVNetworkEndpoint().fetch_into(destination, "m-1-0.rank0", list(range(128)), address, key)
        assert got == num_bytes
        assert all(torch.equal(s, d) for s, d in zip(source, destination))
        junk.join(30)
        assert junk.sent >= 500  # a hang guard: what the machine manages of 4000, at least
        time.sleep(0.5)  # the last junk's connections closed
        budget.wait_s()
        charged = budget.spent_s - charged_before
        allowed_io = kv_stage_send._SEND_CPU_PER_MIB_S * num_bytes / (1 << 20)
        assert charged <= own_cpu_s() - own_before + allowed_io + 0.002, (
            f"charged {1e3 * charged:.1f} ms; the server's own threads took {1e3 * (own_cpu_s() - own_before):.1f},"
            f" its frames allowed {1e3 * allowed_io:.1f}"
        )
        refusals = server.refusals.counts
        wait_until(
            lambda: refusals["connection"] >= junk.sent,
            30,
            message=lambda: f"{junk.sent} junk connections counted: {refusals}",
        )
        assert refusals["token"] >= junk.sent // 3 - 1  # the PLAIN ones reached the admission
        assert server.requests_received == 1
        assert server.refusal_cpu_s > 0
    finally:
        endpoint.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the SystemExit, on purpose
def test_the_server_goes_on_after_a_fault_and_is_started_again_if_its_thread_ends(endpoint, monkeypatch, caplog):
    monkeypatch.setattr(kv_frames, "_FAULT_PAUSE_S", 0.05)
    key = _key()
    _, address = endpoint.serve(_caches(0), "m-1.rank0", [1], "127.0.0.1", key)
    server = endpoint._server
    answer = kv_server.KVBlockServer._answer
    faults = [RuntimeError("a bug")]

    def failing_answer(self, sends):
        if faults:
            self._sock.recv_multipart()  # the request taken, then a fault in answering it
            raise faults.pop(0)
        return answer(self, sends)

    monkeypatch.setattr(kv_server.KVBlockServer, "_answer", failing_answer)
    # A fault: logged, and the server serves again (the request it was answering is lost).
    with pytest.raises(kv_transfer.KVTransferError, match="did not send"):
        kv_fetch.fetch(address, "m-1.rank0", key, timeout_s=1)
    _assert_arrives(endpoint, "m-2.rank0", address, key)
    assert server.faults == 1 and "serves again" in caplog.text
    # A fault that ends the thread: the next call on the endpoint starts it again.
    faults.append(SystemExit("a fault no handler catches"))
    with pytest.raises(kv_transfer.KVTransferError, match="did not send"):
        kv_fetch.fetch(address, "m-1.rank0", key, timeout_s=1)
    server._thread.join(5)
    assert not server._thread.is_alive()
    _assert_arrives(endpoint, "m-3.rank0", address, key)
    assert "its thread had ended (SystemExit" in caplog.text


def _assert_arrives(endpoint, name: str, address: str, key: TransferKey) -> None:
    endpoint.serve(_caches(0), name, [1, 2], "127.0.0.1", key)
    destination = _caches(None)
    kv_network.KVNetworkEndpoint().fetch_into(destination, name, [4, 7], address, key)
    assert torch.equal(destination[1][:, [4, 7]], _caches(0)[1][:, [1, 2]])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_no_admission_while_its_thread_is_down_and_it_is_started_again(endpoint, monkeypatch, caplog):
    """The ZAP handler's thread ended: libzmq admits nobody (the socket
    requires a handler), and the endpoint starts it again."""
    key = _key()
    _, address = endpoint.serve(_caches(0), "m-1.rank0", [1], "127.0.0.1", key)
    admission = endpoint._server._admission
    admits = kv_admission.SealedAdmission._admits
    faults = [SystemExit("a fault no handler catches")]

    def failing_admits(self, request):
        if faults:
            raise faults.pop(0)
        return admits(self, request)

    monkeypatch.setattr(kv_admission.SealedAdmission, "_admits", failing_admits)
    with pytest.raises(kv_transfer.KVTransferError, match="did not send"):
        kv_fetch.fetch(address, "m-1.rank0", key, timeout_s=1)
    admission._thread.join(5)
    with pytest.raises(kv_transfer.KVTransferError, match="did not send"):
        kv_fetch.fetch(address, "m-1.rank0", key, timeout_s=1)  # nobody to admit it
    _assert_arrives(endpoint, "m-2.rank0", address, key)
    assert "the admission's thread had ended (SystemExit" in caplog.text


def test_a_fetch_refused_at_its_handshake_fails_and_never_hangs(endpoint, monkeypatch):
    """A token refused (another key here; a server remade meanwhile, say):
    the fetch fails within its timeout, at once where libzmq has dropped
    the connection before the request is sent (in some of the tries), and
    each refusal is counted as one."""
    _, address = endpoint.serve(_caches(0), "m-1.rank0", [1], "127.0.0.1", _key())
    connect = zmq.Socket.connect

    def connect_then_wait(sock, addr):
        connect(sock, addr)
        time.sleep(0.05)  # the refusal arrives meanwhile (in some of the tries)

    monkeypatch.setattr(zmq.Socket, "connect", connect_then_wait)
    outcomes = []

    def fetch_with_another_key() -> None:
        try:
            kv_fetch.fetch(address, "m-1.rank0", _key(), timeout_s=0.3)
        except kv_transfer.KVTransferError as error:
            outcomes.append(str(error))

    for _ in range(12):
        fetching = threading.Thread(target=fetch_with_another_key, daemon=True)
        fetching.start()
        fetching.join(10)
        assert not fetching.is_alive(), f"a refused fetch hangs (after {outcomes})"
    assert len(outcomes) == 12
    assert endpoint._server.refusals.counts["token"] == 12


def test_a_budget_counts_an_allowed_thread_up_to_its_allowance_and_no_excused_cpu():
    """The arithmetic the flood test relies on: a thread counted with an
    allowance is charged no more than it allows (the rest is kept as
    excess), an allowance not taken lapses, and excused CPU is not charged."""
    clock = {"now": 0.0}
    cpu = {1: 0.0, 2: 0.0}
    budget = kv_background.CopyBudget(share=0.5, clock=lambda: clock["now"], cpu_of=cpu.get)
    allowance = kv_background.CPUAllowance(ttl_s=30, clock=lambda: clock["now"])
    budget.count([1], allowance=allowance)
    budget.count([2])
    allowance.allow(0.002)
    cpu[1] += 0.010  # 2 ms sending, 8 ms refusing
    cpu[2] += 0.003
    budget.wait_s()
    assert budget.spent_s == pytest.approx(0.005) and allowance.excess_s == pytest.approx(0.008)
    allowance.allow(0.004)
    clock["now"] += 31  # lapsed unspent
    cpu[1] += 0.004
    budget.excuse(0.001)
    cpu[2] += 0.001  # spent refusing a message
    budget.wait_s()
    assert budget.spent_s == pytest.approx(0.005) and allowance.excess_s == pytest.approx(0.012)


def _listens(address: str) -> bool:
    try:
        with socket.create_connection(_host_port(address), timeout=1):
            return True
    except ConnectionRefusedError:
        return False


def test_the_server_listens_only_while_it_holds_offers(endpoint):
    """Between transfers a stranger's connection is refused by the kernel,
    at no cost to the rank: the server stops listening once its offers are
    fetched or withdrawn, and listens again, on a fresh port, for the next."""
    key = _key()
    _, first = endpoint.serve(_caches(0), "m-1.rank0", [1, 2], "127.0.0.1", key)
    assert _listens(first)
    destination = _caches(None)
    kv_network.KVNetworkEndpoint().fetch_into(destination, "m-1.rank0", [4, 7], first, key)
    wait_until(lambda: not _listens(first), 10, message="the server to stop listening once its offer was fetched")
    _, second = endpoint.serve(_caches(0), "m-2.rank0", [1], "127.0.0.1", key)
    assert second != first and _listens(second)
    assert endpoint.withdraw("m-2") == 1
    wait_until(lambda: not _listens(second), 10, message="the server to stop listening once its offer was withdrawn")
    _, third = endpoint.serve(_caches(0), "m-3.rank0", [1, 2], "127.0.0.1", key)
    _assert_arrives(endpoint, "m-3.rank0", third, key)
