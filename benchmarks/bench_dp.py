"""Data parallel on Ray: routing overhead per request, time to scale up by one
replica, and `raylm bench serve` saturation throughput with DP=1 against DP=2
(TP=1, one torch thread per replica), measured in one run.

    python benchmarks/bench_dp.py --model /tmp/raylm_bench_models/llama-7m
    python benchmarks/compare_vllm.py --make-model small /tmp/raylm_bench_models/llama-7m   # the model

Routing is timed in-process on a client with fake replicas (no sockets), so
it is the router's own cost; throughput runs real servers one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

from raylm.engine.prefix_index import PrefixIndex
from raylm.engine.protocol import EngineCoreRequest, SchedulerStats
from raylm.engine.routing import CoreLoad, routing_policy
from raylm.sampling_params import SamplingParams


def routing_overhead_us(num_replicas: int, num_requests: int, prompt_len: int, policy: str) -> float:
    """Per request: what the supervisor does to route (the loads of the
    serving cores, then raylm.engine.routing's `policy`: kv_aware hashes the
    prompt and looks it up in an empty index) and encode a request."""
    import msgspec

    stats = {i: SchedulerStats(num_waiting=i % 3) for i in range(num_replicas)}
    in_flight = {i: 0 for i in range(num_replicas)}
    router = routing_policy(policy, PrefixIndex(), 16)
    encoder = msgspec.msgpack.Encoder()
    params = SamplingParams(max_tokens=128)
    requests = [
        EngineCoreRequest(str(i), [(i * 7 + j) % 8000 for j in range(prompt_len)], params, 2)
        for i in range(num_requests)
    ]
    start = time.perf_counter()
    for request in requests:
        loads = [CoreLoad(i, in_flight[i], stats[i].num_waiting, stats[i].kv_cache_usage) for i in stats]
        chosen = router.choose(request, loads)
        encoder.encode(request)
        in_flight[chosen.index] += 1
    return (time.perf_counter() - start) / num_requests * 1e6


def scale_up_seconds(model: str) -> float:
    from raylm import LLM

    with LLM(model, data_parallel_size=2, num_threads=1) as llm:
        llm.scale(1)
        start = time.perf_counter()
        llm.scale(2)
        return time.perf_counter() - start


def serve_throughput(model: str, dp: int, port: int, num_prompts: int, input_len: int, output_len: int) -> dict:
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "raylm.entrypoints.cli",
            "serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--data-parallel-size",
            str(dp),
            "--num-threads",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except Exception as error:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError(f"server with dp={dp} did not come up") from error
                time.sleep(0.5)
        out = f"/tmp/bench_dp_{dp}.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "raylm.entrypoints.cli",
                "bench",
                "serve",
                "--base-url",
                f"http://127.0.0.1:{port}",
                "--num-prompts",
                str(num_prompts),
                "--random-input-len",
                str(input_len),
                "--random-output-len",
                str(output_len),
                "--output-json",
                out,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        with open(out) as f:
            return json.load(f)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--skip-serve", action="store_true")
    args = parser.parse_args()

    for policy in ("load", "vllm", "kv_aware"):
        samples = [routing_overhead_us(2, 2000, args.input_len, policy) for _ in range(5)]
        print(
            f"routing + encoding per request (2 replicas, --routing-policy {policy}): "
            f"{statistics.median(samples):.1f} us median of 5 [{min(samples):.1f}-{max(samples):.1f}]"
        )
    print(f"scale 1 -> 2 replicas: {scale_up_seconds(args.model):.2f} s (placed, model loaded, KV cache sized)")
    if args.skip_serve:
        return
    rows = {}
    for dp in (1, 2):
        result = serve_throughput(args.model, dp, 8100 + dp, args.num_prompts, args.input_len, args.output_len)
        rows[dp] = result
        print(f"dp={dp}: " + ", ".join(f"{k}={v:.1f}" for k, v in result.items() if isinstance(v, (int, float))))
    key = next(k for k in rows[1] if "output" in k and "throughput" in k)
    print(f"DP=2 / DP=1 {key}: {rows[2][key] / rows[1][key]:.2f}x")


if __name__ == "__main__":
    main()
