"""A rank's K/V server (raylm.kv_transfer.network) under a flood of strangers,
against a control run: what a victim transfer stream sees (per fetch and
per frame, p50/p99), what the server process grows (RSS, file descriptors)
and what the refusals cost and where it is charged.

    python benchmarks/bench_kv_flood.py [--seconds 10] [--rate 2000] [--repeats 2]

Three processes on 127.0.0.1: the source (this one: the server, its copy
budget at the default share), the destination (a child that fetches each
stage the source offers, one after another, alternating a paced pre-copy
stage and an unpaced final one, and times each frame's arrival), and the
attacker (a child). The attacker, for `--seconds`, keeps an endless
multipart message going (a raw ZMTP NULL handshake, then 1 KiB parts, no
last one; again whenever dropped), keeps 200 silent connections open
(opening another for each one closed), and opens `--rate` junk connections
a second (bytes that are no ZMTP, a NULL handshake and a message, a PLAIN
handshake with a forged token and a message, by turns). In the flood run
it aims at the server; in the control run the same process does the same
at the same rate against a closed port on the same host (each connection
refused by the kernel). Runs alternate control and flood, `--repeats` of
each; each run's stream starts once the attacker has started.

Reported per run: the victim's fetch and frame-gap latencies (p50/p99,
paced and final stages apart; a fetch that fails, its source silent for
FETCH_TIMEOUT_S, is listed instead), the server's RSS growth (its peak, sampled
every 50 ms, over the run's start) and open fds before, at the peak and
after (once the attacker is gone and a handshake timeout has passed),
connections refused, the refusals' CPU, and the copy budget's charge
against what the server's own threads spent (CPU seconds).
"""

from __future__ import annotations

import argparse
import functools
import math
import multiprocessing as mp
import os
import pathlib
import select
import socket
import statistics
import struct
import sys
import threading
import time
from concurrent.futures import Future

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch

from raylm import thread_accounting
from raylm.kv_transfer import background as kv_background
from raylm.kv_transfer import fetch as kv_fetch
from raylm.kv_transfer import files as kv_transfer
from raylm.kv_transfer import network as kv_network
from raylm.kv_transfer.sealed_frames import TransferKey, new_key

# The ~111M bf16 model's geometry per layer (as bench_kv_stage_cpu): 128 KiB a block.
LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 8, 16, 4, 64
_STAGE_BLOCKS = 32  # 4 MiB: 4 frames
_DESTINATION = "127.0.0.1"  # the destination's address (loopback's: it fetches from the default)
_IDLE_CONNECTIONS = 200


