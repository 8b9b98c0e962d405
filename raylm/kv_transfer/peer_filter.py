"""Which addresses may even connect to a rank's K/V server: a classic BPF
program on its listening socket (SO_ATTACH_FILTER) that drops, in the
kernel, every packet whose IPv4 source is not the address of a destination
one of its offers is for. A stranger's SYN then gets no answer and never
becomes a connection: the rank pays nothing for it (no accept, no
handshake, no refusal), as for a closed port.

Why in the kernel: refusing a connection at the handshake
(raylm.kv_transfer.admission) costs the rank's process ~95 us of CPU each
(libzmq's accept, ZMTP greeting, the ZAP check, the close), and a local
user who follows the server's port from /proc at 2k connections a second
took ~19% of a core from the steps (benchmarks/bench_kv_flood_engine.py,
`chase`). The filter leaves admission as it was for whoever shares the
destination's address (a user on the destination's own host; on one node
with RAYLM_MIGRATION_NETWORK=1, every local user).

The destination connects from the address the source admits
(`connect_address`): on a host with several addresses, the kernel could
pick another one for the route to the source.

IPv4 only: a server on an IPv6 address, or offers for a peer that is not an
IPv4 address, listen without a filter (admission alone, as before), said
once in the log. RAYLM_KV_PEER_FILTER=0 turns the filter off (a network
that rewrites source addresses between nodes: NAT)."""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import logging
import os
import socket
import struct
import sys
from collections.abc import Iterable

logger = logging.getLogger(__name__)

# <asm-generic/socket.h>; Python's socket module names neither
SO_ATTACH_FILTER = 26
SO_DETACH_FILTER = 27

# Classic BPF: a load relative to the network header (the IPv4 header's
# source address is at byte 12), whatever the socket's own offset is.
_SKF_NET_OFF = -0x100000
_BPF_LD_W_ABS = 0x20
_BPF_JEQ_K = 0x15
_BPF_RET_K = 0x06
_ACCEPT = 0xFFFFFFFF  # keep the whole packet
_DROP = 0
_MAX_PEERS = 200  # a classic program's jumps reach 255 instructions

# How many connections the listening socket holds before accept (the
# destination ranks of the migrations under way: a few).
_BACKLOG = 64

_warned: set[str] = set()


def enabled() -> bool:
    return os.environ.get("RAYLM_KV_PEER_FILTER", "1").strip().lower() not in ("0", "false", "no")


def _ipv4(address: str) -> int | None:
    try:
        return int(ipaddress.IPv4Address(address))
    except ValueError:
        return None


def program(peers: Iterable[str]) -> bytes | None:
    """The filter's instructions (struct sock_filter each) that accept
    packets from `peers` only; None where one is not an IPv4 address (or
    there are too many): no filter can say it."""
    addresses = sorted({_ipv4(peer) for peer in peers})
    if not addresses or None in addresses or len(addresses) > _MAX_PEERS:
        return None
    n = len(addresses)
    instructions = [(_BPF_LD_W_ABS, 0, 0, (_SKF_NET_OFF + 12) & 0xFFFFFFFF)]
    # Instruction i (1-based) jumps over the rest and the drop to the accept on a match.
    instructions += [(_BPF_JEQ_K, n - i, 0, address) for i, address in enumerate(addresses)]
    instructions += [(_BPF_RET_K, 0, 0, _DROP), (_BPF_RET_K, 0, 0, _ACCEPT)]
    return b"".join(struct.pack("HBBI", *instruction) for instruction in instructions)


def attach(fd: int, peers: Iterable[str]) -> bool:
    """Admit only `peers` on the socket `fd` from now on (replacing the
    filter it had); False where no filter can say that (left unfiltered)."""
    peers = list(peers)
    code = program(peers)
    if code is None:
        _warn_once(f"peers {sorted(set(peers))}", "they are not all IPv4 addresses")
        return False
    instructions = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HL", len(code) // 8, ctypes.addressof(instructions))
    sock = socket.socket(fileno=fd)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    except OSError as e:
        _warn_once("SO_ATTACH_FILTER", str(e))
        return False
    finally:
        sock.detach()  # the fd stays its owner's
    return True


def detach(fd: int) -> None:
    """Admit anyone on the socket `fd` from now on (its filter removed)."""
    sock = socket.socket(fileno=fd)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
    except OSError as e:
        if e.errno != errno.ENOENT:  # it had none
            raise
    finally:
        sock.detach()


def listen(host: str, peers: Iterable[str]) -> tuple[int, int]:
    """A TCP socket listening on `host` (a port the kernel picks), filtered to
    `peers` before it listens (no stranger's connection is queued
    meanwhile): (its fd, for libzmq to take over, and its port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        attach(sock.fileno(), peers)
        sock.listen(_BACKLOG)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return sock.detach(), port


def can_filter(host: str, peers: Iterable[str]) -> bool:
    """Whether a server on `host` can admit only `peers` in the kernel."""
    if not enabled() or not sys.platform.startswith("linux"):
        return False
    peers = list(peers)
    if _ipv4(host) is None:
        _warn_once(f"host {host}", "not an IPv4 address")
        return False
    return bool(peers) and program(peers) is not None


def connect_address(local: str, address: str) -> str:
    """The endpoint a destination connects to `address` (tcp://host:port)
    through, from its own `local` address where it has it (libzmq's
    'source;destination' form), so that the source's filter sees the
    address it admits; `address` itself where `local` is not this host's."""
    if not local or not enabled() or not _is_local(local):
        return address
    return f"tcp://{local}:0;{address.removeprefix('tcp://')}"


def _is_local(address: str) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
    except OSError:
        return False
    return True


def _warn_once(what: str, why: str) -> None:
    if what not in _warned:
        _warned.add(what)
        logger.warning(
            "the K/V server cannot admit only its destinations' addresses in the kernel for %s (%s): "
            "strangers are refused at the handshake instead",
            what,
            why,
        )
