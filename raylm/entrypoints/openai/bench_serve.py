"""`raylm bench serve`: a load generator for a running OpenAI-compatible server.
Streaming completions at a Poisson rate (or bounded concurrency); reports
throughput and TTFT / TPOT / ITL / end-to-end latency (mean, median, p99)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

logger = logging.getLogger(__name__)


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load")
    parser.add_argument("--model", default=None, help="model name to request; default: the server's first model")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second (Poisson arrivals); inf sends them all at once",
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--random-input-len", type=int, default=32, help="prompt tokens (random dataset)")
    parser.add_argument("--random-output-len", type=int, default=64, help="output tokens (random dataset)")
    parser.add_argument(
        "--random-vocab-size",
        type=int,
        default=256,
        help="random prompt token ids are drawn from [0, N); every byte-level vocabulary has 256",
    )
    parser.add_argument(
        "--dataset-path",
        default=None,
        help="ShareGPT-style JSON (a list of {'conversations': [{'from', 'value'}, ...]}); "
        "first human turn is the prompt, the reply's length the output length",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder, to count ShareGPT tokens exactly (else ~4 characters a token)",
    )
    parser.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: generate exactly the output length)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")
    parser.add_argument("--output-json", default=None, help="also write the results to this file")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))


def random_requests(num: int, input_len: int, output_len: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest([rng.randrange(vocab_size) for _ in range(input_len)], input_len, output_len) for _ in range(num)
    ]


def sharegpt_requests(path: str, num: int, seed: int, tokenizer_path: str | None) -> list[BenchRequest]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    count = _token_counter(tokenizer_path)
    pairs = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) >= 2 and isinstance(turns[0].get("value"), str) and isinstance(turns[1].get("value"), str):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise ValueError(f"{path} holds no conversation with a prompt and a reply")
    random.Random(seed).shuffle(pairs)
    requests = []
    while len(requests) < num:
        prompt, reply = pairs[len(requests) % len(pairs)]
        requests.append(BenchRequest(prompt, count(prompt), max(1, count(reply))))
    return requests


def _token_counter(tokenizer_path: str | None):
    if tokenizer_path is None:
        return lambda text: max(1, len(text) // 4)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return lambda text: len(tokenizer.encode(text))


async def _send(session, url: str, headers: dict, payload: dict, prompt_len: int) -> RequestResult:
    result = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    last = start
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw_line in response.content:
                line = raw_line.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "stream error")
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
            result.latency = time.perf_counter() - start
            result.success = True
    except Exception as e:  # a failed request is counted, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _arrivals(requests: list[BenchRequest], rate: float, rng: np.random.Generator):
    for i, request in enumerate(requests):
        yield request
        if math.isfinite(rate) and i + 1 < len(requests):
            await asyncio.sleep(rng.exponential(1.0 / rate))


async def _resolve_model(session, base_url: str, headers: dict) -> str:
    async with session.get(f"{base_url}/v1/models", headers=headers) as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


async def run_benchmark(
    base_url: str,
    model: str | None,
    requests: list[BenchRequest],
    request_rate: float,
    max_concurrency: int | None,
    ignore_eos: bool,
    api_key: str | None,
    seed: int = 0,
) -> dict[str, Any]:
    import aiohttp

    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = model or await _resolve_model(session, base_url, headers)
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        url = f"{base_url}/v1/completions"

        async def one(request: BenchRequest) -> RequestResult:
            payload = {
                "model": model,
                "prompt": request.prompt,
                "max_tokens": request.output_len,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": ignore_eos,
            }
            if semaphore is None:
                return await _send(session, url, headers, payload, request.prompt_len)
            async with semaphore:
                return await _send(session, url, headers, payload, request.prompt_len)

        start = time.perf_counter()
        tasks = []
        async for request in _arrivals(requests, request_rate, np.random.default_rng(seed)):
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, model, request_rate, max_concurrency)


def _stats_ms(values: list[float]) -> dict[str, float]:
    array = np.asarray(values, dtype=np.float64) * 1000 if values else np.zeros(1)
    return {"mean": float(array.mean()), "median": float(np.median(array)), "p99": float(np.percentile(array, 99))}


def summarize(
    results: list[RequestResult], duration: float, model: str, request_rate: float, max_concurrency: int | None
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "model": model,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "max_concurrency": max_concurrency,
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    for name, values in (
        ("ttft", [r.ttft for r in ok]),
        ("tpot", tpots),
        ("itl", [gap for r in ok for gap in r.itl]),
        ("e2el", [r.latency for r in ok]),
    ):
        for stat, value in _stats_ms(values).items():
            summary[f"{stat}_{name}_ms"] = value
    return summary


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        "============ Serving Benchmark Result ============",
        f"Successful requests:                 {s['completed']}",
        f"Failed requests:                     {s['failed']}",
        f"Benchmark duration (s):              {s['duration_s']:.2f}",
        f"Total input tokens:                  {s['total_input_tokens']}",
        f"Total generated tokens:              {s['total_output_tokens']}",
        f"Request throughput (req/s):          {s['request_throughput']:.2f}",
        f"Output token throughput (tok/s):     {s['output_throughput']:.2f}",
        f"Total token throughput (tok/s):      {s['total_token_throughput']:.2f}",
    ]
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        lines.append(f"{'-' * 10} {title} {'-' * 10}")
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {name.upper()} (ms):"
            lines.append(f"{label:<37}{s[f'{stat}_{name}_ms']:.2f}")
    for error in s["errors"]:
        lines.append(f"error: {error}")
    lines.append("=" * 50)
    return "\n".join(lines)


def main(args: argparse.Namespace, out: TextIO) -> dict[str, Any]:
    for name in ("num_prompts", "random_input_len", "random_output_len", "random_vocab_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.dataset_path:
        requests = sharegpt_requests(args.dataset_path, args.num_prompts, args.seed, args.tokenizer)
    else:
        requests = random_requests(
            args.num_prompts, args.random_input_len, args.random_output_len, args.random_vocab_size, args.seed
        )
    summary = asyncio.run(
        run_benchmark(
            args.base_url,
            args.model,
            requests,
            args.request_rate,
            args.max_concurrency,
            args.ignore_eos,
            args.api_key,
            args.seed,
        )
    )
    out.write(format_summary(summary) + "\n")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
        out.write(f"Results written to {args.output_json}\n")
    out.flush()
    return summary


__all__ = ["BenchRequest", "RequestResult", "add_bench_serve_args", "main", "run_benchmark", "summarize"]
