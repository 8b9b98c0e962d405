"""An imbalanced load on two replicas, with load rebalancing on and off.

    python benchmarks/bench_rebalance.py [--model small] [--rounds 2]

One engine with two local engine-core processes (data_parallel_size=2,
data_parallel_backend="mp", num_threads=1 each), the bf16 Llama of
`compare_vllm.py --make-model`. 16 requests arrive at once and alternate
long (`--long-tokens`) and short (8 tokens), so routing leaves one core with
every long request once the short ones end; then `--late` requests of 64
tokens arrive every 0.2 s. `--data-parallel-rebalance` on against off
(rounds alternate): P50/P99 time to first token of every request, and of
the gap between consecutive tokens (inter-token latency).
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
from raylm.engine.protocol import EngineCoreRequest


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(folder: str, rebalance: bool, args) -> dict:
    with LLM(
        folder,
        dtype="bfloat16",
        data_parallel_size=2,
        data_parallel_backend="mp",
        num_threads=1,
        kv_cache_memory_bytes=256 << 20,
        data_parallel_rebalance=rebalance,
    ) as llm:
        supervisor = llm.llm_engine.engine_core
        finish = llm.llm_engine.input_processor.finish_params
        vocab = llm.llm_engine.config.model_config.vocab_size
        long_params = finish(SamplingParams(temperature=0, max_tokens=args.long_tokens, ignore_eos=True))
        short_params = finish(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        late_params = finish(SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        prompts = random_prompts(16 + args.late, 32, vocab, seed=1)
        sent: dict[str, float] = {}
        arrivals: dict[str, list[float]] = {}
        for i in range(16):
            rid = f"first-{i}"
            sent[rid] = time.perf_counter()
            params = long_params if i % 2 == 0 else short_params
            supervisor.add_request(EngineCoreRequest(rid, prompts[i], params, None))
        next_late, late = time.perf_counter() + 1.0, 0
        while supervisor.ledger or late < args.late:
            now = time.perf_counter()
            if late < args.late and now >= next_late:
                rid = f"late-{late}"
                sent[rid] = now
                supervisor.add_request(EngineCoreRequest(rid, prompts[16 + late], late_params, None))
                late, next_late = late + 1, now + 0.2
            if not supervisor.ledger:
                time.sleep(0.01)
                continue
            outputs = supervisor.get_output()
            now = time.perf_counter()
            for o in outputs.outputs:
                if o.new_token_ids:
                    arrivals.setdefault(o.request_id, []).append(now)
        ttft = [times[0] - sent[rid] for rid, times in arrivals.items()]
        itl = [b - a for times in arrivals.values() for a, b in zip(times, times[1:])]
        return {
            "ttft_p50": _pct(ttft, 0.5),
            "ttft_p99": _pct(ttft, 0.99),
            "itl_p50": _pct(itl, 0.5),
            "itl_p99": _pct(itl, 0.99),
            "migrated": supervisor.migration_counts["migrated"],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default="small")
    parser.add_argument("--model-root", default="/tmp/raylm_bench_models")
    parser.add_argument("--long-tokens", type=int, default=384)
    parser.add_argument("--late", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    folder = pathlib.Path(args.model_root) / args.model
    if not (folder / "config.json").is_file():
        make_model(args.model, str(folder))
    results: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(args.rounds):
        for name in ("on", "off"):
            r = run(str(folder), name == "on", args)
            results[name].append(r)
            print(
                f"rebalance {name:3s}  TTFT p50 {1e3 * r['ttft_p50']:7.1f} ms p99 {1e3 * r['ttft_p99']:7.1f} ms  "
                f"ITL p50 {1e3 * r['itl_p50']:6.1f} ms p99 {1e3 * r['itl_p99']:6.1f} ms  migrated {r['migrated']}",
                flush=True,
            )
    for name, rows in results.items():
        print(
            f"rebalance {name:3s} median of rounds: "
            + ", ".join(
                f"{key} {1e3 * statistics.median(r[key] for r in rows):.1f} ms"
                for key in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
            )
        )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
