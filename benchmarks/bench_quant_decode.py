"""GGUF decode on CPU: raylm's packed VNNI kernel (csrc/quant_decode.cpp, int8
activations) against the row-tiled kernel it replaced at decode
(csrc/quant_gemm.cpp's quant_linear, float activations), switched round by
round in one process so a noisy machine hurts both alike, with the share of
the memory-bandwidth roofline each reaches.

    python benchmarks/bench_quant_decode.py FILE.gguf [FILE.gguf ...] [--threads 2] [--rounds 5]
                                            [--rows 1,2,4] [--output-len 64] [--no-e2e]

Two measurements per file:
- matmuls: every quantized matrix of one decode step (all layers and the LM
  head, not the embedding) called on `rows` activation rows, the whole set
  timed over a few steps (about 200 MB of weights); "GB/s" is the file's
  bytes of those matrices over the time of one step.
- one request (unless --no-e2e): LLM(file) in bf16 decoding `output-len`
  tokens after a 16-token prompt, tok/s from the time of a (1 + output-len)-
  token generation minus a 1-token one, three ways: the row-tiled kernel with
  the layers module by module (quant_kernels.PACKED_MAX_ROWS = 0, the fused
  decode off: raylm before the packed kernel), the packed kernel module by
  module, and the packed kernel with a step's layers in one call
  (quant_decode_layers, the default).

The roofline is a 512 MiB torch sum on the same threads, measured every round
between the others; share = bytes of quantized weights per token x tok/s / it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGUFReader

from raylm.model import llama_decode
from raylm.model.layers import quant_kernels
from raylm.model.layers.cpu_kernels import get_cpu_kernels


def bandwidth_gb_s() -> float:
    data = torch.ones(512 * 2**20 // 4)
    data.sum()
    start = time.perf_counter()
    for _ in range(3):
        data.sum()
    return 3 * data.nbytes / (time.perf_counter() - start) / 1e9


def decode_matrices(path: str, module) -> list[tuple[int, torch.Tensor, torch.Tensor, int, int]]:
    """(type code, file blocks, packed blocks, rows, cols) of every quantized matrix a decode step reads."""
    out = []
    for t in GGUFReader(path).tensors:
        name = t.tensor_type.name
        if name in quant_kernels.GGUF_TYPE_CODES and t.name != "token_embd.weight":
            code = quant_kernels.GGUF_TYPE_CODES[name]
            data = torch.from_numpy(np.array(t.data))
            out.append((code, data, module.quant_pack(data, code), int(t.shape[1]), int(t.shape[0])))
    return out


def time_matmuls(module, matrices, rows: int, packed: bool, steps: int) -> float:
    """Seconds per decode step's matmuls, over `steps` steps."""
    xs = {cols: torch.randn(rows, cols).bfloat16() for *_, cols in matrices}
    start = time.perf_counter()
    for _ in range(steps):
        for code, data, packed_data, n, cols in matrices:
            if packed:
                module.quant_packed_linear(xs[cols], packed_data, code, n)
            else:
                module.quant_linear(xs[cols], data, code)
    return (time.perf_counter() - start) / steps


def decode_tok_s(llm, output_len: int) -> float:
    from raylm import SamplingParams

    prompt = [{"prompt_token_ids": list(range(1, 17))}]

    def run(n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    return output_len / (run(1 + output_len) - run(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--no-e2e", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = get_cpu_kernels()
    if module is None or not quant_kernels.packed_kernel_available(module):
        raise SystemExit("the CPU kernels have no packed VNNI kernel here (no build, or no AVX-512 VNNI)")
    rows_list = [int(r) for r in args.rows.split(",")]
    for path in args.files:
        matrices = decode_matrices(path, module)
        nbytes = sum(data.nbytes for _, data, *_ in matrices)
        steps = max(1, int(2e8 // nbytes))  # about 200 MB of weights per timing
        times: dict[tuple[int, bool], list[float]] = {(r, p): [] for r in rows_list for p in (False, True)}
        bandwidths = []
        for _ in range(args.rounds):
            bandwidths.append(bandwidth_gb_s())
            for rows in rows_list:
                for packed in (False, True):
                    times[rows, packed].append(time_matmuls(module, matrices, rows, packed, steps))
        bw = statistics.median(bandwidths)
        print(f"\n{path}: {len(matrices)} quantized matrices, {nbytes / 1e6:.1f} MB per decode step; "
              f"{args.threads} threads; torch sum {bw:.1f} GB/s (median of {args.rounds}, "
              f"{min(bandwidths):.1f}-{max(bandwidths):.1f})")
        print("| rows | row-tiled ms | packed ms | speed-up | packed GB/s | share of roofline |")
        print("|---|---|---|---|---|---|")
        for rows in rows_list:
            old, new = statistics.median(times[rows, False]), statistics.median(times[rows, True])
            print(f"| {rows} | {old * 1e3:.2f} | {new * 1e3:.2f} | {old / new:.2f} | {nbytes / new / 1e9:.1f} | "
                  f"{nbytes / new / 1e9 / bw:.0%} |")
        if args.no_e2e:
            continue
        from raylm import LLM

        # In this process ("uni"), so that the switches below reach the model.
        llm = LLM(path, dtype="bfloat16", num_threads=args.threads, enable_prefix_caching=False,
                  kv_cache_memory_bytes=64 << 20, distributed_executor_backend="uni")
        paths = {"row-tiled, modules": (0, False), "packed, modules": (default_rows := quant_kernels.PACKED_MAX_ROWS,
                                                                     False),
                 "packed, one call": (default_rows, True)}
        tok_s: dict[str, list[float]] = {path: [] for path in paths}
        bandwidths = []
        fused = llama_decode.ENABLED
        try:
            decode_tok_s(llm, 4)  # warm-up
            for _ in range(args.rounds):
                bandwidths.append(bandwidth_gb_s())
                for name, (rows, one_call) in paths.items():
                    quant_kernels.PACKED_MAX_ROWS, llama_decode.ENABLED = rows, one_call
                    tok_s[name].append(decode_tok_s(llm, args.output_len))
        finally:
            quant_kernels.PACKED_MAX_ROWS, llama_decode.ENABLED = default_rows, fused
            llm.shutdown()
        bw = statistics.median(bandwidths)
        for name, rates in tok_s.items():
            rate = statistics.median(rates)
            print(f"one request, batch-1 decode, {name}: {rate:.1f} tok/s (spread {min(rates):.1f}-{max(rates):.1f}); "
                  f"share of roofline {nbytes * rate / 1e9 / bw:.0%} (torch sum {bw:.1f} GB/s)")


if __name__ == "__main__":
    main()
