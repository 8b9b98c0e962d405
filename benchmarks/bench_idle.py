"""What an idle engine costs: CPU time of the driver and every worker process
(and Ray actor) over a quiet interval after start-up, as a share of one core,
plus the time `LLM(...)` took to start.

    python benchmarks/bench_idle.py --model /tmp/llama-7m --backend ray -tp 2
"""

from __future__ import annotations

import argparse
import time

import psutil


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backend", default="ray", choices=["uni", "mp", "ray"])
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--transport", default="mq", choices=["mq", "cgraph"], help="ray only")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds to wait before measuring")
    parser.add_argument("--interval", type=float, default=20.0, help="seconds measured")
    args = parser.parse_args(argv)

    from raylm import LLM, SamplingParams

    extra = {"ray_step_transport": args.transport} if args.backend == "ray" else {}
    if args.backend == "ray":
        import ray

        # Started beforehand, so the engine's start-up is what is timed, not Ray's.
        ray.init(num_cpus=args.tensor_parallel_size * 2, include_dashboard=False, log_to_driver=False)
    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        distributed_executor_backend=args.backend,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_memory_bytes=256 << 20,
        **extra,
    )
    startup = time.perf_counter() - t0
    try:
        llm.generate(["ROMEO:"], SamplingParams(max_tokens=8), use_tqdm=False)
        time.sleep(args.settle)
        me = psutil.Process()
        if args.backend == "ray":
            # The engine: this driver and the rank actors. Ray's own daemons
            # (raylet, GCS, dashboard), children of this process here, are
            # measured apart: they run whether or not an engine does.
            executor = llm.llm_engine.engine_core.engine_core.executor
            processes = [me, *(psutil.Process(pid) for pid in executor.collective_rpc(_pid))]
            ours = {p.pid for p in processes}
            ray_daemons = [p for p in me.children(recursive=True) if p.pid not in ours]
        else:
            processes, ray_daemons = [me, *me.children(recursive=True)], []
        daemons_before = cpu_seconds(ray_daemons)
        before, t = cpu_seconds(processes), time.perf_counter()
        time.sleep(args.interval)
        used, elapsed = cpu_seconds(processes) - before, time.perf_counter() - t
        daemons = cpu_seconds(ray_daemons) - daemons_before
    finally:
        llm.shutdown()
    print(
        f"{args.backend} TP={args.tensor_parallel_size}: start-up {startup:.1f} s; idle, {len(processes)} "
        f"engine processes used {used:.2f} CPU s in {elapsed:.0f} s = {used / elapsed:.1%} of one core"
        + (f" (Ray's {len(ray_daemons)} daemons: {daemons / elapsed:.1%})" if ray_daemons else "")
    )


def _pid(worker) -> int:
    import os

    return os.getpid()


if __name__ == "__main__":
    main()
