"""TP collective micro-benchmark: all-reduce latency of decode-sized tensors through
the shared-memory collective and through gloo, between 2 ranks of one node.

The two transports alternate in short bursts inside one run, so both see the
same machine load; on a shared, noisy machine read the ratio, not the absolute
numbers.

    python benchmarks/bench_collective.py [--shapes 1x256 64x1024] [--dtype bfloat16]
                                          [--calls 200] [--rounds 10]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raylm.distributed import parallel_state

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _burst(reduce, tensor: torch.Tensor, calls: int) -> float:
    """Seconds per call, over `calls` back-to-back all-reduces."""
    start = time.perf_counter()
    for _ in range(calls):
        reduce(tensor)
    return (time.perf_counter() - start) / calls


def _rank(rank: int, port: int, args, results) -> None:
    torch.set_num_threads(1)
    parallel_state.init_distributed_environment(WORLD, rank, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=120)
    parallel_state.initialize_model_parallel(tp_size=WORLD)
    tp = parallel_state.get_tp_group()
    try:
        if tp.shm is None:
            raise RuntimeError("the shared-memory collective is off (RAYLM_DISABLE_SHM_COLLECTIVE?)")
        transports = {"shm": tp.all_reduce, "gloo": lambda t: dist.all_reduce(t, group=tp.group)}
        dtype = getattr(torch, args.dtype)
        for shape in args.shapes:
            tensor = torch.randn(shape).to(dtype)
            if not tp.shm.can_carry(tensor):
                raise ValueError(f"{shape} does not fit a shared-memory slot; pick a smaller shape")
            per_call = {name: [] for name in transports}
            for reduce in transports.values():
                _burst(reduce, tensor, 20)  # warm-up
            for _ in range(args.rounds):
                for name, reduce in transports.items():
                    per_call[name].append(_burst(reduce, tensor, args.calls))
            if rank == 0:
                results.append((shape, {name: statistics.median(v) for name, v in per_call.items()}))
    finally:
        parallel_state.destroy_model_parallel()


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split("x"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=_shape, nargs="+", default=[(1, 256), (8, 1024), (64, 1024)])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--calls", type=int, default=200, help="calls per timed burst")
    parser.add_argument("--rounds", type=int, default=10, help="bursts per transport (alternating)")
    args = parser.parse_args()

    context = mp.get_context("spawn")
    with context.Manager() as manager:
        results = manager.list()
        port = _free_port()
        procs = [context.Process(target=_rank, args=(r, port, args, results)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        print(f"all_reduce, {WORLD} ranks, {args.dtype}, median of {args.rounds} bursts of {args.calls} calls")
        print(f"{'shape':>12} {'shm us':>10} {'gloo us':>10} {'gloo/shm':>9}")
        for shape, median in results:
            label = "x".join(map(str, shape))
            print(
                f"{label:>12} {median['shm'] * 1e6:10.1f} {median['gloo'] * 1e6:10.1f} "
                f"{median['gloo'] / median['shm']:9.1f}"
            )


if __name__ == "__main__":
    main()
