"""Context parallelism (issue 26): time to first token and decode speed of
long requests (one, or --num-requests at once) at CP=1 and CP=2, and the KV capacity of each engine, with the
same KV budget per rank.

    python benchmarks/bench_context_parallel.py --make-model large /tmp/bench_models/llama-111m-8k
    python benchmarks/bench_context_parallel.py --model /tmp/bench_models/llama-111m-8k --prompt-len 4096

Both engines stay open (mp workers) and the rounds alternate between them,
so a busy shared machine loads both alike. Prefix caching is off:
every round computes its prompt. A CP group splits a long prompt's tokens
over its ranks (raylm.model.layers.cp_prefill), each computing its share and
exchanging K/V once per layer; decode attends over each rank's K/V shard.

Here (2026-12-02; 111M bf16, 4096-token prompt, 2 cores shared with other
work at load 4-7; three runs of 3 rounds, alternating with the previous
commit's copy): TTFT at CP=2 over CP=1 1.78x, 2.01x, 1.59x with the prompt
computed whole on each CP rank; 0.58x, 1.33x, 1.02x with it split.
Decode steps at CP=2 (--cp 2 --decode-steps-only, 4096-token prompt, load
3.7-4.5): 0.22x, 0.63x, 0.44x the torch path's time with the C++ kernel's
partial attention (benchmarks/history/context-parallel.md).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from raylm import LLM, SamplingParams
from raylm.model.arch_config import ArchConfig


def _time_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def _decode_step_seconds(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Wall time of each engine step once every request has its first token
    (steps of decode tokens only): the prompts are prefilled first, untimed."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"decode-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    scheduler, times = llm.llm_engine.engine_core.engine_core.scheduler, []
    while engine.has_unfinished_requests():
        decoding = all(rid in scheduler.requests and scheduler.requests[rid].num_output_tokens > 0 for rid in ids)
        start = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
    return times


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument(
        "--make-model",
        nargs=2,
        metavar=("PRESET", "PATH"),
        help="build compare_vllm.py's preset with max_position_embeddings = 8192 first",
    )
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=33, help="decode speed: tokens 2..N")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--num-requests",
        type=int,
        default=1,
        help="requests at once (TTFT: until the last one's first token; decode: all of them)",
    )
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20, help="per rank")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2], help="context parallel sizes to run")
    parser.add_argument(
        "--decode-steps-only",
        action="store_true",
        help="measure only the decode steps' wall time (median per round), no TTFT",
    )
    parser.add_argument("--num-threads", type=int, default=None, help="per rank; default: planned from the cores")
    args = parser.parse_args()
    model = args.model
    if args.make_model:
        from compare_vllm import make_model

        model = str(make_model(args.make_model[0], args.make_model[1], max_position_embeddings=8192))
    if not model:
        parser.error("--model or --make-model")
    vocab = ArchConfig.from_model_dir(model).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    engines = {}
    for cp in args.cp:
        engines[cp] = LLM(
            model,
            dtype=args.dtype,
            context_parallel_size=cp,
            distributed_executor_backend="mp",
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            enable_prefix_caching=False,
            num_threads=args.num_threads,
            max_model_len=args.prompt_len + args.max_tokens,
            max_num_seqs=max(args.num_requests, 1),
        )
    ttft: dict[int, list[float]] = {cp: [] for cp in args.cp}
    decode: dict[int, list[float]] = {cp: [] for cp in args.cp}
    try:
        for llm in engines.values():  # warm-up
            _time_generate(llm, [prompts[0][:64]], 2)
        if args.decode_steps_only:
            step_ms: dict[int, list[float]] = {cp: [] for cp in args.cp}
            for _ in range(args.rounds):
                for cp, llm in engines.items():
                    step_ms[cp].append(1e3 * statistics.median(_decode_step_seconds(llm, prompts, args.max_tokens)))
            for cp in args.cp:
                print(
                    f"CP={cp}: decode step {statistics.median(step_ms[cp]):.2f} ms median "
                    f"(rounds' medians {[round(t, 2) for t in step_ms[cp]]})"
                )
            return
        for _ in range(args.rounds):
            for cp, llm in engines.items():
                first = _time_generate(llm, prompts, 1)
                whole = _time_generate(llm, prompts, args.max_tokens)
                ttft[cp].append(first)
                # Decode time is the difference of two runs; on a noisy machine
                # the second prefill can be faster than the first: no figure then.
                if whole > first:
                    decode[cp].append(len(prompts) * (args.max_tokens - 1) / (whole - first))
        for cp, llm in engines.items():
            cc = llm.llm_engine.engine_core.engine_core.config.cache_config
            print(
                f"CP={cp}: KV capacity {cc.num_blocks * cc.block_size} tokens "
                f"({cc.num_blocks // cp} blocks of {cc.block_size} per rank); "
                f"TTFT {statistics.median(ttft[cp]):.3f} s (rounds {[round(t, 3) for t in ttft[cp]]}); "
                f"decode {_median(decode[cp]):.1f} tok/s (rounds {[round(d, 1) for d in decode[cp]]})"
            )
        if set(args.cp) != {1, 2}:
            return
        print(
            f"CP=2 / CP=1: TTFT {statistics.median(ttft[2]) / statistics.median(ttft[1]):.2f}x, "
            f"decode {_median(decode[2]) / _median(decode[1]):.2f}x"
        )
    finally:
        for llm in engines.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
