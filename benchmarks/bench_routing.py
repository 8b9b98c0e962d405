"""KV-aware routing against load-only routing and vLLM's balancer, on a
multi-turn trace whose sessions share system prompts (issue 49's trace, cut
to the embedded default model's 512 positions).

    python benchmarks/bench_routing.py [--sessions 16] [--turns 4] [--group 4] [--rounds 2] [--policies ...]
    python benchmarks/bench_routing.py --model 111m-8k --system 2048 --user 64 --output 32 --turns 8 --hot 16

An offline engine of two local replicas (`-dp 2 --data-parallel-backend mp`,
the embedded model, or `--model`: a folder, or `111m-8k` for compare_vllm.py's
~111M bf16 preset with an 8k context, written once to /tmp) per routing policy. Sessions in groups of `--group`
share a system prompt of `--system` tokens; each turn's prompt is the
session's last prompt, the answer it got and `--user` new tokens, so a
turn's prefix is in the cache of the replica that served the last one.
Sessions start at random moments over the first `--start-spread` seconds, and each sends its
next turn a random think time (exponential, mean `--think-ms`) after its
last answer ended, as users do: open arrivals, not a closed loop in which
a finishing turn frees exactly the replica its session's next turn then
finds least loaded. `--hot N`: besides the sessions, N single-turn requests
that share one hot prefix of `--system` tokens arrive at random moments over
the run (a document many users ask about). Reported per policy: the prompt tokens computed
(looked up minus found in the replicas' prefix caches: a count, free of
the machine's noise), the prefix hit rate, time to first token (p50, p99),
and output throughput. Policies alternate round by round.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from compare_vllm import bench_model

from raylm import LLM, SamplingParams

POLICIES = ("kv_aware", "load", "vllm")
# Each policy with prefix pulls (the default) and without ("-nopull"):
# without, a turn sent away from its cache's replica computes its whole prompt.
VARIANTS = tuple(f"{p}{suffix}" for p in POLICIES for suffix in ("", "-nopull"))


def _trace(args, seed: int) -> dict[str, dict]:
    rng = random.Random(seed)
    systems = [[rng.randrange(5, 1000) for _ in range(args.system)] for _ in range(-(-args.sessions // args.group))]
    sessions = {f"s{i}": {"prompt": list(systems[i // args.group]), "turn": 0} for i in range(args.sessions)}
    hot = [rng.randrange(5, 1000) for _ in range(args.system)]
    for i in range(args.hot):  # single-turn: their one turn adds `--user` tokens to the hot prefix
        sessions[f"h{i}"] = {"prompt": list(hot), "turn": args.turns - 1}
    return sessions


def run(policy: str, args, seed: int) -> dict:
    rng = random.Random(seed + 1)
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    sessions = _trace(args, seed)
    ttft, tokens = [], 0
    with LLM(
        bench_model(args.model),
        data_parallel_size=2,
        data_parallel_backend="mp",
        num_threads=args.threads,
        routing_policy=policy.removesuffix("-nopull"),
        prefix_pull=not policy.endswith("-nopull"),
        kv_cache_memory_bytes=args.kv_cache_mib << 20,
    ) as llm:
        engine, sup = llm.llm_engine, llm.llm_engine.engine_core
        sent: dict[str, float] = {}
        answers: dict[str, list[int]] = {}

        def send(sid: str) -> None:
            session = sessions[sid]
            session["prompt"] += [rng.randrange(5, 1000) for _ in range(args.user)]
            rid = f"{sid}-t{session['turn']}"
            engine.add_request(rid, {"prompt_token_ids": list(session["prompt"])}, params)
            sent[rid] = time.monotonic()

        started = time.monotonic()
        # When each session sends its next turn: sessions start over the first
        # `--start-spread` seconds, hot requests over `--hot-spread`.
        due = {
            sid: started + rng.random() * (args.hot_spread if sid[0] == "h" else args.start_spread) for sid in sessions
        }
        while engine.has_unfinished_requests() or due:
            now = time.monotonic()
            for sid in [s for s, at in due.items() if at <= now]:
                del due[sid]
                send(sid)
            if not engine.has_unfinished_requests():
                time.sleep(0.002)
                continue
            for out in engine.step(stream=True):  # a delta per request that changed
                rid = out.request_id
                new = list(out.outputs[0].token_ids)
                if rid not in answers and new:
                    ttft.append(time.monotonic() - sent[rid])
                answers.setdefault(rid, []).extend(new)
                if out.finished:
                    sid = rid.split("-t")[0]
                    session = sessions[sid]
                    tokens += len(answers[rid])
                    session["prompt"] += answers[rid]
                    session["turn"] += 1
                    if session["turn"] < args.turns:
                        due[sid] = time.monotonic() + rng.expovariate(1000.0 / args.think_ms)
        elapsed = time.monotonic() - started
        stats = sup.aggregate_stats()
    computed = stats.prefix_cache_queries - stats.prefix_cache_hits
    return {
        "policy": policy,
        "computed": computed,
        "queried": stats.prefix_cache_queries,
        "hit_rate": stats.prefix_cache_hits / max(1, stats.prefix_cache_queries),
        "ttft_p50": statistics.median(ttft),
        "ttft_p99": sorted(ttft)[int(0.99 * (len(ttft) - 1))],
        "throughput": tokens / elapsed,
        "requests": len(ttft),
        "computed_per_request": computed / max(1, len(ttft)),
        "pulls": dict(sup.pulls.counts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="sessions sharing one system prompt")
    parser.add_argument("--system", type=int, default=192, help="system prompt tokens")
    parser.add_argument("--user", type=int, default=24, help="new user tokens per turn")
    parser.add_argument("--output", type=int, default=32, help="answer tokens per turn")
    parser.add_argument("--think-ms", type=float, default=300.0, help="mean pause between a session's turns")
    parser.add_argument("--start-spread", type=float, default=1.0, help="seconds over which sessions start")
    parser.add_argument("--hot", type=int, default=0, help="single-turn requests sharing one hot prefix")
    parser.add_argument("--hot-spread", type=float, default=10.0, help="seconds over which hot requests arrive")
    parser.add_argument("--model", default=None, help="a model folder, or 111m-8k (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=1, help="threads per replica")
    parser.add_argument("--kv-cache-mib", type=int, default=64, help="KV cache per replica")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--policies", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    args = parser.parse_args()
    chosen = args.policies.split(",")
    results = {p: [] for p in chosen}
    for round_ in range(args.rounds):
        for policy in chosen:
            r = run(policy, args, seed=round_)
            results[policy].append(r)
            print(
                f"round {round_} {policy:8s}: prompt tokens computed {r['computed']} of {r['queried']} "
                f"({r['computed_per_request']:.0f} a request) "
                f"(hit rate {100 * r['hit_rate']:.1f}%), TTFT p50 {1e3 * r['ttft_p50']:.0f} ms / p99 "
                f"{1e3 * r['ttft_p99']:.0f} ms, {r['throughput']:.0f} output tok/s; pulls {r['pulls']}",
                flush=True,
            )
    base = statistics.median(r["computed"] for r in results.get("load-nopull") or results[chosen[0]])
    for policy in chosen:
        rs = results[policy]
        computed = statistics.median(r["computed"] for r in rs)
        print(
            f"{policy:15s} median of {len(rs)}: computed {computed:.0f} ({base / max(computed, 1):.2f}x fewer "
            f"than the first baseline), TTFT p50 {1e3 * statistics.median(r['ttft_p50'] for r in rs):.0f} ms, "
            f"p99 {1e3 * statistics.median(r['ttft_p99'] for r in rs):.0f} ms, "
            f"{statistics.median(r['throughput'] for r in rs):.0f} output tok/s"
        )


if __name__ == "__main__":
    main()
