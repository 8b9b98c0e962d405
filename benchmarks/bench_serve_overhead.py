"""What Ray Serve adds to a request: the same engine settings behind `raylm
serve` (uvicorn in the server process) and behind a Ray Serve application
(Serve's HTTP proxy -> the replica actor -> the same raylm app), one after the
other on this machine, the same sequential requests against each.

    python benchmarks/bench_serve_overhead.py [--requests 40] [--max-tokens 1 16]

Prints, per endpoint and max_tokens, the median and mean latency of a whole
(non-streamed) completion and the time to the first streamed chunk, and
Serve's difference. One request at a time: the number is the per-request
cost of the extra hops, not a throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.entrypoints.openai.server_utils import free_port  # noqa: E402

# The embedded model, one torch thread, a small KV cache: the engine's own
# time stays small, so what differs is the way to it.
ENGINE = {"num_threads": 1, "kv_cache_memory_bytes": 4 << 20, "max_model_len": 512}
PROMPT = "ROMEO:"
WARMUP = 3


def wait_healthy(base: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base} not healthy within {timeout} s")


def measure(base: str, model: str, requests: int, max_tokens: int) -> dict[str, list[float]]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    whole, first = [], []
    with httpx.Client(timeout=120) as client:
        for i in range(WARMUP + requests):
            start = time.perf_counter()
            response = client.post(f"{base}/v1/completions", json=body)
            elapsed = time.perf_counter() - start
            response.raise_for_status()
            start = time.perf_counter()
            ttft = None
            with client.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as stream:
                for line in stream.iter_lines():  # read to the end: the next request starts on an idle engine
                    if ttft is None and line.startswith("data:"):
                        ttft = time.perf_counter() - start
            if i >= WARMUP:
                whole.append(elapsed)
                first.append(ttft)
    return {"whole": whole, "first_chunk": first}


def run_raylm_serve(requests: int, max_tokens_list: list[int], log: str) -> dict:
    port = free_port()
    flags = [
        "--num-threads",
        "1",
        "--kv-cache-memory-bytes",
        str(ENGINE["kv_cache_memory_bytes"]),
        "--max-model-len",
        str(ENGINE["max_model_len"]),
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "raylm.entrypoints.cli", "serve", "--port", str(port), *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        return {n: measure(base, "raylm-default", requests, n) for n in max_tokens_list}
    finally:
        proc.terminate()
        proc.wait(60)


def run_ray_serve(requests: int, max_tokens_list: list[int]) -> dict:
    import ray
    from ray import serve

    from raylm.ray_serve import build_openai_app

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_openai_app(ENGINE), name="bench", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        return {n: measure(base, "raylm-default", requests, n) for n in max_tokens_list}
    finally:
        serve.shutdown()
        ray.shutdown()


def summary(samples: list[float]) -> str:
    return f"median {statistics.median(samples) * 1e3:7.2f} ms  mean {statistics.mean(samples) * 1e3:7.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--json", help="also write the samples here")
    args = parser.parse_args()
    log = os.path.join(tempfile.mkdtemp(), "raylm-serve.log")
    results = {
        "raylm serve": run_raylm_serve(args.requests, args.max_tokens, log),
        "Ray Serve": run_ray_serve(args.requests, args.max_tokens),
    }
    for n in args.max_tokens:
        for kind in ("whole", "first_chunk"):
            direct = results["raylm serve"][n][kind]
            served = results["Ray Serve"][n][kind]
            added = statistics.median(served) - statistics.median(direct)
            print(
                f"max_tokens={n:3d} {kind:11s} raylm serve: {summary(direct)} | Ray Serve: {summary(served)} "
                f"| Serve adds {added * 1e3:+.2f} ms (median)"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {str(n): v for n, v in r.items()} for k, r in results.items()}, f)


if __name__ == "__main__":
    main()
