"""Offline benchmark of raylm against vLLM (CPU build) on the same model folder and prompts.

raylm runs in this interpreter; vLLM runs in a child process of another venv (--vllm-python).

Usage:
  python benchmarks/compare_vllm.py --make-model small /tmp/bench_models/llama-7m
  python benchmarks/compare_vllm.py --model /tmp/bench_models/llama-7m \\
      --vllm-python /opt/vllm-venv/bin/python

Two workloads, both greedy with ignore_eos so every request makes exactly output_len tokens:
  throughput  num_prompts random prompts of input_len tokens in one generate() call
  latency     one prompt, a warm-up call, then --latency-iters timed calls (average seconds)
The engines alternate round by round (raylm first on even rounds, vLLM first on odd ones) so a
noisy shared machine hurts both alike. Detokenisation is off on both sides: tiny test models
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
import sys
import tempfile
import time
from typing import Any

logger = logging.getLogger("compare_vllm")

RESULT_MARKER = "COMPARE_VLLM_RESULT "

# Llama shapes for the two reference folders. lm_head is untied so the parameter counts come
# out at ~7M and ~110M; head sizes 32 and 64 are ones vLLM's CPU attention accepts.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=688, vocab_size=8192, max_position_embeddings=1024,
                  tie_word_embeddings=False),
    "large": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                  intermediate_size=2816, vocab_size=8192, max_position_embeddings=1024,
                  tie_word_embeddings=False),
}

# Runs inside the vLLM venv. Reads a JSON job file (argv[1]) and prints one marker line of JSON.
# It mirrors `run_workloads` below; the two must measure the same things in the same order.
VLLM_CHILD_SCRIPT = r'''
import json, sys, time
job = json.load(open(sys.argv[1]))
from vllm import LLM, SamplingParams
try:
    from vllm.inputs import TokensPrompt
except ImportError:  # older layouts: a plain dict is accepted too
    TokensPrompt = dict

t0 = time.perf_counter()
llm = LLM(model=job["model"], dtype=job["dtype"], enforce_eager=True, seed=0,
          distributed_executor_backend="uni", skip_tokenizer_init=True,
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
'''


def make_model(preset: str, path: str) -> pathlib.Path:
    """Writes the preset's bf16 Llama folder (deterministic weights, tiny tokenizer)."""
    import torch

    from raylm.testing.tiny_models import make_tiny_model

    folder = make_tiny_model("llama", path, seed=0, dtype=torch.bfloat16, **MODEL_PRESETS[preset])
    config = json.loads((folder / "config.json").read_text())
    logger.info("wrote %s model to %s (%s)", preset, folder,
                {k: config[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")})
    return folder


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Uniform token ids; ids below 16 are skipped so no prompt is made of special tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def run_raylm(job: dict[str, Any], kv_cache_bytes: int, threads: int) -> dict[str, Any]:
    """The raylm side of one round, in this interpreter; same job and result shape as the child."""
    from raylm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(job["model"], dtype=job["dtype"], kv_cache_memory_bytes=kv_cache_bytes,
              max_model_len=job["max_model_len"], max_num_seqs=job["max_num_seqs"],
              enable_prefix_caching=False, num_threads=threads)
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


def allowed_cpu_list() -> str:
    """This process's CPU affinity as vLLM's list syntax, e.g. "0,1"."""
    return ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    """vLLM's CPU backend sizes its KV cache and pins OpenMP threads from these variables."""
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)  # whole GiB: vLLM parses it as an int
    # vLLM 0.32 applies this binding only when it spawns worker processes (mp executor); with
    # "uni" it is inert, but "auto" there would keep one core back for the scheduler process.
    cpus = args.vllm_threads_bind or allowed_cpu_list()
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpus)
    # Without OMP_NUM_THREADS, vLLM's worker drops torch to 1 intra-op thread for serving
    # whatever the core count; setting it gives vLLM the same thread count raylm gets.
    env["OMP_NUM_THREADS"] = str(args.threads)
    # Run the engine core in the calling process, as raylm's LLM does, instead of a second
    # busy process competing for the same cores.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # The child must not pick up this repo's packages or another venv's site-packages.
    env.pop("PYTHONPATH", None)
    return env


def run_vllm(job: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM side of one round, in a child process of the vLLM venv."""
    with tempfile.TemporaryDirectory(prefix="compare_vllm_") as tmp:
        job_path = pathlib.Path(tmp, "job.json")
        job_path.write_text(json.dumps(job))
        script_path = pathlib.Path(tmp, "vllm_child.py")
        script_path.write_text(VLLM_CHILD_SCRIPT)
        # Run from the temp dir so `import vllm` cannot resolve to anything in the caller's cwd.
        proc = subprocess.run([args.vllm_python, str(script_path), str(job_path)], cwd=tmp,
                              env=vllm_env(args), capture_output=True, text=True, timeout=args.vllm_timeout)
    if args.vllm_log:
        with open(args.vllm_log, "a") as log:
            log.write(proc.stdout + proc.stderr)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):])
    log_tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    raise RuntimeError(f"vLLM child exited with code {proc.returncode} and no result:\n{log_tail}")


def summarise(name: str, results: list[dict[str, Any]], job: dict[str, Any]) -> dict[str, float]:
    """Output tokens/s per workload, averaged over rounds (each round counts the tokens it got)."""
    summary: dict[str, float] = {"startup_s": statistics.mean(r["startup_s"] for r in results)}
    if job["throughput_prompts"]:
        rates = [sum(map(len, r["throughput"]["tokens"])) / r["throughput"]["elapsed_s"] for r in results]
        summary["throughput_tok_s"] = statistics.mean(rates)
    if job["latency_prompt"]:
        times = [t for r in results for t in r["latency"]["times_s"]]
        summary["latency_s"] = statistics.mean(times)
        summary["latency_tok_s"] = job["output_len"] / summary["latency_s"]
    logger.info("%s: %s", name, {k: round(v, 3) for k, v in summary.items()})
    return summary


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean length of the common prefix, as a fraction; bf16 kernels differ, so expect < 1 late on."""
    fractions = []
    for x, y in zip(a, b):
        same = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        fractions.append(same / max(len(x), 1))
    return statistics.mean(fractions) if fractions else float("nan")


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
        if "throughput" in workloads else [],
        "latency_prompt": random_prompts(1, args.input_len, vocab_size, args.seed + 1)[0]
        if "latency" in workloads else [],
    }
    kv_cache_bytes = int(args.kv_cache_gib * (1 << 30))
    raylm_results: list[dict[str, Any]] = []
    vllm_results: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        order = ["raylm", "vllm"] if round_index % 2 == 0 else ["vllm", "raylm"]
        for engine in order:
            if engine == "vllm" and args.skip_vllm:
                continue
            logger.info("round %d: %s", round_index, engine)
            if engine == "raylm":
                raylm_results.append(run_raylm(job, kv_cache_bytes, args.threads))
            else:
                vllm_results.append(run_vllm(job, args))

    report: dict[str, Any] = {"model": job["model"], "dtype": args.dtype, "threads": args.threads,
                              "rounds": args.rounds,
                              "num_prompts": args.num_prompts, "input_len": args.input_len,
                              "output_len": args.output_len, "raylm": summarise("raylm", raylm_results, job)}
    if vllm_results:
        report["vllm"] = summarise("vllm", vllm_results, job)
        for key in ("throughput_tok_s", "latency_tok_s"):
            if key in report["raylm"]:
                report[f"ratio_{key}"] = report["raylm"][key] / report["vllm"][key]
        for workload in ("throughput", "latency"):
            if workload in raylm_results[0]:
                report[f"greedy_agreement_{workload}"] = greedy_agreement(
                    raylm_results[0][workload]["tokens"], vllm_results[0][workload]["tokens"])
    return report


def print_report(report: dict[str, Any]) -> None:
    """A small table on stdout (this is a script, so printing is its job)."""
    print(f"\nmodel {report['model']}  dtype {report['dtype']}  threads {report['threads']}  "
          f"rounds {report['rounds']}")
    has_vllm = "vllm" in report
    print(f"{'metric':<34}{'raylm':>12}{'vLLM':>12}{'raylm/vLLM':>12}")
    rows = [("throughput_tok_s", f"throughput out tok/s ({report['num_prompts']}x{report['input_len']}->"
             f"{report['output_len']})"), ("latency_s", "latency avg s, lower=better"),
            ("latency_tok_s", "latency out tok/s (1 prompt)"), ("startup_s", "engine startup s")]
    for key, label in rows:
        if key not in report["raylm"]:
            continue
        ours = report["raylm"][key]
        theirs = report["vllm"][key] if has_vllm else float("nan")
        print(f"{label:<34}{ours:>12.2f}{theirs:>12.2f}{ours / theirs:>12.3f}")
    for key in ("greedy_agreement_throughput", "greedy_agreement_latency"):
        if key in report:
            print(f"{key}: {report[key]:.3f} (mean common-prefix fraction of greedy outputs)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make-model", nargs=2, metavar=("PRESET", "PATH"),
                        help=f"write a benchmark model folder and exit; PRESET is one of {sorted(MODEL_PRESETS)}")
    parser.add_argument("--model", help="HF model folder both engines load")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--vllm-python", default="/opt/vllm-venv/bin/python")
    parser.add_argument("--skip-vllm", action="store_true", help="measure raylm only")
    parser.add_argument("--workloads", nargs="+", default=["throughput", "latency"],
                        choices=["throughput", "latency"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--latency-iters", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="alternating raylm/vLLM rounds")
    parser.add_argument("--seed", type=int, default=1234, help="seed for the prompt token ids")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache GiB for both engines")
    parser.add_argument("--vllm-threads-bind", default=None,
                        help="VLLM_CPU_OMP_THREADS_BIND for the child unless set in the environment "
                             "(default: every CPU in this process's affinity; 'auto' and 'nobind' work too)")
    parser.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds per vLLM child run")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch/OpenMP threads for both engines (default: every allowed CPU); on a "
                             "loaded machine 1 avoids each op waiting for a descheduled OMP thread")
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
