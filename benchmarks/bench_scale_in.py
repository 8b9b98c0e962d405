"""Scale-in 2 -> 1 under long streams: live migration against draining.

    python benchmarks/bench_scale_in.py [--model small] [--streams 24] [--max-tokens 256] [--rounds 2]

One engine with two local engine-core processes (data_parallel_size=2,
data_parallel_backend="mp", num_threads=1 each) and the bf16 Llama of
`compare_vllm.py --make-model`. `--streams` requests of 32 random prompt
tokens and `--max-tokens` output tokens each are spread over both cores;
once each has 8 tokens, `scale(1)`:

  migrate  what raylm does: the removed core's requests move live to the other
  drain    migration switched off: the removed core keeps its requests until
           they finish (what a graceful shutdown does)

Reported per mode: the time from `scale(1)` until the removed core has left
(scale-in time), until every request has finished, and the requests moved.
Rounds alternate the modes.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from compare_vllm import MODEL_PRESETS, make_model, random_prompts

from raylm import LLM, SamplingParams


def run(folder: str, mode: str, args) -> dict:
    with LLM(
        folder,
        dtype="bfloat16",
        data_parallel_size=2,
        data_parallel_backend="mp",
        num_threads=1,
        kv_cache_memory_bytes=256 << 20,
    ) as llm:
        engine, supervisor = llm.llm_engine, llm.llm_engine.engine_core
        if mode == "drain":  # scale-in without migration: the core keeps its requests until they end
            supervisor.migrations.migrate_away = lambda index, reason: 0
            supervisor.migrations.retry_draining = lambda reason_of: None
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        vocab = engine.config.model_config.vocab_size
        for i, prompt in enumerate(random_prompts(args.streams, 32, vocab, seed=0)):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        scaled_at = left_at = None
        while engine.has_unfinished_requests():
            engine.step()
            now = time.perf_counter()
            if scaled_at is None and all(len(e.token_ids) >= 8 for e in supervisor.ledger.values()):
                scaled_at = time.perf_counter()
                supervisor.scale(1)
            if scaled_at is not None and left_at is None and 1 not in supervisor.channels:
                left_at = now
        finished_at = time.perf_counter()
        if left_at is None:
            left_at = finished_at
        return {
            "scale_in_s": left_at - scaled_at,
            "all_done_s": finished_at - scaled_at,
            "migrated": supervisor.migration_counts["migrated"],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default="small")
    parser.add_argument("--model-root", default="/tmp/raylm_bench_models")
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    folder = pathlib.Path(args.model_root) / args.model
    if not (folder / "config.json").is_file():
        make_model(args.model, str(folder))
    results: dict[str, list[dict]] = {"migrate": [], "drain": []}
    for _ in range(args.rounds):
        for mode in ("migrate", "drain"):
            r = run(str(folder), mode, args)
            results[mode].append(r)
            print(
                f"{mode:8s} scale-in {r['scale_in_s']:6.2f} s  all done {r['all_done_s']:6.2f} s  "
                f"migrated {r['migrated']}",
                flush=True,
            )
    for mode, rows in results.items():
        print(
            f"{mode:8s} median scale-in {statistics.median(r['scale_in_s'] for r in rows):6.2f} s, "
            f"all done {statistics.median(r['all_done_s'] for r in rows):6.2f} s"
        )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
