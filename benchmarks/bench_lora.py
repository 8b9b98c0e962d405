"""Multi-LoRA throughput (issue 53, Performance): 64 requests x 128 prompt
tokens / 128 output tokens (greedy, ignore_eos, one offline
`LLM.generate`), the requests spread round-robin over 1, 8 and 32 rank-16
adapters, against the base model alone; and batch-1 decode (one request,
128/128) of the base model against one adapter.

    python benchmarks/bench_lora.py --rounds 3 --threads 1 [--model 111m-8k] [--max-loras 32] [--json out.json]

(--threads 1 on a shared 2-vCPU machine: with two threads per engine the
per-round rates swung 10x there, OpenMP teams waiting on preempted threads;
benchmarks/results/lora.json was made so.)

Adapters: random rank-16 weights in PEFT's format on every projection (q,
k, v, o, gate, up, down), written once by PEFT
(raylm.testing.lora_oracle.make_tiny_adapter) under /tmp/raylm-bench-lora/.

Two engines live side by side in this process (uni executor, prefix
caching off, the model's dtype: float32 for the embedded model): one
without LoRA (what a user who does not ask for it gets), and one with
enable_lora=True, --max-loras slots (32 by default, so that the 32-adapter
case fits one step) and max_lora_rank=16, which runs the base model (no
lora_request) and every adapter case. Every round runs each case once, the
order reversed on odd rounds, so that a burst of load from elsewhere falls
on all alike; all adapters are loaded by a warm-up first (the timed rounds
measure steady state, no disk reads). Reported per case: output tok/s
(median over rounds, wall clock, prefill included) and its ratio to the
base model on the engine without LoRA (median and min-max of the per-round
ratios), and by CPU time of this process (less exposed than the wall clock
to other work on a shared machine). Greedy tokens of the base model must be
the same on both engines; an adapter case's differ from them (the adapters
are applied).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from compare_vllm import bench_model, random_prompts

from raylm import LLM, SamplingParams
from raylm.config import DEFAULT_MODEL_DIR
from raylm.lora.request import LoRARequest

RANK = 16
ADAPTER_ROOT = pathlib.Path("/tmp/raylm-bench-lora")

# (case, engine, adapters its requests spread over; 0: the base model)
BATCH_CASES = (
    ("base, no enable_lora", "plain", 0),
    ("base, enable_lora", "lora", 0),
    ("1 adapter", "lora", 1),
    ("8 adapters", "lora", 8),
    ("32 adapters", "lora", 32),
)
SINGLE_CASES = (
    ("base, no enable_lora", "plain", 0),
    ("base, enable_lora", "lora", 0),
    ("1 adapter", "lora", 1),
)
REFERENCE = "base, no enable_lora"


def _adapters(model_dir: str, count: int) -> list[LoRARequest]:
    """`count` random rank-16 adapters of the model, written once."""
    from raylm.testing.lora_oracle import make_tiny_adapter  # PEFT: only here

    root = ADAPTER_ROOT / f"{pathlib.Path(model_dir).name}-r{RANK}"
    requests = []
    for i in range(1, count + 1):
        folder = root / f"a{i}"
        if not (folder / "adapter_model.safetensors").exists():
            make_tiny_adapter(model_dir, folder, seed=i, rank=RANK, alpha=2.0 * RANK)
        requests.append(LoRARequest(f"a{i}", i, str(folder)))
    return requests


def _kv_bytes(model_dir: str, tokens: int) -> int:
    c = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4  # float32: an upper bound
    return int(per_token * tokens * 1.25)


def _engines(model: str | None, model_dir: str, args) -> dict[str, LLM]:
    settings = dict(
        model=model,
        kv_cache_memory_bytes=_kv_bytes(model_dir, args.requests * (args.input_len + args.output_len)),
        max_num_seqs=args.requests,
        enable_prefix_caching=False,  # the same prompts every round: each must be computed
        num_threads=args.threads,
        dtype=args.dtype,
    )
    return {
        "plain": LLM(**settings),
        "lora": LLM(enable_lora=True, max_loras=args.max_loras, max_lora_rank=RANK, **settings),
    }


def _generate(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None], tokens: int) -> tuple:
    """(wall seconds, CPU seconds of this process, each request's tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return wall, cpu, [list(o.outputs[0].token_ids) for o in outs]


def _spread(adapters: list[LoRARequest], count: int, requests: int) -> list[LoRARequest | None]:
    """Requests round-robin over the first `count` adapters (0: none)."""
    return [adapters[i % count] if count else None for i in range(requests)]


def run(args) -> dict:
    model_dir = bench_model(args.model) or str(DEFAULT_MODEL_DIR)
    needed = max(count for _, _, count in BATCH_CASES)
    if args.max_loras < needed:
        cases = tuple(c for c in BATCH_CASES if c[2] <= args.max_loras)
    else:
        cases = BATCH_CASES
    adapters = _adapters(model_dir, max(c[2] for c in cases))
    prompts = random_prompts(
        args.requests,
        args.input_len,
        json.loads((pathlib.Path(model_dir) / "config.json").read_text())["vocab_size"],
        seed=0,
    )
    engines = _engines(bench_model(args.model), model_dir, args)
    engine_dtype = engines["lora"].llm_engine.config.model_config.dtype
    workloads = {"batch": (cases, prompts), "single": (SINGLE_CASES, prompts[:1])}
    rates = {(w, clock, case): [] for w, (cs, _) in workloads.items() for clock in ("wall", "cpu") for case, _, _ in cs}
    outputs: dict[tuple, list] = {}
    load = {"before": os.getloadavg()}
    try:
        # Warm-up: first-call allocations, and every adapter read from disk
        # into the lora engine's host memory and slots.
        _generate(engines["plain"], prompts[:2], [None, None], 8)
        _generate(engines["lora"], prompts[: len(adapters)], adapters, 4)
        for r in range(args.rounds):
            for workload, (cs, ps) in workloads.items():
                order = cs if r % 2 == 0 else tuple(reversed(cs))
                for case, engine, count in order:
                    wall, cpu, out = _generate(engines[engine], ps, _spread(adapters, count, len(ps)), args.output_len)
                    produced = sum(len(t) for t in out)
                    rates[(workload, "wall", case)].append(produced / wall)
                    rates[(workload, "cpu", case)].append(produced / cpu)
                    outputs[(workload, case)] = out
            print(f"round {r + 1}/{args.rounds} done, load {os.getloadavg()}", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    load["after"] = os.getloadavg()
    return _summary(args, workloads, rates, outputs, load, engine_dtype)


def _summary(args, workloads, rates, outputs, load, engine_dtype) -> dict:
    results = {}
    for workload, (cs, _) in workloads.items():
        base_out = outputs[(workload, REFERENCE)]
        for case, engine, count in cs:
            row = {"engine": engine, "adapters": count}
            for clock in ("wall", "cpu"):
                mine, base = rates[(workload, clock, case)], rates[(workload, clock, REFERENCE)]
                ratios = [m / b for m, b in zip(mine, base)]
                row[clock] = {
                    "tok_s": statistics.median(mine),
                    "tok_s_rounds": mine,
                    "ratio": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                }
            row["same_tokens_as_base"] = outputs[(workload, case)] == base_out
            results[f"{workload}: {case}"] = row
    return {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": args.model or "embedded",
        "dtype": str(engine_dtype),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "loadavg": load,
        "results": results,
    }


def _report(summary: dict) -> None:
    s = summary["settings"]
    print(
        f"model {summary['model']} ({summary['dtype']}), {s['requests']} x {s['input_len']}/{s['output_len']} "
        f"and batch-1 1 x {s['input_len']}/{s['output_len']}, rank {RANK}, "
        f"max_loras {s['max_loras']}, {s['rounds']} rounds; "
        f"load average before {summary['loadavg']['before']}, after {summary['loadavg']['after']}"
    )
    for name, row in summary["results"].items():
        wall, cpu = row["wall"], row["cpu"]
        print(
            f"{name:>34}: {wall['tok_s']:7.1f} tok/s, {wall['ratio']:.2f}x base "
            f"({wall['ratio_min']:.2f}-{wall['ratio_max']:.2f}); by CPU time {cpu['ratio']:.2f}x "
            f"({cpu['ratio_min']:.2f}-{cpu['ratio_max']:.2f}); same tokens as base: {row['same_tokens_as_base']}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model folder or 111m-8k (compare_vllm.bench_model); default: the embedded model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-loras", type=int, default=32, help="slots of the LoRA engine (cases above it are skipped)")
    p.add_argument("--dtype", default="auto", help="auto: the model's (float32 for the embedded model)")
    p.add_argument("--threads", type=int, help="torch threads of each engine (default: planned)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    summary = run(args)
    _report(summary)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
