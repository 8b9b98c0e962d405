"""One request (128 prompt tokens -> 128 output tokens, greedy, bf16) through raylm's three
CPU decode paths, switched round by round in one process so a noisy machine hurts all alike:

  oneDNN, modules   oneDNN's packed matmul at every row count, the layers module by module
                    (what raylm did before csrc/bf16_gemm.cpp)
  kernel, modules   raylm's packed bf16 kernel for up to 4 rows, the layers module by module
  kernel, one call  the same kernel, and a decode step's layers in one C++ call (the default)

  python benchmarks/bench_decode_paths.py /tmp/bench_models/llama-111m --threads 2 --rounds 4

Prints the median seconds of each path, and whether the two kernel paths made the same tokens
(they must: same kernels, same order).
"""

from __future__ import annotations

import argparse
import statistics
import time

from raylm import LLM, SamplingParams
from raylm.model import llama_decode
from raylm.model.layers import cpu_gemm

PATHS = {
    "oneDNN, modules": (0, False),
    "kernel, modules": (cpu_gemm.DECODE_MAX_ROWS, False),
    "kernel, one call": (cpu_gemm.DECODE_MAX_ROWS, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=None, help="num_threads (default: raylm's)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        seed=0,
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
        num_threads=args.threads,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    prompt = {"prompt_token_ids": [(i * 7) % 1000 + 3 for i in range(args.input_len)]}
    llm.generate([prompt], params, use_tqdm=False)  # warm
    times: dict[str, list[float]] = {name: [] for name in PATHS}
    tokens: dict[str, list[int]] = {}
    for rnd in range(args.rounds):
        order = list(PATHS.items())
        for name, (rows, one_call) in order if rnd % 2 == 0 else order[::-1]:
            cpu_gemm.DECODE_MAX_ROWS, llama_decode.ENABLED = rows, one_call
            start = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)
            times[name].append(time.perf_counter() - start)
            tokens[name] = out[0].outputs[0].token_ids
    base = statistics.median(times["oneDNN, modules"])
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"{name:18s} median {median:.3f} s  ({base / median:.2f}x the oneDNN path)")
    print("kernel paths made the same tokens:", tokens["kernel, modules"] == tokens["kernel, one call"])


if __name__ == "__main__":
    main()
