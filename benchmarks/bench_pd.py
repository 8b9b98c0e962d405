"""Prefill/decode disaggregation against colocated chunked prefill on equal
cores (issue 50's benchmark): steady decode streams, and long prompts
arriving at random (Poisson) beside them.

    python benchmarks/bench_pd.py [--rounds 2] [--streams 16] [--load 0.65]
    python benchmarks/bench_pd.py --model 111m-8k --long-prompt 2048 --duration 60
    python benchmarks/bench_pd.py --kill-prefill-every 5      # P/D with its prefill replica SIGKILLed every 5 s
    python benchmarks/bench_pd.py --long-prompt 64 --variants pd,pd-local   # does handing off 64 tokens pay?

Two local replicas (`-dp 2 --data-parallel-backend mp`, `--threads` each):
- `colocated`: both replicas serve everything (chunked prefill, as `-dp 2` does);
- `pd`: `--prefill-replicas 1`, replica 0 prefills and hands each long
  prompt to replica 1 after its first token; the steady streams' short
  prompts stay on the decode replica (`--pd-min-prompt-tokens`'s default).

The load: `--streams` steady streams (`--stream-prompt` tokens, decoding
until the run ends) start together; once they decode, long prompts of
`--long-prompt` tokens (`--long-output` tokens each) arrive as a Poisson
process at `--load` times one replica's prefill capacity, measured first
(one long prompt alone, `--calibrate` times, its TTFT's median: capacity =
1 / that). Reported per variant: the steady streams' inter-token latency
(p50, p99: each delta's gap spread over its tokens, as vLLM's ITL), output
throughput (every token of every request over the run), the long prompts'
TTFT (p50, p99) and, for P/D, each hand-off's time (prefill replica's first
token to the decode replica's import) against its request's TTFT, and the
hand-offs by outcome. Variants alternate round by round. With
`--kill-prefill-every S`, each P/D round's prefill replica (its core
process) is SIGKILLed every S seconds; the run counts the requests that
failed (none should: each is recovered) and reports goodput (output tokens
of requests that finished) beside an undisturbed P/D round.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from compare_vllm import bench_model

from raylm import LLM, SamplingParams

# `pd-local`: P/D with the long prompts under --pd-min-prompt-tokens (they
# stay on the decode replica that gets them, as short prompts do): whether
# handing prompts of that length off pays, the threshold's question.
VARIANTS = ("colocated", "pd", "pd-local")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))] if ordered else float("nan")


def _engine(args, variant: str) -> LLM:
    settings = {"prefill_replicas": 1} if variant.startswith("pd") else {}
    if variant == "pd-local":
        settings["pd_min_prompt_tokens"] = args.long_prompt + 1
    return LLM(
        bench_model(args.model),
        data_parallel_size=2,
        data_parallel_backend="mp",
        num_threads=args.threads,
        kv_cache_memory_bytes=args.kv_cache_mib << 20,
        **settings,
    )


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 1000) for _ in range(n)]


def calibrate(args) -> float:
    """One long prompt's TTFT alone on one replica of the colocated engine (median)."""
    rng = random.Random(7)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ttfts = []
    with _engine(args, "colocated") as llm:
        engine = llm.llm_engine
        for i in range(args.calibrate + 1):  # the first warms the replica up
            start = time.monotonic()
            prompt = {"prompt_token_ids": _tokens(rng, args.long_prompt)}
            engine.add_request(f"cal{i}", prompt, params, data_parallel_rank=0)
            while engine.has_unfinished_requests():
                engine.step()
            if i:
                ttfts.append(time.monotonic() - start)
    return statistics.median(ttfts)


