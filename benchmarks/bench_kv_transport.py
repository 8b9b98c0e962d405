"""How a migration's K/V should cross hosts: raylm's sealed frames against
ZMQ CURVE and Ray's object store, on the two-host harness (network
namespaces joined by a veth pair, a Ray node on each;
tests/multinode/harness.py, needs root and `ip`).

    sudo python benchmarks/bench_kv_transport.py [--sizes-mib 0.25 1 4 16 32] [--repeats 7]

One actor per host. For each size (the ~111M bf16 model's K/V is 16 KiB per
token: 4, 16 and 32 MiB are requests of 256, 1k and 2k tokens, 0.25-1 MiB a
final stage's last blocks), `--repeats` times, the time from the source
holding the packed blocks in memory to the destination holding them in its
memory, and each side's CPU over it (its whole process, every thread):

  sealed      raylm.kv_transfer.network: the destination fetches the source's
              offer, each 1 MiB frame sealed with AES-256-GCM
              (raylm.kv_transfer.sealed_frames): what migration uses
  curve       the same frames over ZMQ CURVE (libzmq encrypts; migration's
              transport until the sealed frames replaced it)
  plain-tcp   the same frames in the clear (the cost of the trust)
  ray-object  ray.put at the source (into its object store) + ray.get at the
              destination (pulled into its store, mapped without a copy)

Reported: median and minimum per size, the throughput of the median, and
the median CPU of each side.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import statistics
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_METHODS = ("sealed", "curve", "plain-tcp", "ray-object")
_FRAME_BYTES = 1 << 20  # as raylm.kv_transfer.network's
_SETTLE_S = 0.1


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Side:
    """One host's end (a Ray actor). Each fetch returns its wall time and
    the CPU its process spent meanwhile."""

    def __init__(self):
        import zmq

        from raylm.distributed.tcp_auth import CurveKeys
        from raylm.kv_transfer.sealed_frames import new_key

        self.key = new_key()
        self.curve_keys = CurveKeys.generate()
        self.server = None
        self.raw: dict[bool, tuple] = {}  # curve? -> (context, socket, address)
        self.payloads: dict = {}
        # Where a fetch opens the frames it gets (as a destination's pool of joined stages).
        self.joined = bytearray()
        self.zmq = zmq

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def keys(self):
        return self.key, self.curve_keys.public, self.curve_keys.secret

    def _payload(self, nbytes: int):
        """Made once per size (outside the timings: it takes longer than sending it)."""
        import torch

        if nbytes not in self.payloads:
            self.payloads[nbytes] = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        return self.payloads[nbytes]

    def offer(self, name: str, nbytes: int, key: bytes) -> str:
        from raylm.kv_transfer.network import KVBlockServer
        from raylm.kv_transfer.sealed_frames import TransferKey

        if self.server is None:
            self.server = KVBlockServer(self.node_ip(), TransferKey(key))
        self.server.offer(name, self._payload(nbytes))  # packed already
        return self.server.address

    def offer_raw(self, nbytes: int, curve: bool) -> str:
        """A ROUTER answering the next request with `nbytes` bytes in frames
        of 1 MiB, a message each, over CURVE or in the clear."""
        from raylm.distributed.tcp_auth import CurveServer

        zmq = self.zmq
        if curve not in self.raw:
            context = zmq.Context()
            sock = context.socket(zmq.ROUTER)
            if curve:
                self.curve_server = CurveServer(context, self.curve_keys)
                self.curve_server.secure(sock)
            port = sock.bind_to_random_port(f"tcp://{self.node_ip()}")
            self.raw[curve] = (context, sock, f"tcp://{self.node_ip()}:{port}")
        _, sock, address = self.raw[curve]
        payload = self._payload(nbytes).numpy()

        def answer():
            identity, _ = sock.recv_multipart()
            for at in range(0, nbytes, _FRAME_BYTES):
                sock.send_multipart([identity, b"ok", payload[at : at + _FRAME_BYTES]], copy=False)

        threading.Thread(target=answer, daemon=True).start()
        return address

    def fetch(self, address: str, name: str, nbytes: int, key: bytes) -> tuple[float, float]:
        from raylm.kv_transfer.network import fetch
        from raylm.kv_transfer.sealed_frames import TransferKey

        if len(self.joined) < nbytes:
            self.joined = bytearray(nbytes)  # outside the timing, once per size
        joined, size = memoryview(self.joined), 0

        def into(index: int, count: int, frame_bytes: int):
            nonlocal size
            size += frame_bytes
            return joined[size - frame_bytes : size]

        start, cpu = time.perf_counter(), _cpu_s()
        fetch(address, name, TransferKey(key), into=into)
        assert size > 0
        return time.perf_counter() - start, _cpu_s() - cpu

    def fetch_raw(self, address: str, nbytes: int, curve_keys: tuple[bytes, bytes] | None) -> tuple[float, float]:
        from raylm.distributed.tcp_auth import CurveKeys, secure_client

        zmq = self.zmq
        start, cpu = time.perf_counter(), _cpu_s()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        if curve_keys is not None:
            secure_client(sock, CurveKeys(*curve_keys))
        sock.connect(address)
        sock.send(b"x")
        received = 0
        while received < nbytes:
            _, payload = sock.recv_multipart(copy=False)
            received += len(payload.buffer)
        sock.close(linger=0)
        return time.perf_counter() - start, _cpu_s() - cpu

    def cpu_s(self) -> float:
        return _cpu_s()

    def put(self, nbytes: int):
        import ray

        payload = self._payload(nbytes).numpy()
        start = time.perf_counter()
        ref = ray.put(payload)
        return [ref], time.perf_counter() - start

    def get(self, refs) -> tuple[float, float]:
        import ray

        start, cpu = time.perf_counter(), _cpu_s()
        array = ray.get(refs[0])
        assert array.nbytes > 0
        return time.perf_counter() - start, _cpu_s() - cpu


def drive(spec: dict) -> dict:
    """On the head host: one actor per node, every method and size."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=spec["address"])
    deadline = time.monotonic() + 60
    while len([n for n in ray.nodes() if n["Alive"]]) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError("the worker host's Ray node did not join")
        time.sleep(0.2)
    here = ray.get_runtime_context().get_node_id()
    nodes = sorted((n["NodeID"] for n in ray.nodes() if n["Alive"]), key=lambda n: n != here)
    side = ray.remote(num_cpus=1)(_Side)
    source, destination = (
        side.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in nodes
    )
    ips = ray.get([source.node_ip.remote(), destination.node_ip.remote()])
    key, public, secret = ray.get(source.keys.remote())
    results: dict[str, dict[str, list]] = {}
    for size_mib in spec["sizes_mib"]:
        nbytes = int(size_mib * 2**20)
        per = results.setdefault(str(size_mib), {m: [] for m in _METHODS})
        for repeat in range(spec["repeats"] + 1):  # the first is a warm-up (connections, object store)
            name = f"b-{size_mib}-{repeat}"
            # Each: (wall seconds, the destination's CPU seconds). This round's
            # name and size are bound as default arguments.
            runs = {
                "sealed": lambda name=name, nbytes=nbytes: ray.get(
                    destination.fetch.remote(ray.get(source.offer.remote(name, nbytes, key)), name, nbytes, key)
                ),
                "curve": lambda nbytes=nbytes: ray.get(
                    destination.fetch_raw.remote(
                        ray.get(source.offer_raw.remote(nbytes, True)), nbytes, (public, secret)
                    )
                ),
                "plain-tcp": lambda nbytes=nbytes: ray.get(
                    destination.fetch_raw.remote(ray.get(source.offer_raw.remote(nbytes, False)), nbytes, None)
                ),
                "ray-object": lambda nbytes=nbytes: _put_and_get(source, destination, nbytes),
            }
            for method, run in runs.items():
                source_cpu = ray.get(source.cpu_s.remote())
                wall_s, destination_cpu = run()
                time.sleep(_SETTLE_S)  # the source's last sends' trackers
                source_cpu = ray.get(source.cpu_s.remote()) - source_cpu
                if repeat:
                    per[method].append([wall_s, source_cpu, destination_cpu])
    return {"ips": ips, "results": results}


