"""Only the addresses a K/V server's offers are for can connect to it
(raylm.kv_transfer.peer_filter): a stranger at any other address gets no
answer to its SYN (no connection, no refusal for the rank to pay), the
destination fetches from its own address, an offer for a new destination
while the server listens admits it before its address is handed out, and
an offer for anyone (no peer) leaves the socket open to all as before.
Loopback's 127.0.0.0/8 stands for hosts: every address of it is this host's."""

from __future__ import annotations

import socket
import sys
import time

import pytest
import torch

from raylm.kv_transfer import network as kv_network
from raylm.kv_transfer import peer_filter, sealed_frames
from raylm.kv_transfer.sealed_frames import TransferKey

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_ATTACH_FILTER is Linux's")

SHAPE = (2, 6, 4, 2, 8)  # K/V, blocks, block size, heads, head dim


def _caches(seed: int | None) -> list[torch.Tensor]:
    if seed is None:
        return [torch.zeros(SHAPE) for _ in range(2)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen) for _ in range(2)]


def _connects(address: str, source: str, timeout_s: float = 0.5) -> bool:
    """Whether a TCP connection from `source` to `address` is accepted by the kernel."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket() as sock:
        sock.bind((source, 0))
        sock.settimeout(timeout_s)
        try:
            sock.connect((host, int(port)))
        except (TimeoutError, OSError):
            return False
        return True


def _fetch(address: str, name: str, key: TransferKey, local: str) -> list[torch.Tensor]:
    into = _caches(None)
    kv_network.KVNetworkEndpoint().fetch_into(into, name, [0, 1], address, key, timeout_s=10, local=local)
    return into


def test_the_program_admits_ipv4_peers_only():
    assert peer_filter.program(["10.0.0.2", "10.0.0.3"]) is not None
    assert len(peer_filter.program(["10.0.0.2"])) == 4 * 8  # load, one compare, drop, accept
    assert peer_filter.program(["::1"]) is None
    assert peer_filter.program(["node-b"]) is None
    assert peer_filter.program([]) is None
    assert not peer_filter.can_filter("::1", ["::1"])
    assert peer_filter.connect_address("127.0.0.2", "tcp://127.0.0.1:5") == "tcp://127.0.0.2:0;127.0.0.1:5"
    assert peer_filter.connect_address("192.0.2.1", "tcp://127.0.0.1:5") == "tcp://127.0.0.1:5"  # not ours
    assert peer_filter.connect_address("", "tcp://127.0.0.1:5") == "tcp://127.0.0.1:5"


def test_a_stranger_at_another_address_gets_no_connection_and_the_destination_its_blocks(endpoint):
    key = TransferKey(sealed_frames.new_key())
    source = _caches(0)
    _, address = endpoint.serve(source, "m-0.rank0", [3, 4], "127.0.0.1", key, peer="127.0.0.2")
    server = endpoint._server
    assert server.admitted == {"127.0.0.2"}
    # The source's own host's address, and a third one: the SYN gets no answer.
    assert not _connects(address, "127.0.0.1")
    assert not _connects(address, "127.0.0.9")
    time.sleep(0.5)  # the server's monitor read
    assert not server.refusals.counts, "a stranger reached the handshake"
    got = _fetch(address, "m-0.rank0", key, local="127.0.0.2")
    for src, dst in zip(source, got):
        assert torch.equal(dst[:, [0, 1]], src[:, [3, 4]])

    # A second destination's offer while the server listens: admitted before its address is handed out.
    _, again = endpoint.serve(source, "m-1.rank0", [5, 1], "127.0.0.1", key, peer="127.0.0.3")
    assert again == address and server.admitted == {"127.0.0.2", "127.0.0.3"}
    got = _fetch(address, "m-1.rank0", key, local="127.0.0.3")
    for src, dst in zip(source, got):
        assert torch.equal(dst[:, [0, 1]], src[:, [5, 1]])


def test_an_offer_for_anyone_leaves_the_socket_open_to_all(endpoint):
    key = TransferKey(sealed_frames.new_key())
    _, address = endpoint.serve(_caches(0), "m-0.rank0", [1], "127.0.0.1", key, peer="127.0.0.2")
    assert endpoint._server.admitted == {"127.0.0.2"}
    endpoint.serve(_caches(0), "m-1.rank0", [1], "127.0.0.1", key)  # no peer named
    assert endpoint._server.admitted is None
    assert _connects(address, "127.0.0.9")


def test_off_by_the_environment(endpoint, monkeypatch):
    monkeypatch.setenv("RAYLM_KV_PEER_FILTER", "0")
    key = TransferKey(sealed_frames.new_key())
    _, address = endpoint.serve(_caches(0), "m-0.rank0", [1], "127.0.0.1", key, peer="127.0.0.2")
    assert endpoint._server.admitted is None
    assert _connects(address, "127.0.0.9")
