"""Step transports compared on one workload: uni (TP=1), mp TP=2, ray TP=2 over
a compiled graph (cgraph) and ray TP=2 over message queues (mq).

Prints output tokens/s and mean step time for each, and the CPU the TP=2
engines' worker processes burn while idle (psutil over --idle-seconds).

    python benchmarks/bench_ray_transport.py [--prompts 16] [--input-len 64] [--output-len 64]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass

import psutil
import torch

from raylm import LLM, SamplingParams
from raylm.testing import make_tiny_model

CONFIGS = [
    # label, backend, tensor_parallel_size, ray_step_transport
    ("uni TP=1", "uni", 1, None),
    ("mp TP=2", "mp", 2, None),
    ("ray TP=2 cgraph", "ray", 2, "cgraph"),
    ("ray TP=2 mq", "ray", 2, "mq"),
]


@dataclass
class Result:
    label: str
    tokens_per_s: float
    mean_step_ms: float
    steps: int
    idle_worker_cpu: list[float] | None
    idle_driver_cpu: float


def _make_model(root: str) -> str:
    # ~7M parameters: small enough that the step's transport is a visible share of it.
    return str(
        make_tiny_model(
            "llama",
            f"{root}/llama-7m",
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=688,
            vocab_size=8192,
            dtype=torch.bfloat16,
        )
    )


def _executor(llm: LLM):
    core = llm.llm_engine.engine_core
    return getattr(core, "engine_core", core).executor


def _count_steps(executor) -> list[int]:
    """Counts sample_tokens calls (one per engine step with PP=1)."""
    counter = [0]
    original = executor.sample_tokens

    def counting(*args, **kwargs):
        counter[0] += 1
        return original(*args, **kwargs)

    executor.sample_tokens = counting
    return counter


def _idle_cpu(pids: list[int], seconds: float) -> tuple[list[float], float]:
    procs = [psutil.Process(pid) for pid in pids]
    driver = psutil.Process()
    for proc in procs + [driver]:
        proc.cpu_percent(None)
    time.sleep(seconds)
    return [proc.cpu_percent(None) for proc in procs], driver.cpu_percent(None)


def run_one(
    model: str,
    label: str,
    backend: str,
    tp: int,
    transport: str | None,
    prompts: list[list[int]],
    params: SamplingParams,
    repeats: int,
    idle_seconds: float,
) -> Result:
    extra = {"ray_step_transport": transport} if transport else {}
    llm = LLM(
        model,
        dtype="bfloat16",
        tensor_parallel_size=tp,
        distributed_executor_backend=backend,
        num_threads=1,
        kv_cache_memory_bytes=64 << 20,
        **extra,
    )
    try:
        executor = _executor(llm)
        # Warm-up: first-step costs (graph compilation, allocator) stay out of the timing.
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:2]],
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )
        steps = _count_steps(executor)
        best_elapsed, best_steps = float("inf"), 0
        for _ in range(repeats):
            steps[0] = 0
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
            if elapsed < best_elapsed:
                best_elapsed, best_steps = elapsed, steps[0]
        total_tokens = len(prompts) * params.max_tokens
        worker_cpu = None
        if tp > 1:
            pids = executor.collective_rpc("check_health")  # each worker answers with its pid
            worker_cpu, driver_cpu = _idle_cpu(pids, idle_seconds)
        else:
            _, driver_cpu = _idle_cpu([], idle_seconds)
        return Result(
            label,
            total_tokens / best_elapsed,
            best_elapsed / max(best_steps, 1) * 1000,
            best_steps,
            worker_cpu,
            driver_cpu,
        )
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per backend; the fastest counts")
    parser.add_argument("--idle-seconds", type=float, default=2.0)
    parser.add_argument("--only", nargs="*", default=None, help="labels to run (default: all)")
    args = parser.parse_args()

    import ray

    torch.set_num_threads(1)
    # A Ray of our own, never a cluster another process left running on this host.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as root:
        model = _make_model(root)
        prompts = [[rng.randrange(8192) for _ in range(args.input_len)] for _ in range(args.prompts)]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        results = []
        for label, backend, tp, transport in CONFIGS:
            if args.only and label not in args.only:
                continue
            results.append(
                run_one(model, label, backend, tp, transport, prompts, params, args.repeats, args.idle_seconds)
            )
    ray.shutdown()

    print(f"\n{args.prompts} prompts x {args.input_len} in / {args.output_len} out, greedy, bf16, 1 thread per worker")
    print(f"{'backend':<18} {'out tok/s':>10} {'step ms':>9} {'steps':>6}   idle CPU % (workers; driver)")
    for r in results:
        workers = "n/a" if r.idle_worker_cpu is None else " + ".join(f"{c:.1f}" for c in r.idle_worker_cpu)
        print(
            f"{r.label:<18} {r.tokens_per_s:>10.1f} {r.mean_step_ms:>9.2f} {r.steps:>6}   "
            f"{workers}; {r.idle_driver_cpu:.1f}"
        )


if __name__ == "__main__":
    main()