def run(variant: str, args, prefill_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    long_params = SamplingParams(temperature=0, max_tokens=args.long_output, ignore_eos=True)
    rate = args.load / prefill_s  # long prompts a second
    kill_every = args.kill_prefill_every if variant == "pd-kill" else None
    with _engine(args, variant) as llm:
        engine, sup = llm.llm_engine, llm.llm_engine.engine_core
        # A steady stream decodes to the end of the context, then another takes its place.
        steady = SamplingParams(
            temperature=0, max_tokens=engine.config.model_config.max_model_len - args.stream_prompt, ignore_eos=True
        )
        handoff_s: list[float] = []
        count = sup.handoffs._count

        def timed_count(outcome: str, seconds: float | None = None) -> None:
            if seconds is not None:
                handoff_s.append(seconds)
            count(outcome, seconds)

        sup.handoffs._count = timed_count
        n_steady = 0

        def start_stream() -> None:
            nonlocal n_steady
            engine.add_request(f"steady{n_steady}", {"prompt_token_ids": _tokens(rng, args.stream_prompt)}, steady)
            n_steady += 1

        for _ in range(args.streams):
            start_stream()
        last_token: dict[str, float] = {}  # a steady stream's last delta
        delivered: dict[str, int] = {}  # output tokens each request got
        itl: list[float] = []
        sent: dict[str, float] = {}
        ttft: dict[str, float] = {}
        failed: list[str] = []
        # Start the clock once every steady stream decodes.
        while len(last_token) < args.streams:
            for out in engine.step(stream=True):
                last_token[out.request_id] = time.monotonic()
        started = now = time.monotonic()
        next_arrival = started + rng.expovariate(rate)
        next_kill = started + kill_every if kill_every else None
        kills = n_long = 0
        while now - started < args.duration:
            while next_arrival <= now:
                rid = f"long{n_long}"
                n_long += 1
                engine.add_request(rid, {"prompt_token_ids": _tokens(rng, args.long_prompt)}, long_params)
                sent[rid] = next_arrival
                next_arrival += rng.expovariate(rate)
            if next_kill is not None and now >= next_kill:
                process = sup.launcher._processes.get(0)
                if process is not None and process.is_alive():
                    os.kill(process.pid, signal.SIGKILL)
                    kills += 1
                next_kill += kill_every
            for out in engine.step(stream=True):
                rid, t = out.request_id, time.monotonic()
                new = len(out.outputs[0].token_ids)
                delivered[rid] = delivered.get(rid, 0) + new
                if rid.startswith("steady") and new:
                    if rid in last_token:  # (a new stream's first token is its TTFT, not an ITL)
                        itl.extend([(t - last_token[rid]) / new] * new)
                    last_token[rid] = t
                elif new and rid in sent and rid not in ttft:
                    ttft[rid] = t - sent[rid]
                if out.finished:
                    if out.outputs[0].finish_reason not in ("length", "stop"):
                        failed.append(rid)
                    if rid.startswith("steady"):
                        last_token.pop(rid, None)
                        start_stream()
            now = time.monotonic()
        elapsed = now - started
        handoffs = {k: v for k, v in sup.handoffs.counts.items() if v}
    tokens = sum(delivered.values())
    ttfts = list(ttft.values())
    return {
        "variant": variant,
        "itl_p50_ms": 1e3 * _percentile(itl, 0.5),
        "itl_p99_ms": 1e3 * _percentile(itl, 0.99),
        "throughput": tokens / elapsed,
        # Output tokens of the requests that did not fail (none should).
        "goodput": (tokens - sum(delivered.get(rid, 0) for rid in failed)) / elapsed,
        "ttft_p50_ms": 1e3 * _percentile(ttfts, 0.5),
        "ttft_p99_ms": 1e3 * _percentile(ttfts, 0.99),
        "long_sent": n_long,
        "long_answered": len(ttfts),
        "failed": len(failed),
        "kills": kills,
        "handoff_p50_ms": 1e3 * _percentile(handoff_s, 0.5) if handoff_s else None,
        "handoffs": handoffs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder, or 111m-8k (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=1, help="threads per replica")
    parser.add_argument("--kv-cache-mib", type=int, default=64, help="KV cache per replica")
    parser.add_argument("--streams", type=int, default=16, help="steady decode streams")
    parser.add_argument("--stream-prompt", type=int, default=32, help="a steady stream's prompt tokens")
    parser.add_argument("--long-prompt", type=int, default=384, help="an arriving prompt's tokens")
    parser.add_argument("--long-output", type=int, default=16, help="an arriving prompt's output tokens")
    parser.add_argument(
        "--load", type=float, default=0.65, help="long-prompt arrivals, as a share of one replica's prefill capacity"
    )
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of each run")
    parser.add_argument("--calibrate", type=int, default=3, help="long prompts timed alone to find the capacity")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--kill-prefill-every",
        type=float,
        default=None,
        help="also run P/D with its prefill replica SIGKILLed every S s",
    )
    parser.add_argument("--variants", default="colocated,pd", help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    prefill_s = calibrate(args)
    print(
        f"one long prompt ({args.long_prompt} tokens) alone: TTFT {1e3 * prefill_s:.0f} ms; arrivals at "
        f"{args.load / prefill_s:.2f}/s",
        flush=True,
    )
    variants = args.variants.split(",") + (["pd-kill"] if args.kill_prefill_every else [])
    results = {v: [] for v in variants}
    for round_ in range(args.rounds):
        for variant in variants:
            r = run(variant, args, prefill_s, seed=round_)
            results[variant].append(r)
            print(f"round {round_} {json.dumps(r)}", flush=True)
    summary = {}
    for variant, rs in results.items():
        summary[variant] = {
            k: statistics.median(r[k] for r in rs)
            for k in ("itl_p50_ms", "itl_p99_ms", "throughput", "goodput", "ttft_p50_ms", "ttft_p99_ms")
        }
        print(f"{variant:10s} median of {len(rs)}: " + ", ".join(f"{k} {v:.1f}" for k, v in summary[variant].items()))
    for base in ("colocated", "pd-local"):
        if base in summary and "pd" in summary:
            col, pd = summary[base], summary["pd"]
            print(
                f"P/D against {base}: ITL p99 {col['itl_p99_ms'] / pd['itl_p99_ms']:.2f}x lower, throughput "
                f"{pd['throughput'] / col['throughput']:.2f}x, TTFT p50 {pd['ttft_p50_ms'] / col['ttft_p50_ms']:.2f}x"
            )
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps({"args": vars(args), "prefill_s": prefill_s, "runs": results, "summary": summary}, indent=1)
        )


if __name__ == "__main__":
    main()
