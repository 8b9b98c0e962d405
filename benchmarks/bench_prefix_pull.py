"""A prompt's cached prefix pulled from the replica that holds it against
computed again (issue 49's pull): time to first token of a request sent to
the replica without the prefix, with prefix pulls on (the default) and off.

    python benchmarks/bench_prefix_pull.py [--prefix-tokens 480] [--rounds 5] [--network]
    python benchmarks/bench_prefix_pull.py --doomed --rounds 3   # the holder killed mid-pull (3: the restart budget)

Two local replicas (`-dp 2 --data-parallel-backend mp`) of the embedded
model (512 positions). Each round: a request with a fresh prefix of
`--prefix-tokens` tokens (and a short suffix) is pinned to replica 1 (its
blocks stay cached there), then one sharing that prefix is pinned to
replica 0; its TTFT is timed. `--network`: the pull takes the sealed network
path (RAYLM_MIGRATION_NETWORK=1) instead of shared memory. Reported per
mode: TTFT p50 and spread, and with pulls on the pull's own time (routing to
the destination's import, the supervisor's clock) and its bytes.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from compare_vllm import bench_model

from raylm import LLM, SamplingParams

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _ttft(llm: LLM, rid: str, prompt: list[int], rank: int) -> float:
    engine = llm.llm_engine
    started = time.monotonic()
    engine.add_request(rid, {"prompt_token_ids": prompt}, ONE_TOKEN, data_parallel_rank=rank)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.monotonic()
    return (first or time.monotonic()) - started


def _two_replicas(model: str | None, threads: int, **settings) -> LLM:
    """Two local replicas (`-dp 2 --data-parallel-backend mp`): the embedded
    model in float32, another in its own dtype."""
    return LLM(
        model,
        dtype="float32" if model is None else "auto",
        data_parallel_size=2,
        data_parallel_backend="mp",
        num_threads=threads,
        **settings,
    )


def run(prefix_pull: bool, prefix_tokens: int, rounds: int, threads: int, model: str | None = None) -> dict:
    with _two_replicas(model, threads, prefix_pull=prefix_pull) as llm:
        sup = llm.llm_engine.engine_core
        ttfts, ended = [], []
        take = sup.pulls.take_events

        def taking():  # the pulls' ends, as the supervisor passes them up
            events = take()
            ended.extend(events)
            return events

        sup.pulls.take_events = taking
        for r in range(rounds + 1):  # the first round warms both replicas up
            prefix = [(31 * r + 7 * j) % 3000 + 100 for j in range(prefix_tokens)]  # within every model's vocabulary
            _ttft(llm, f"hold-{r}", prefix + [5, 6], rank=1)
            seconds = _ttft(llm, f"ask-{r}", prefix + [9, 10, 11], rank=0)
            if r:
                ttfts.append(seconds)
            else:
                ended.clear()
    pull_seconds = [e.seconds for e in ended if e.seconds is not None]
    return {"ttfts": ttfts, "counts": dict(sup.pulls.counts), "bytes": sup.pulls.bytes_pulled, "pull_s": pull_seconds}


def doomed(prefix_tokens: int, rounds: int, threads: int, model: str | None) -> list[tuple[float, str]]:
    """`--doomed`: the holder is stopped (SIGSTOP) as the pull starts, then
    killed; per round, the seconds from the kill to the pull's fallback (the
    request sent to compute its prompt) and its outcome: `holder_gone` once
    the death is seen, or `timeout` when the export deadline (the
    destination's estimated recompute time, raylm.engine.pull_estimate)
    comes first."""
    import signal

    seconds, holder = [], None
    with _two_replicas(model, threads) as llm:
        engine, sup = llm.llm_engine, llm.llm_engine.engine_core
        for r in range(rounds):
            while len(sup.channels) < 2 or getattr(sup.launcher._processes.get(1), "pid", holder) == holder:
                engine.step()  # the killed holder's replacement, serving
                time.sleep(0.01)
            prefix = [(29 * r + 5 * j) % 3000 + 100 for j in range(prefix_tokens)]
            _ttft(llm, f"hold-{r}", prefix + [5, 6], rank=1)
            holder = sup.launcher._processes[1].pid
            os.kill(holder, signal.SIGSTOP)
            before = dict(sup.pulls.counts)
            engine.add_request(f"ask-{r}", {"prompt_token_ids": prefix + [9, 10]}, ONE_TOKEN, data_parallel_rank=0)
            assert len(sup.pulls) == 1, "no pull started"
            killed = time.monotonic()
            os.kill(holder, signal.SIGKILL)
            while len(sup.pulls):
                engine.step()
            ended = [k for k, v in sup.pulls.counts.items() if k != "started" and v > before.get(k, 0)]
            seconds.append((time.monotonic() - killed, ",".join(ended)))
            while engine.has_unfinished_requests():
                engine.step()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=480)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="threads per replica")
    parser.add_argument("--network", action="store_true", help="the sealed network path")
    parser.add_argument("--model", default=None, help="a model folder, or 111m-8k (default: the embedded model)")
    parser.add_argument("--doomed", action="store_true", help="time a doomed pull's fallback instead")
    args = parser.parse_args()
    if args.doomed:
        ends = doomed(args.prefix_tokens, args.rounds, args.threads, bench_model(args.model))
        times = [t for t, _ in ends]
        print(f"outcomes: {[outcome for _, outcome in ends]}")
        print(
            f"kill of the holder mid-pull to the request's fallback: p50 {1000 * statistics.median(times):.1f} ms "
            f"(min {1000 * min(times):.1f}, max {1000 * max(times):.1f}, n={len(times)})"
        )
        return
    if args.network:
        os.environ["RAYLM_MIGRATION_NETWORK"] = "1"
    results = {}
    for mode in ("recompute", "pull", "recompute", "pull"):  # alternating: the machine is shared
        r = run(mode == "pull", args.prefix_tokens, args.rounds, args.threads, bench_model(args.model))
        results.setdefault(mode, {"ttfts": [], "counts": {}, "bytes": 0, "pull_s": []})
        results[mode]["ttfts"] += r["ttfts"]
        results[mode]["pull_s"] += r["pull_s"]
        for k, v in r["counts"].items():
            results[mode]["counts"][k] = results[mode]["counts"].get(k, 0) + v
        results[mode]["bytes"] += r["bytes"]
    for mode, r in results.items():
        t = sorted(r["ttfts"])
        print(
            f"{mode:9s} TTFT p50 {1000 * statistics.median(t):7.1f} ms (min {1000 * t[0]:.1f}, max {1000 * t[-1]:.1f}, "
            f"n={len(t)}); pulls {r['counts']}; bytes pulled {r['bytes']}"
            + (f"; the pull itself p50 {1000 * statistics.median(r['pull_s']):.1f} ms" if r["pull_s"] else "")
        )
    ratio = statistics.median(results["pull"]["ttfts"]) / statistics.median(results["recompute"]["ttfts"])
    print(f"pull / recompute TTFT p50: {ratio:.2f}")


if __name__ == "__main__":
    main()
