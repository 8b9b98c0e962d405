"""The CPU paged decode attention kernel (csrc/paged_decode_attention.cpp) alone:
one decode query per request against its blocks of a paged KV cache, as a
layer of a decode step calls it.

    python benchmarks/bench_paged_decode.py [--requests 64] [--context 192] [--threads 2] [--rounds 3]

Each request's blocks are spread at random over a cache of exactly the blocks
the requests need (as a running engine's are), and for comparison shared: every
request's table names the same blocks, which then stay in the CPU's caches.
The gap between the two is the time the kernel waits on memory. Reported: the
median time of one call over --calls calls, per round, and the K/V bytes read
per second. Default heads: the ~111M benchmark model's (16 query heads, 8 kv
heads of 64), bfloat16.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from raylm.model.layers.cpu_kernels import get_cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--context", type=int, default=192, help="tokens of each request's context")
    parser.add_argument("--heads", type=int, nargs=3, default=[16, 8, 64], metavar=("Q", "KV", "DIM"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    kernels = get_cpu_kernels()
    if kernels is None:
        sys.exit("the CPU kernels did not build here")
    torch.set_num_threads(args.threads)
    num_heads, num_kv_heads, head_dim = args.heads
    blocks_each = -(-args.context // args.block_size)
    num_blocks = args.requests * blocks_each
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, num_blocks, args.block_size, num_kv_heads, head_dim, generator=gen).bfloat16()
    q = torch.randn(args.requests, num_heads, head_dim, generator=gen).bfloat16()
    lens = torch.full((args.requests,), args.context, dtype=torch.int64)
    tables = {
        "spread": torch.randperm(num_blocks, generator=gen).view(args.requests, blocks_each),
        "shared": torch.arange(blocks_each).repeat(args.requests, 1),
    }
    kv_bytes = 2 * args.requests * args.context * num_kv_heads * head_dim * cache.element_size()
    scale = head_dim**-0.5
    times: dict[str, list[float]] = {name: [] for name in tables}
    for _ in range(args.rounds):  # the layouts alternate: a busy moment hurts both alike
        for name, table in tables.items():
            for _ in range(3):
                kernels.paged_decode(q, cache, table, lens, scale)
            calls = []
            for _ in range(args.calls):
                start = time.perf_counter()
                kernels.paged_decode(q, cache, table, lens, scale)
                calls.append(time.perf_counter() - start)
            times[name].append(statistics.median(calls))
    print(
        f"{args.requests} requests x {args.context} tokens, heads {num_heads}/{num_kv_heads}x{head_dim}, "
        f"bf16, {args.threads} threads; {kv_bytes / 2**20:.1f} MiB of K/V a call"
    )
    for name, rounds in times.items():
        best = min(rounds)
        print(
            f"  blocks {name}: {', '.join(f'{1e3 * t:.3f}' for t in rounds)} ms a call "
            f"({kv_bytes / best / 1e9:.1f} GB/s at the best round)"
        )


if __name__ == "__main__":
    main()
