"""raylm against llama.cpp on one machine: the same models, the same thread count, side by side.

This script builds nothing: it takes llama.cpp's binaries (--llamacpp-bin, a folder holding
llama-bench, llama-batched-bench and llama-server, e.g. DEST/bin of
benchmarks/peers/install_llamacpp.sh, llama.cpp as llama-cpp-python 0.3.36 vendors it) and
GGUF files converted from the HF folder raylm loads (benchmarks/peers/convert_to_gguf.py,
then `llama-quantize` for Q8_0 / Q4_K_M); benchmarks/peers/README.md has the steps.

Usage:
  bash benchmarks/peers/install_llamacpp.sh /tmp/peer-llamacpp
  python benchmarks/compare_vllm.py --make-model large /tmp/bench_models/llama-111m
  python benchmarks/peers/convert_to_gguf.py /tmp/peer-llamacpp/src /tmp/bench_models/llama-111m \\
      --outtype bf16 --outfile /tmp/bench_models/llama-111m-bf16.gguf
  /tmp/peer-llamacpp/bin/llama-quantize /tmp/bench_models/llama-111m-bf16.gguf \\
      /tmp/bench_models/llama-111m-Q8_0.gguf Q8_0
  python benchmarks/compare_llamacpp.py --llamacpp-bin /tmp/peer-llamacpp/bin \\
      --model /tmp/bench_models/llama-111m --gguf /tmp/bench_models/llama-111m-bf16.gguf \\
      --gguf /tmp/bench_models/llama-111m-Q8_0.gguf --rounds 3

Each --gguf file is one variant, named by its file type (BF16, Q8_0, Q4_K_M, ...). llama.cpp
loads the file; raylm loads the same file, except for a float file (BF16/F16/F32), where it
loads --model, the HF folder the file was converted from (the same weights, in the format a
raylm user runs them in).

Workloads (--workloads), every one greedy with EOS ignored on raylm's side, random prompt ids:
  decode   batch-1 decode tok/s. llama.cpp: llama-bench tg128 (128 llama_decode calls of one
           token from an empty context, no sampling). raylm: one request with a 1-token prompt,
           (time of 129 output tokens - time of 1) / 128: the 128 decode steps after the first
           token, each with raylm's scheduler and greedy sampler.
  prefill  prompt tok/s at 128 and 512 tokens (--prefill-lens). llama.cpp: llama-bench pp128 /
           pp512 (one prompt pass, no sampling). raylm: N / (time of one request with an
           N-token prompt and max_tokens=1): the prefill plus the first token's sampling.
  one      one request of 128 prompt tokens -> 128 output tokens, seconds. llama.cpp:
           llama-batched-bench B=1, T_PP + T_TG * 127/128: its prompt pass yields the first
           token's logits and it then decodes 128 more; the first 127 of them make the other
           127 tokens raylm counts. raylm: LLM.generate of that one request.
  batch    64 requests x 128 -> 128, output tok/s over the whole run (prefill included): the
           same two sides with B=64 (64 * 128 / (T_PP + T_TG * 127/128) for llama.cpp).
  online   servers at saturation: `llama-server -np 64 -cb` and `raylm serve` in turn, each
           loaded by `raylm bench serve` (64 streaming completions of 128 random token ids ->
           128 tokens, all sent at once): output tok/s and median TTFT. With
           `--online-warm-up`, each server first serves one such load of other prompts
           (`--seed 1`), so that neither is measured on its first requests (raylm's first
           steps build and touch what later steps reuse) and neither can reuse a measured
           prompt's cache; without it, each is measured on its first load.

Both engines get --threads threads (default 2): llama.cpp `-t N -tb N`, raylm
`num_threads=N`; online, `raylm serve` runs at its own default (on a small machine it
keeps a core for its front end and engine loop, one decode thread on 2 cores) unless
`--online-raylm-threads N` is given, and llama-server gets --threads (its own default is
one thread per core). raylm runs in bfloat16 activations with prefix caching off. Every
row is the mean over --rounds rounds with the spread ((max - min) / mean); the engines
alternate round by round (raylm first on even rounds, llama.cpp first on odd ones),
and inside a round each engine runs every workload of one variant back to back, so a busy
shared machine hurts both alike. The "speed" column is raylm / llama.cpp in speed: tok/s
over tok/s, or llama.cpp's seconds over raylm's; above 1, raylm is faster.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from compare_vllm import mean_and_spread, random_prompts
from compare_vllm_online import stop, wait_healthy

logger = logging.getLogger("compare_llamacpp")

WORKLOADS = ("decode", "prefill", "one", "batch", "online")
FLOAT_TYPES = ("ALL_F32", "MOSTLY_F16", "MOSTLY_BF16")
ONE_LEN = 128  # prompt and output tokens of the one-request and batch workloads
BATCH = 64


@dataclass(frozen=True)
class Variant:
    name: str  # the GGUF file type: BF16, Q8_0, Q4_K_M, ...
    gguf: str  # what llama.cpp loads
    raylm_model: str  # what raylm loads: the same file, or the HF folder for a float file


@dataclass(frozen=True)
class Metric:
    key: str
    title: str
    unit: str
    higher_is_better: bool


def metrics_for(workloads: list[str], prefill_lens: list[int]) -> list[Metric]:
    out = []
    if "decode" in workloads:
        out.append(Metric("decode_tok_s", "batch-1 decode", "tok/s", True))
    if "prefill" in workloads:
        out += [Metric(f"prefill{n}_tok_s", f"prefill {n}", "tok/s", True) for n in prefill_lens]
    if "one" in workloads:
        out.append(Metric("one_s", f"one request {ONE_LEN}/{ONE_LEN}", "s", False))
    if "batch" in workloads:
        out.append(Metric("batch_tok_s", f"{BATCH} x {ONE_LEN}/{ONE_LEN}", "output tok/s", True))
    if "online" in workloads:
        out += [
            Metric("online_tok_s", f"online {BATCH} streams", "output tok/s", True),
            Metric("online_ttft_ms", f"online {BATCH} streams, median TTFT", "ms", False),
        ]
    return out


def gguf_variant(path: str, hf_model: str) -> Variant:
    import gguf

    reader = gguf.GGUFReader(path)
    field = reader.fields.get("general.file_type")
    if field is None:
        raise ValueError(f"--gguf {path}: no general.file_type in its metadata")
    file_type = gguf.LlamaFileType(int(field.parts[field.data[0]][0]))
    name = file_type.name.removeprefix("MOSTLY_").removeprefix("ALL_")
    return Variant(name, path, hf_model if file_type.name in FLOAT_TYPES else path)


# ---- llama.cpp ------------------------------------------------------------------------


def _run_tool(args: argparse.Namespace, tool: str, tool_args: list[str]) -> str:
    command = [str(pathlib.Path(args.llamacpp_bin, tool)), *tool_args]
    logger.debug("running %s", " ".join(command))
    proc = subprocess.run(command, capture_output=True, text=True, timeout=args.tool_timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"{tool} exited with code {proc.returncode}:\n{tail}")
    return proc.stdout


def no_repack(variant: Variant) -> bool:
    """Whether llama.cpp must not repack this file's weights: this VM's build dies with
    SIGILL in its repacked (AMX int8) path on quantized files when a batch has more than
    one row; batch-1 decode runs repacked as is."""
    return variant.name not in ("F32", "F16", "BF16")


def llamacpp_offline(args: argparse.Namespace, variant: Variant) -> dict[str, float]:
    threads = ["-t", str(args.threads)]
    result: dict[str, float] = {}
    if {"decode", "prefill"} & set(args.workloads):
        # Decode and prefill in separate calls where prefill must not repack (decode may).
        runs = [
            (
                args.prefill_lens if "prefill" in args.workloads else [0],
                [ONE_LEN] if "decode" in args.workloads else [0],
                [],
            )
        ]
        if no_repack(variant) and "prefill" in args.workloads:
            runs = [([0], [ONE_LEN], [])] if "decode" in args.workloads else []
            runs.append((args.prefill_lens, [0], ["--repack", "0"]))
        tests = []
        for prompts, gens, repack in runs:
            out = _run_tool(
                args,
                "llama-bench",
                [
                    "-m",
                    variant.gguf,
                    *threads,
                    "-r",
                    str(args.repetitions),
                    "-p",
                    ",".join(map(str, prompts)),
                    "-n",
                    ",".join(map(str, gens)),
                    *repack,
                    "-o",
                    "json",
                ],
            )
            tests += json.loads(out)
        for test in tests:
            if test["n_gen"] == ONE_LEN and test["n_prompt"] == 0:
                result["decode_tok_s"] = test["avg_ts"]
            elif test["n_prompt"] and test["n_gen"] == 0:
                result[f"prefill{test['n_prompt']}_tok_s"] = test["avg_ts"]
    batches = [b for w, b in (("one", 1), ("batch", BATCH)) if w in args.workloads]
    if batches:
        out = _run_tool(
            args,
            "llama-batched-bench",
            [
                "-m",
                variant.gguf,
                *threads,
                "-tb",
                str(args.threads),
                "-c",
                str(BATCH * 2 * ONE_LEN),
                "-npp",
                str(ONE_LEN),
                "-ntg",
                str(ONE_LEN),
                "-npl",
                ",".join(map(str, batches)),
                *(["-nr"] if no_repack(variant) else []),
                "--output-format",
                "jsonl",
            ],
        )
        rows = {row["pl"]: row for row in map(json.loads, (x for x in out.splitlines() if x.startswith("{")))}
        if set(rows) != set(batches):
            raise RuntimeError(f"llama-batched-bench reported batches {sorted(rows)}, not {batches}")
        for b, row in rows.items():
            # Time to ONE_LEN output tokens: the prompt pass gives the first one.
            seconds = row["t_pp"] + row["t_tg"] * (ONE_LEN - 1) / ONE_LEN
            if b == 1:
                result["one_s"] = seconds
            else:
                result["batch_tok_s"] = b * ONE_LEN / seconds
    return result


def llama_server_command(args: argparse.Namespace, variant: Variant) -> list[str]:
    # One slot per stream, each with room for its prompt and output.
    return [
        str(pathlib.Path(args.llamacpp_bin, "llama-server")),
        "-m",
        variant.gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "-np",
        str(BATCH),
        "-cb",
        "-c",
        str(BATCH * (2 * ONE_LEN + 64)),
        *(["-nr"] if no_repack(variant) else []),
    ]


# ---- raylm ----------------------------------------------------------------------------


def raylm_offline(args: argparse.Namespace, variant: Variant, vocab_size: int, round_index: int) -> dict[str, float]:
    """Every offline workload on one LLM, in this interpreter."""
    from raylm import LLM, SamplingParams

    llm = LLM(
        variant.raylm_model,
        dtype="bfloat16",
        num_threads=args.threads,
        enable_prefix_caching=False,
        max_model_len=max([*args.prefill_lens, 2 * ONE_LEN]) + 16,
        max_num_seqs=BATCH,
        kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
    )
    seed = iter(range(10_000 * (round_index + 1), 10_000 * (round_index + 2)))  # fresh prompts each call

    def prompts(n: int, length: int) -> list[list[int]]:
        return random_prompts(n, length, vocab_size, next(seed))

    def timed(batch: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return elapsed

    result: dict[str, float] = {}
    try:
        timed(prompts(2, 16), 8)  # warm-up: first-call allocations and caches
        if "decode" in args.workloads:
            rates = []
            for _ in range(args.repetitions):
                prompt = prompts(1, 1)
                timed(prompt, 1)
                rates.append(ONE_LEN / (timed(prompt, ONE_LEN + 1) - timed(prompt, 1)))
            result["decode_tok_s"] = statistics.mean(rates)
        if "prefill" in args.workloads:
            for n in args.prefill_lens:
                result[f"prefill{n}_tok_s"] = statistics.mean(
                    n / timed(prompts(1, n), 1) for _ in range(args.repetitions)
                )
        if "one" in args.workloads:
            result["one_s"] = statistics.mean(timed(prompts(1, ONE_LEN), ONE_LEN) for _ in range(args.repetitions))
        if "batch" in args.workloads:
            result["batch_tok_s"] = BATCH * ONE_LEN / timed(prompts(BATCH, ONE_LEN), ONE_LEN)
    finally:
        llm.shutdown()
    return result


def raylm_server_command(args: argparse.Namespace, variant: Variant) -> list[str]:
    return [
        sys.executable,
        "-m",
        "raylm.entrypoints.cli",
        "serve",
        variant.raylm_model,
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(2 * ONE_LEN + 64),
        "--no-enable-prefix-caching",
        *(["--num-threads", str(args.online_raylm_threads)] if args.online_raylm_threads else []),
    ]


# ---- both -----------------------------------------------------------------------------


def online(args: argparse.Namespace, command: list[str], workdir: pathlib.Path, label: str) -> dict[str, float]:
    """Start a server, load it with `raylm bench serve` at saturation, stop it."""
    with open(workdir / f"{label}.server.log", "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(args.port, server, args.tool_timeout)
            result_path = workdir / f"{label}.json"
            loads = [(0, result_path)]
            if args.online_warm_up:
                loads.insert(0, (1, workdir / f"{label}.warm-up.json"))
            for seed, output in loads:
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
                        str(BATCH),
                        "--random-input-len",
                        str(ONE_LEN),
                        "--random-output-len",
                        str(ONE_LEN),
                        "--seed",
                        str(seed),
                        "--output-json",
                        str(output),
                    ],
                    check=True,
                    stdout=subprocess.DEVNULL,
                    timeout=args.tool_timeout,
                )
        finally:
            stop(server)
    result = json.loads(result_path.read_text())
    expected = BATCH * ONE_LEN
    if result["failed"] or result["total_output_tokens"] != expected:
        raise RuntimeError(
            f"{label}: {result['failed']} requests failed, {result['total_output_tokens']} of "
            f"{expected} tokens came back ({result['errors']}; log in {workdir})"
        )
    return {"online_tok_s": result["output_throughput"], "online_ttft_ms": result["median_ttft_ms"]}


def run_round(
    args: argparse.Namespace, variant: Variant, engine: str, vocab_size: int, round_index: int, workdir: pathlib.Path
) -> dict[str, float]:
    logger.info("round %d, %s: %s", round_index, variant.name, engine)
    if engine == "raylm":
        result = raylm_offline(args, variant, vocab_size, round_index) if set(args.workloads) - {"online"} else {}
        command = raylm_server_command(args, variant)
    else:
        result = llamacpp_offline(args, variant)
        command = llama_server_command(args, variant)
    if "online" in args.workloads:
        result.update(online(args, command, workdir, f"{variant.name}-{engine}-{round_index}"))
    logger.info("round %d, %s, %s: %s", round_index, variant.name, engine, {k: round(v, 3) for k, v in result.items()})
    return result


def compare(args: argparse.Namespace) -> dict[str, Any]:
    vocab_size = int(json.loads(pathlib.Path(args.model, "config.json").read_text())["vocab_size"])
    variants = [gguf_variant(path, args.model) for path in args.gguf]
    rounds: dict[str, dict[str, list[dict[str, float]]]] = {v.name: {"raylm": [], "llama.cpp": []} for v in variants}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="compare_llamacpp-") as tmp:
        for r in range(args.rounds):
            for variant in variants:
                for engine in ("raylm", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "raylm"):
                    result = run_round(args, variant, engine, vocab_size, r, pathlib.Path(tmp))
                    rounds[variant.name][engine].append(result)
    summary = {
        name: {
            engine: {
                key: dict(
                    zip(("mean", "spread"), mean_and_spread([one[key] for one in results])),
                    rounds=[one[key] for one in results],
                )
                for key in results[0]
            }
            for engine, results in per_engine.items()
        }
        for name, per_engine in rounds.items()
    }
    return {
        "model": args.model,
        "variants": [v.__dict__ for v in variants],
        "threads": args.threads,
        "online_raylm_threads": args.online_raylm_threads,
        "online_warm_up": args.online_warm_up,
        "rounds": args.rounds,
        "workloads": args.workloads,
        "prefill_lens": args.prefill_lens,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "summary": summary,
    }


def print_report(report: dict[str, Any]) -> None:
    """A markdown table on stdout (this is a script, so printing is its job)."""
    print(
        f"\nmodel {report['model']}  threads {report['threads']} (both engines)  rounds {report['rounds']}  "
        f"load average before/after {report['load_average_before'][0]:.2f}/{report['load_average_after'][0]:.2f}\n"
    )
    print("| variant | workload | llama.cpp (spread) | raylm (spread) | speed raylm / llama.cpp |")
    print("|---|---|---|---|---|")
    for name, per_engine in report["summary"].items():
        for metric in metrics_for(report["workloads"], report["prefill_lens"]):
            theirs, ours = per_engine["llama.cpp"].get(metric.key), per_engine["raylm"].get(metric.key)
            if theirs is None or ours is None:
                continue
            digits = 3 if metric.unit == "s" else 0
            speed = ours["mean"] / theirs["mean"] if metric.higher_is_better else theirs["mean"] / ours["mean"]
            print(
                f"| {name} | {metric.title} ({metric.unit}) | {theirs['mean']:.{digits}f} ({theirs['spread']:.0%}) "
                f"| {ours['mean']:.{digits}f} ({ours['spread']:.0%}) | {speed:.2f} |"
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--llamacpp-bin", required=True, help="folder with llama-bench, llama-batched-bench, llama-server"
    )
    parser.add_argument("--model", required=True, help="the HF folder the GGUF files were converted from")
    parser.add_argument(
        "--gguf",
        action="append",
        required=True,
        metavar="FILE",
        help="a GGUF file of the model (repeat for each variant: BF16, Q8_0, Q4_K_M, ...)",
    )
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--prefill-lens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--threads", type=int, default=2, help="threads for both engines")
    parser.add_argument(
        "--online-raylm-threads",
        type=int,
        help="`raylm serve --num-threads` in the online workload; default: raylm's own",
    )
    parser.add_argument(
        "--online-warm-up",
        action="store_true",
        help="online: measure each server's second load (the first, other prompts, warms it up)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating raylm / llama.cpp rounds")
    parser.add_argument(
        "--repetitions",
        type=int,
        default=3,
        help="timed repetitions inside a round (llama-bench -r; raylm's decode, prefill and one-request timings)",
    )
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="raylm's offline KV cache")
    parser.add_argument("--port", type=int, default=8111)
    parser.add_argument(
        "--tool-timeout", type=float, default=900.0, help="seconds for one llama.cpp tool run or server"
    )
    parser.add_argument("--json-out", help="also write every round's figures here")
    args = parser.parse_args(argv)
    for tool in ("llama-bench", "llama-batched-bench", "llama-server"):
        if not pathlib.Path(args.llamacpp_bin, tool).exists():
            parser.error(f"--llamacpp-bin {args.llamacpp_bin} has no {tool}")
    if not pathlib.Path(args.model, "config.json").exists():
        parser.error(f"--model {args.model}: no config.json (an HF model folder is expected)")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    report = compare(args)
    print_report(report)
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
