"""Executor backends and step transports compared on one offline workload:
tokens/s, mean step time, collective_rpc round trip and idle worker CPU per config.

Only one engine exists at a time (build, warm up, measure, shut down, next), because
on a machine with few cores an idle engine's workers would steal time from the one
being measured; with --rounds 2 the second round runs the configs in reverse order so
drift in the machine's load hits every config alike.

    python benchmarks/bench_backends.py --model PATH --configs uni ray-tp1-mq ray-tp1-cgraph \\
        [--prompts 64] [--input-len 128] [--output-len 128] [--rounds 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
import torch

from raylm import LLM, SamplingParams


@dataclass(frozen=True)
class EngineSpec:
    backend: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    ray_step_transport: str | None = None
    async_scheduling: bool = False


# label -> engine settings; labels are what --configs takes.
CATALOG: dict[str, EngineSpec] = {
    "uni": EngineSpec("uni"),
    "uni-async": EngineSpec("uni", async_scheduling=True),
    "mp-tp2": EngineSpec("mp", tensor_parallel_size=2),
    "mp-pp2": EngineSpec("mp", pipeline_parallel_size=2),
    "ray-tp1-mq": EngineSpec("ray", ray_step_transport="mq"),
    "ray-tp1-cgraph": EngineSpec("ray", ray_step_transport="cgraph"),
    "ray-tp2-mq": EngineSpec("ray", tensor_parallel_size=2, ray_step_transport="mq"),
    "ray-tp2-cgraph": EngineSpec("ray", tensor_parallel_size=2, ray_step_transport="cgraph"),
    "ray-pp2-mq": EngineSpec("ray", pipeline_parallel_size=2, ray_step_transport="mq"),
    "ray-pp2-cgraph": EngineSpec("ray", pipeline_parallel_size=2, ray_step_transport="cgraph"),
}


@dataclass
class Measurement:
    label: str
    round: int
    elapsed_s: float
    output_tokens_per_s: float
    steps: int
    mean_step_ms: float
    rpc_round_trip_us: float
    idle_worker_cpu_percent: list[float] = field(default_factory=list)
    idle_driver_cpu_percent: float = 0.0
    busy_driver_cpu_s: float = 0.0
    busy_worker_cpu_s: list[float] = field(default_factory=list)
    build_s: float = 0.0
    outputs: list[list[int]] = field(default_factory=list, repr=False)


def _executor(llm: LLM) -> Any:
    core = llm.llm_engine.engine_core
    return getattr(core, "engine_core", core).executor


def _count_sample_calls(executor: Any) -> list[int]:
    """Counts sample_tokens calls: one per engine step (per micro-batch with PP)."""
    counter = [0]
    original = executor.sample_tokens

    def counting(*args: Any, **kwargs: Any) -> Any:
        counter[0] += 1
        return original(*args, **kwargs)

    executor.sample_tokens = counting
    return counter


def _rpc_round_trip_us(executor: Any, calls: int) -> float:
    """Mean microseconds of collective_rpc("check_health"): a no-op on every worker,
    so what is left is the cost of reaching the workers and hearing back."""
    for _ in range(10):
        executor.collective_rpc("check_health")
    start = time.perf_counter()
    for _ in range(calls):
        executor.collective_rpc("check_health")
    return (time.perf_counter() - start) / calls * 1e6


def _worker_processes(executor: Any, spec: EngineSpec) -> list[psutil.Process]:
    """The worker processes (none for uni: its worker is the driver)."""
    pids = [] if spec.backend == "uni" else executor.collective_rpc("check_health")
    return [psutil.Process(pid) for pid in pids]


def _cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _idle_cpu(executor: Any, spec: EngineSpec, seconds: float) -> tuple[list[float], float]:
    """CPU % of the worker processes and of the driver over `seconds` with no requests."""
    procs = _worker_processes(executor, spec)
    driver = psutil.Process()
    for proc in procs + [driver]:
        proc.cpu_percent(None)
    time.sleep(seconds)
    return [proc.cpu_percent(None) for proc in procs], driver.cpu_percent(None)


def measure(
    model: str, label: str, round_index: int, prompts: list[list[int]], args: argparse.Namespace
) -> Measurement:
    spec = CATALOG[label]
    extra: dict[str, Any] = {}
    if spec.ray_step_transport:
        extra["ray_step_transport"] = spec.ray_step_transport
    built = time.perf_counter()
    llm = LLM(
        model,
        dtype=args.dtype,
        tensor_parallel_size=spec.tensor_parallel_size,
        pipeline_parallel_size=spec.pipeline_parallel_size,
        distributed_executor_backend=spec.backend,
        async_scheduling=spec.async_scheduling,
        num_threads=args.threads,
        kv_cache_memory_bytes=args.kv_cache_mib << 20,
        enable_prefix_caching=False,
        **extra,
    )
    build_s = time.perf_counter() - built
    try:
        executor = _executor(llm)
        # Warm-up: first-step costs (allocator, graph compilation) stay out of the timing.
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:2]],
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False),
            use_tqdm=False,
        )
        steps = _count_sample_calls(executor)
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
        # CPU seconds burnt during the timed run tell a driver that spins while its
        # workers compute (which steals a core from them) from one that sleeps.
        workers, driver = _worker_processes(executor, spec), psutil.Process()
        cpu_before = [_cpu_seconds(p) for p in [driver] + workers]
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        busy = [_cpu_seconds(p) - before for p, before in zip([driver] + workers, cpu_before)]
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        if any(len(tokens) != args.output_len for tokens in outputs):
            raise RuntimeError(f"{label}: a request ended before {args.output_len} tokens")
        rpc_us = _rpc_round_trip_us(executor, args.rpc_calls)
        worker_cpu, driver_cpu = _idle_cpu(executor, spec, args.idle_seconds)
    finally:
        llm.shutdown()
    total = len(prompts) * args.output_len
    return Measurement(
        label,
        round_index,
        elapsed,
        total / elapsed,
        steps[0],
        elapsed / max(steps[0], 1) * 1e3,
        rpc_us,
        worker_cpu,
        driver_cpu,
        busy[0],
        busy[1:],
        build_s,
        outputs,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model folder")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["uni", "ray-tp1-mq", "ray-tp1-cgraph"],
        choices=sorted(CATALOG),
        help="engine configs, in round-one order; the first is the baseline",
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="odd rounds run the configs in reverse order")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-mib", type=int, default=512, help="KV cache per worker, MiB")
    parser.add_argument("--rpc-calls", type=int, default=200, help="collective_rpc round trips timed")
    parser.add_argument("--idle-seconds", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    parser.add_argument("--json-out", default=None, help="also write every measurement here")
    return parser.parse_args(argv)


def print_report(args: argparse.Namespace, runs: list[Measurement]) -> None:
    print(
        f"\n{args.prompts} prompts x {args.input_len} in / {args.output_len} out, greedy, {args.dtype}, "
        f"{args.threads} torch thread(s) per worker, {args.rounds} round(s)"
    )
    print(
        f"{'config':<16} {'round':>5} {'out tok/s':>10} {'step ms':>8} {'steps':>6} {'rpc us':>8}   "
        f"idle CPU % (workers; driver)   busy CPU s during the run (driver; workers)"
    )
    for r in runs:
        workers = " + ".join(f"{c:.1f}" for c in r.idle_worker_cpu_percent) or "n/a"
        busy = " + ".join(f"{c:.1f}" for c in r.busy_worker_cpu_s) or "n/a"
        print(
            f"{r.label:<16} {r.round:>5} {r.output_tokens_per_s:>10.1f} {r.mean_step_ms:>8.2f} {r.steps:>6} "
            f"{r.rpc_round_trip_us:>8.1f}   {workers}; {r.idle_driver_cpu_percent:.1f}   "
            f"{r.busy_driver_cpu_s:.1f}; {busy} (of {r.elapsed_s:.1f} s)"
        )
    baseline = args.configs[0]
    base_step = statistics.mean(r.mean_step_ms for r in runs if r.label == baseline)
    base_rpc = statistics.mean(r.rpc_round_trip_us for r in runs if r.label == baseline)
    reference = next(r.outputs for r in runs if r.label == baseline)
    print(f"\nmean over rounds; ratios against {baseline}")
    print(
        f"{'config':<16} {'out tok/s':>10} {'step ms':>8} {'step/base':>9} {'step-base us':>12} "
        f"{'rpc us':>8} {'rpc-base us':>11} {'same greedy':>11}"
    )
    for label in args.configs:
        mine = [r for r in runs if r.label == label]
        step = statistics.mean(r.mean_step_ms for r in mine)
        rpc = statistics.mean(r.rpc_round_trip_us for r in mine)
        same = sum(a == b for a, b in zip(mine[0].outputs, reference))
        print(
            f"{label:<16} {statistics.mean(r.output_tokens_per_s for r in mine):>10.1f} {step:>8.2f} "
            f"{step / base_step:>9.3f} {(step - base_step) * 1e3:>12.1f} {rpc:>8.1f} {rpc - base_rpc:>11.1f} "
            f"{same:>6}/{len(reference)}"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(16, 8192) for _ in range(args.input_len)] for _ in range(args.prompts)]
    uses_ray = any(CATALOG[label].backend == "ray" for label in args.configs)
    if uses_ray:
        import ray

        # A Ray of our own, never a cluster another process left running on this host.
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    runs: list[Measurement] = []
    try:
        for round_index in range(args.rounds):
            order = args.configs if round_index % 2 == 0 else list(reversed(args.configs))
            for label in order:
                run = measure(args.model, label, round_index, prompts, args)
                print(
                    f"[round {round_index}] {label}: {run.output_tokens_per_s:.1f} out tok/s, "
                    f"{run.mean_step_ms:.2f} ms/step, rpc {run.rpc_round_trip_us:.1f} us",
                    flush=True,
                )
                runs.append(run)
    finally:
        if uses_ray:
            ray.shutdown()
    print_report(args, runs)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "runs": [asdict(r) | {"outputs": None} for r in runs]}, f, indent=1)


if __name__ == "__main__":
    main()
