"""Decode bursts against single steps (docs/cpu.md, "The decode path"): batch-1 decode speed
and the tokens, with each --num-scheduler-steps value in turn.

Each run is its own process (one LLM): one greedy request of --tokens tokens after
a 1-token prompt, repeated for --seconds; it prints output tokens/s, and the token
ids of a mixed batch of 16 requests (greedy and seeded random), which must be the
same for every setting. Settings alternate over --rounds, so a noisy machine
shifts them alike.

    python benchmarks/bench_decode_bursts.py --model /tmp/bench_models/llama-7m
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def one_run(model: str, steps: int, seconds: float, threads: int, tokens: int) -> dict:
    from raylm import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="bfloat16",
        num_threads=threads,
        enable_prefix_caching=False,
        max_model_len=512,
        kv_cache_memory_bytes=1 << 28,
        num_scheduler_steps=steps,
    )
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [5]}], params, use_tqdm=False)  # warm-up
        start, runs = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            llm.generate([{"prompt_token_ids": [5 + runs % 50]}], params, use_tqdm=False)
            runs += 1
        rate = runs * tokens / (time.perf_counter() - start)
        mixed = [
            SamplingParams(max_tokens=20 + 7 * i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
            for i in range(16)
        ]
        outs = llm.generate([{"prompt_token_ids": [i + 3, i + 9]} for i in range(16)], mixed, use_tqdm=False)
        return {"tok_s": rate, "tokens": [o.outputs[0].token_ids for o in outs]}
    finally:
        llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, nargs="+", default=[1, 8], help="--num-scheduler-steps values")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--tokens", type=int, default=129)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one-run", type=int, help=argparse.SUPPRESS)  # internal: a child process's setting
    args = p.parse_args()
    if args.one_run is not None:
        print(json.dumps(one_run(args.model, args.one_run, args.seconds, args.threads, args.tokens)))
        return
    rates: dict[int, list[float]] = {steps: [] for steps in args.steps}
    reference = None
    for _ in range(args.rounds):
        for steps in args.steps:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--model",
                    args.model,
                    "--one-run",
                    str(steps),
                    "--seconds",
                    str(args.seconds),
                    "--threads",
                    str(args.threads),
                    "--tokens",
                    str(args.tokens),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            result = json.loads(out.stdout.strip().splitlines()[-1])
            rates[steps].append(result["tok_s"])
            reference = reference or result["tokens"]
            same = result["tokens"] == reference
            print(
                f"--num-scheduler-steps {steps}: {result['tok_s']:.0f} tok/s, mixed batch's tokens "
                f"{'the same' if same else 'DIFFERENT'}",
                flush=True,
            )
            if not same:
                raise SystemExit("the tokens differ between settings")
    for steps, values in rates.items():
        print(f"steps {steps}: " + ", ".join(f"{v:.0f}" for v in values) + " tok/s")


if __name__ == "__main__":
    main()