def _caches(num_blocks: int, fill: bool) -> list[torch.Tensor]:
    shape = (2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if not fill:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return [torch.randn(shape).to(torch.bfloat16) for _ in range(LAYERS)]


# The attacker: raw ZMTP 3.0 where it needs it (greeting, commands, frames).


def _greeting(mechanism: bytes) -> bytes:
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + b"\0" + bytes(31)


def _command(name: bytes, body: bytes) -> bytes:
    payload = bytes([len(name)]) + name + body
    return bytes([0x04, len(payload)]) + payload


_READY = _command(b"READY", b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER")


def _part(data: bytes, more: bool) -> bytes:
    return bytes([0x02 | (0x01 if more else 0)]) + struct.pack(">Q", len(data)) + data


_IP_BIND_ADDRESS_NO_PORT = 24  # <linux/in.h>


def _attacker(host: str, port, seconds: float, rate: float, counts, source: str = "") -> None:
    """`port`: an int, or a shared value (multiprocessing.Value) another
    process points at whatever port the server listens on, or listened on
    last. `source`: the address it connects from ("": the kernel's choice)."""
    stop = time.monotonic() + seconds

    def target() -> tuple[str, int]:
        return host, (port.value if hasattr(port, "value") else port)

    def connect() -> socket.socket:
        return socket.create_connection(target(), timeout=1, source_address=(source, 0) if source else None)

    tally = {"multipart_parts": 0, "multipart_dropped": 0, "idle_closed": 0, "junk": 0, "junk_unanswered": 0}

    def endless_multipart() -> None:
        parts = b"".join(_part(bytes(1024), more=True) for _ in range(64))
        while time.monotonic() < stop:
            try:
                with connect() as conn:
                    conn.sendall(_greeting(b"NULL"))
                    conn.recv(64)
                    conn.sendall(_READY)
                    while time.monotonic() < stop:
                        conn.sendall(parts)
                        tally["multipart_parts"] += 64
            except OSError:
                tally["multipart_dropped"] += 1
                time.sleep(0.01)

    def idle() -> None:
        held: list[socket.socket] = []
        while time.monotonic() < stop:
            for conn in list(held):  # closed by the server: another one
                conn.setblocking(False)
                try:
                    closed = conn.recv(4096) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed:
                    held.remove(conn)
                    conn.close()
                    tally["idle_closed"] += 1
            while len(held) < _IDLE_CONNECTIONS and time.monotonic() < stop:
                try:
                    held.append(connect())
                except OSError:
                    tally["idle_closed"] += 1
                    break
            time.sleep(0.05)
        for conn in held:
            conn.close()

    def junk() -> None:
        kinds = [
            bytes(range(256)) * 4,
            _greeting(b"NULL") + _READY + _part(b"m-0.rank0", more=False),
            _greeting(b"PLAIN")
            + _command(b"HELLO", b"\x08raylm-kv\x24" + os.urandom(36))
            + _part(b"m-0.rank0", more=False),
        ]
        # Each connection costs the attacker the same whatever answers: a
        # non-blocking connect (on loopback the handshake is done by the
        # time it returns), a look whether it connected, the junk if so, a
        # close. A SYN that gets no answer (a filtered port) is given up at
        # once, as one that is refused (a closed port).
        started = time.monotonic()
        while (now := time.monotonic()) < stop:
            if tally["junk"] > rate * (now - started):
                time.sleep(0.0005)
                continue
            with socket.socket() as conn:
                conn.setblocking(False)
                if source:  # the port chosen at connect, by the whole 4-tuple: as cheap as no bind
                    conn.setsockopt(socket.IPPROTO_IP, _IP_BIND_ADDRESS_NO_PORT, 1)
                    conn.bind((source, 0))
                conn.connect_ex(target())
                poll = select.poll()
                poll.register(conn, select.POLLOUT)
                if poll.poll(0) and conn.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    try:
                        conn.send(kinds[tally["junk"] % len(kinds)])
                    except OSError:
                        pass
                elif not poll.poll(0):
                    tally["junk_unanswered"] += 1
            tally["junk"] += 1

    threads = [threading.Thread(target=fn, daemon=True) for fn in (endless_multipart, idle, junk)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    counts.update(tally)


def _destination(requests, replies, key: bytes) -> None:
    """Fetches each stage asked for; replies its wall time and its frames' arrival gaps."""
    caches = _caches(_STAGE_BLOCKS, fill=False)
    endpoint = kv_network.KVNetworkEndpoint()
    while (request := requests.get()) is not None:
        name, address = request
        arrivals = []
        join = kv_fetch._JoinedStage(name, kv_transfer.packed_size(caches, _STAGE_BLOCKS))

        def into(index, count, size, arrivals=arrivals, join=join):  # this stage's, bound now
            arrivals.append(time.monotonic())
            return join.into(index, count, size)

        started = time.monotonic()
        try:
            kv_fetch.fetch(address, name, TransferKey(key), into=into)
            kv_transfer.unpack_blocks(caches, list(range(_STAGE_BLOCKS)), join.joined(), name)
        except kv_transfer.KVTransferError as error:  # its migration would be given up
            replies.put((None, [], str(error)))
            continue
        finally:
            join.release()
        done = time.monotonic()
        gaps = [b - a for a, b in zip([started] + arrivals, arrivals)]
        replies.put((done - started, gaps, None))
    endpoint.close()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on return: nothing listens there


def _packed_at_once(fn, *args) -> Future:
    future = Future()
    future.set_result(fn(*args))
    return future


def _percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"p50 {1000 * statistics.median(ordered):7.2f} / p99 {1000 * p99:7.2f} ms (n={len(ordered)})"


def run(
    mode: str, seconds: float, rate: float, source, key: bytes, requests, replies, context, attacker_address: str = ""
) -> dict:
    budget = kv_background.process_copy_budget()
    endpoint = kv_network.KVNetworkEndpoint()
    serve = functools.partial(endpoint.serve, peer=_DESTINATION)  # the one address the server admits
    _, address = serve(source, "warm-up.rank0", list(range(_STAGE_BLOCKS)), "127.0.0.1", TransferKey(key))
    requests.put(("warm-up.rank0", address))
    replies.get(timeout=120)
    server = endpoint._server
    own = [server._thread.native_id, server._sent_frames._thread.native_id]

    def own_cpu_s() -> float:
        return sum(thread_accounting.thread_cpu_s(tid) or 0.0 for tid in own)

    manager = context.Manager()  # the attacker's counts come back through it (its fds opened before counting)
    counts = manager.dict()
    time.sleep(0.2)
    budget.wait_s()
    rss_before, fds_before = _rss_mib(), _fds()
    charged_before, own_before = budget.spent_s, own_cpu_s()
    peak = {"rss": rss_before, "fds": fds_before}
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.05):
            peak["rss"], peak["fds"] = max(peak["rss"], _rss_mib()), max(peak["fds"], _fds())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    # The server listens only while it holds an offer (on a fresh port each
    # time): one nobody fetches keeps it on one port for the run.
    _, address = serve(source, "anchor.rank0", [0], "127.0.0.1", TransferKey(key))
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    target = int(port) if mode == "flood" else _closed_port()
    attacker = context.Process(target=_attacker, args=(host, target, seconds, rate, counts, attacker_address))
    attacker.start()
    time.sleep(0.5)  # the flood going
    fetches = {"paced": [], "final": []}
    gaps = {"paced": [], "final": []}
    failed = []
    deadline = time.monotonic() + seconds - 1.0
    i = 0
    while time.monotonic() < deadline:
        kind = "paced" if i % 2 == 0 else "final"
        name = f"m-{i}.rank0"
        _, address = serve(
            source,
            name,
            list(range(_STAGE_BLOCKS)),
            "127.0.0.1",
            TransferKey(key),
            _packed_at_once if kind == "paced" else None,
        )
        requests.put((name, address))
        took, frame_gaps, error = replies.get(timeout=120)
        if error is not None:
            failed.append(f"{kind}: {error}")
            continue
        fetches[kind].append(took)
        gaps[kind].extend(frame_gaps)
        i += 1
    attacker.join(seconds + 60)
    attacker.close()
    endpoint.withdraw("anchor")
    # The last strangers' handshakes time out (a tree before 2 s: the step queues' 10 s).
    time.sleep(getattr(kv_network, "_HANDSHAKE_TIMEOUT_MS", 10_000) / 1000 + 1.0)
    sampling.set()
    sampler.join()
    budget.wait_s()
    result = {
        "mode": mode,
        "fetches": fetches,
        "gaps": gaps,
        "failed": failed,
        "attacker": dict(counts),
        "rss_growth_mib": peak["rss"] - rss_before,
        "rss_after_mib": _rss_mib() - rss_before,
        "fds": (fds_before, peak["fds"], _fds()),
        # None, nan: a tree before refusals were counted apart (to compare the trees)
        "refusals": dict(server.refusals.counts) if hasattr(server, "refusals") else None,
        "refusal_cpu_s": getattr(server, "refusal_cpu_s", math.nan),
        "refusal_cpu_parts_s": (
            (server._admission.cpu_s, server._io_allowance.excess_s)
            if hasattr(server, "_admission")
            else (math.nan, math.nan)
        ),
        "charged_s": budget.spent_s - charged_before,
        "own_s": own_cpu_s() - own_before,
    }
    endpoint.close()
    manager.shutdown()
    return result


def _report(r: dict) -> None:
    print(f"--- {r['mode']}: attacker {r['attacker']}")
    for kind in ("paced", "final"):
        print(f"  {kind:5} stage fetch  {_percentiles(r['fetches'][kind])}")
        print(f"  {kind:5} frame gaps   {_percentiles(r['gaps'][kind])}")
    for failure in r["failed"]:
        print(f"  FAILED fetch, {failure}")
    before, peak, after = r["fds"]
    print(
        f"  server RSS growth: peak {r['rss_growth_mib']:+.1f} MiB, after {r['rss_after_mib']:+.1f} MiB; "
        f"fds before {before}, peak {peak}, after {after}"
    )
    admission, io = r["refusal_cpu_parts_s"]
    print(
        f"  refused {r['refusals']}; refusals' CPU {r['refusal_cpu_s']:.3f} s (admission thread {admission:.3f},"
        f" I/O threads beyond the frames' allowance {io:.3f}); copy budget charged "
        f"{r['charged_s']:.3f} s for the server's own threads' {r['own_s']:.3f} s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=2000.0, help="junk connections a second")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--attacker-address",
        default="",
        help=f"where the attacker connects from (default: {_DESTINATION}, the destination's, which the server "
        "admits; another, e.g. 127.0.0.2: a stranger whose SYNs the kernel drops)",
    )
    args = parser.parse_args()
    key = new_key()
    source = _caches(_STAGE_BLOCKS, fill=True)
    context = mp.get_context("spawn")
    requests, replies = context.Queue(), context.Queue()
    destination = context.Process(target=_destination, args=(requests, replies, key))
    destination.start()
    results = []
    try:
        for _ in range(args.repeats):
            for mode in ("control", "flood"):
                results.append(
                    run(mode, args.seconds, args.rate, source, key, requests, replies, context, args.attacker_address)
                )
                _report(results[-1])
    finally:
        requests.put(None)
        destination.join(60)
    print("=== all runs, per mode")
    for mode in ("control", "flood"):
        runs = [r for r in results if r["mode"] == mode]
        for kind in ("paced", "final"):
            print(
                f"  {mode:7} {kind:5} fetch {_percentiles([t for r in runs for t in r['fetches'][kind]])}; "
                f"frame gaps {_percentiles([g for r in runs for g in r['gaps'][kind]])}"
            )


if __name__ == "__main__":
    main()