def _put_and_get(source, destination, nbytes: int):
    import ray

    refs, put_s = ray.get(source.put.remote(nbytes))
    get_s, get_cpu = ray.get(destination.get.remote(refs))
    return put_s + get_s, get_cpu


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[0.25, 1, 4, 16, 32])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    from tests.multinode.harness import netns_unavailable, two_hosts

    reason = netns_unavailable()
    if reason:
        sys.exit(f"cannot build two hosts here: {reason}")
    with two_hosts() as hosts:
        out = hosts.run_driver(
            {"address": hosts.address, "sizes_mib": args.sizes_mib, "repeats": args.repeats},
            timeout=900,
            module="benchmarks.bench_kv_transport",
        )
    print(f"source on {out['ips'][0]}, destination on {out['ips'][1]}")
    print(
        f"{'MiB':>5} {'method':>11} {'median ms':>10} {'min ms':>8} {'MiB/s':>8} {'source CPU ms':>14} "
        f"{'destination CPU ms':>19}"
    )
    for size, per in out["results"].items():
        for method, runs in per.items():
            wall, source_cpu, destination_cpu = ([run[i] for run in runs] for i in range(3))
            median = statistics.median(wall)
            print(
                f"{size:>5} {method:>11} {1e3 * median:10.1f} {1e3 * min(wall):8.1f} {float(size) / median:8.0f} "
                f"{1e3 * statistics.median(source_cpu):14.1f} {1e3 * statistics.median(destination_cpu):19.1f}"
            )


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):  # the driver, on the head host
        print("RESULT " + json.dumps(drive(json.loads(sys.argv[1]))), flush=True)
    else:
        main()
