"""What one cross-host migration stage costs each end in CPU: the source
packs its blocks, seals and sends them (raylm.kv_transfer.network), the
destination receives, opens and unpacks them into its cache. On a node
with no spare core that CPU comes out of the decode steps, so it is the
copy's own cost, little moved by other work on a shared machine (a stage's
wall time is not).

    python benchmarks/bench_kv_stage_cpu.py [--mib 32 64] [--repeats 12]

The source is this process, the destination a child process, over
127.0.0.1; the caches have the ~111M bf16 model's geometry per layer (4 KV
heads of 64, blocks of 16 tokens; 8 layers). Each side's CPU is its whole
process's (every thread: ZMQ's I/O thread sends and receives), from the
offer to the destination holding the blocks, plus a short settle for ZMQ to
finish; the first two repeats warm up and are left out. Reported: median and
minimum per stage size.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pathlib
import resource
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch

from raylm.kv_transfer import files as kv_transfer
from raylm.kv_transfer import network as kv_network
from raylm.kv_transfer.sealed_frames import TransferKey, new_key

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 8, 16, 4, 64
_WARM_UP = 2
_SETTLE_S = 0.2


def _caches(num_blocks: int, fill: bool) -> list[torch.Tensor]:
    shape = (2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if not fill:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return [torch.randn(shape).to(torch.bfloat16) for _ in range(LAYERS)]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _destination(requests, replies, key: bytes, num_blocks: int) -> None:
    caches = _caches(num_blocks, fill=False)
    endpoint = kv_network.KVNetworkEndpoint()
    while (request := requests.get()) is not None:
        name, address, blocks = request
        start = _cpu_s()
        endpoint.fetch_into(caches, name, list(range(blocks)), address, TransferKey(key))
        time.sleep(_SETTLE_S)
        replies.put(_cpu_s() - start)


def measure(mib: float, repeats: int) -> dict:
    key = new_key()
    per_block = kv_transfer.packed_size(_caches(1, fill=False), 1) - kv_transfer.packed_size(_caches(1, fill=False), 0)
    blocks = max(1, int(mib * 2**20 / per_block))
    source = _caches(blocks, fill=True)
    context = mp.get_context("spawn")
    requests, replies = context.Queue(), context.Queue()
    child = context.Process(target=_destination, args=(requests, replies, key, blocks))
    child.start()
    endpoint = kv_network.KVNetworkEndpoint()
    source_cpu, destination_cpu = [], []
    try:
        for i in range(repeats + _WARM_UP):
            start = _cpu_s()
            _, address = endpoint.serve(source, f"stage-{i}.rank0", list(range(blocks)), "127.0.0.1", TransferKey(key))
            requests.put((f"stage-{i}.rank0", address, blocks))
            destination_cpu.append(replies.get(timeout=120))
            time.sleep(_SETTLE_S)
            source_cpu.append(_cpu_s() - start)
    finally:
        requests.put(None)
        child.join(60)
        endpoint.close()
    size = kv_transfer.packed_size(source, blocks) / 2**20

    def summary(values: list[float]) -> dict:
        timed = values[_WARM_UP:]
        return {"median_ms": 1000 * statistics.median(timed), "min_ms": 1000 * min(timed)}

    return {"mib": size, "source": summary(source_cpu), "destination": summary(destination_cpu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, nargs="+", default=[32, 64])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    for mib in args.mib:
        r = measure(mib, args.repeats)
        print(
            f"{r['mib']:6.1f} MiB stage: source {r['source']['median_ms']:6.1f} ms CPU "
            f"(min {r['source']['min_ms']:.1f}), destination {r['destination']['median_ms']:6.1f} ms "
            f"(min {r['destination']['min_ms']:.1f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
