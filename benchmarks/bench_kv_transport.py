"""How a migration's K/V should cross hosts: ZMQ CURVE sockets against Ray's
object store, on the two-host harness (network namespaces joined by a veth
pair, a Ray node on each; tests/multinode/harness.py, needs root and `ip`).

    sudo python benchmarks/bench_kv_transport.py [--sizes-mib 0.25 1 4 16 32] [--repeats 7]

One actor per host. For each size (the ~111M bf16 model's K/V is 16 KiB per
token: 4, 16 and 32 MiB are requests of 256, 1k and 2k tokens, 0.25-1 MiB a
final stage's last blocks), `--repeats`
times, the time from the source holding the packed blocks in memory to the
destination holding them in its memory:

  curve       raylm.worker.kv_network: the destination fetches the source's
              offer over CURVE (encrypted, authenticated): what migration uses
  plain-tcp   the same exchange without CURVE (the encryption's share)
  ray-object  ray.put at the source (into its object store) + ray.get at the
              destination (pulled into its store, mapped without a copy)

Reported: median and minimum per size, and the throughput of the median.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_METHODS = ("curve", "plain-tcp", "ray-object")


class _Side:
    """One host's end (a Ray actor)."""

    def __init__(self):
        import zmq

        from raylm.distributed.tcp_auth import CurveKeys

        self.keys = CurveKeys.generate()
        self.server = None
        self.plain = None
        self.plain_payloads: dict[bytes, object] = {}
        self.zmq = zmq

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def keypair(self):
        return self.keys.public, self.keys.secret

    def _payload(self, nbytes: int):
        import torch

        return torch.randint(0, 255, (nbytes,), dtype=torch.uint8)

    def offer(self, name: str, nbytes: int, public: bytes, secret: bytes) -> str:
        from raylm.distributed.tcp_auth import CurveKeys
        from raylm.worker.kv_network import KVBlockServer

        if self.server is None:
            self.server = KVBlockServer(self.node_ip(), CurveKeys(public, secret))
        self.server.offer(name, self._payload(nbytes))
        return self.server.address

    def offer_plain(self, nbytes: int) -> str:
        """A plain ROUTER answering every request with `nbytes` bytes (one at a time)."""
        import threading

        zmq = self.zmq
        if self.plain is None:
            self.plain = zmq.Context().socket(zmq.ROUTER)
            port = self.plain.bind_to_random_port(f"tcp://{self.node_ip()}")
            self.plain_address = f"tcp://{self.node_ip()}:{port}"
        payload = self._payload(nbytes).numpy()

        def answer():
            identity, _ = self.plain.recv_multipart()
            self.plain.send_multipart([identity, b"ok", payload], copy=False)

        threading.Thread(target=answer, daemon=True).start()
        return self.plain_address

    def fetch(self, address: str, name: str, public: bytes, secret: bytes) -> float:
        from raylm.distributed.tcp_auth import CurveKeys
        from raylm.worker.kv_network import fetch

        start = time.perf_counter()
        frame = fetch(address, name, CurveKeys(public, secret))
        assert len(frame.buffer) > 0
        return time.perf_counter() - start

    def fetch_plain(self, address: str) -> float:
        zmq = self.zmq
        start = time.perf_counter()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(address)
        sock.send(b"x")
        _, payload = sock.recv_multipart(copy=False)
        assert len(payload.buffer) > 0
        sock.close(linger=0)
        return time.perf_counter() - start

    def put(self, nbytes: int):
        import ray

        payload = self._payload(nbytes).numpy()
        start = time.perf_counter()
        ref = ray.put(payload)
        return [ref], time.perf_counter() - start

    def get(self, refs) -> float:
        import ray

        start = time.perf_counter()
        array = ray.get(refs[0])
        assert array.nbytes > 0
        return time.perf_counter() - start


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
    source, destination = (side.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
                           for n in nodes)
    ips = ray.get([source.node_ip.remote(), destination.node_ip.remote()])
    public, secret = ray.get(source.keypair.remote())
    results: dict[str, dict[str, list[float]]] = {}
    for size_mib in spec["sizes_mib"]:
        nbytes = int(size_mib * 2**20)
        per = results.setdefault(str(size_mib), {m: [] for m in _METHODS})
        for repeat in range(spec["repeats"] + 1):  # the first is a warm-up (connections, object store)
            name = f"b-{size_mib}-{repeat}"
            address = ray.get(source.offer.remote(name, nbytes, public, secret))
            curve = ray.get(destination.fetch.remote(address, name, public, secret))
            plain = ray.get(destination.fetch_plain.remote(ray.get(source.offer_plain.remote(nbytes))))
            refs, put_s = ray.get(source.put.remote(nbytes))
            get_s = ray.get(destination.get.remote(refs))
            del refs
            if repeat:
                per["curve"].append(curve)
                per["plain-tcp"].append(plain)
                per["ray-object"].append(put_s + get_s)
    return {"ips": ips, "results": results}


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
        out = hosts.run_driver({"address": hosts.address, "sizes_mib": args.sizes_mib, "repeats": args.repeats},
                               timeout=900, module="benchmarks.bench_kv_transport")
    print(f"source on {out['ips'][0]}, destination on {out['ips'][1]}")
    print(f"{'MiB':>5} {'method':>11} {'median ms':>10} {'min ms':>8} {'MiB/s':>8}")
    for size, per in out["results"].items():
        for method, times in per.items():
            median = statistics.median(times)
            print(f"{size:>5} {method:>11} {1e3 * median:10.1f} {1e3 * min(times):8.1f} {float(size) / median:8.0f}")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):  # the driver, on the head host
        print("RESULT " + json.dumps(drive(json.loads(sys.argv[1]))), flush=True)
    else:
        main()
