"""GGUF decode on CPU: raylm's packed kernel (csrc/quant_decode.cpp, int8
activations; on each instruction set this build runs: AVX-512 VNNI, AVX2)
against the row-tiled kernel it replaced at decode (csrc/quant_gemm.cpp's
quant_linear, float activations), switched round by round in one process so a
noisy machine hurts all alike, with the share of the memory-bandwidth roofline
each reaches.

    python benchmarks/bench_quant_decode.py FILE.gguf [FILE.gguf ...] [--threads 2] [--rounds 5]
                                            [--rows 1,2,4] [--output-len 64] [--no-e2e]

Two measurements per file:
- matmuls: every quantized matrix of one decode step (all layers and the LM
  head, not the embedding) called on `rows` activation rows, the whole set
  timed over a few steps (about 200 MB of weights); "GB/s" is the file's
  bytes of those matrices over the time of one step.
- one request (unless --no-e2e): LLM(file) in bf16 decoding `output-len`
  tokens after a 16-token prompt, tok/s from the time of a (1 + output-len)-
  token generation minus a 1-token one, per instruction set two ways: the
  packed kernel module by module (the fused decode off) and with a step's
  layers in one call (quant_decode_layers, the default).
- memory: in a fresh process, the growth of its anonymous RSS while the bf16
  model loads (no KV cache), and the bytes its quantized layers hold against
  the file's quantized matrices (one copy: the file's blocks are not kept
  beside the packed tiles).

The roofline is a 512 MiB torch sum on the same threads, measured every round
between the others (before each one-request measurement for its share);
share = bytes of quantized weights per token x tok/s / it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
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


def anon_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024


def report_memory(path: str) -> None:
    """Run in a fresh process (--memory-of): what loading the model costs in RAM."""
    from raylm.model.loader import load_model

    before = anon_rss_mib()
    model = load_model(path, torch.bfloat16, "cpu")
    grew = anon_rss_mib() - before
    held = sum(m.quant_matmul.nbytes for m in model.modules() if getattr(m, "quant_matmul", None) is not None)
    file_bytes = sum(
        int(t.n_bytes)
        for t in GGUFReader(path).tensors
        if t.tensor_type.name in quant_kernels.GGUF_TYPE_CODES and t.name != "token_embd.weight"
    )
    print(
        f"memory: anonymous RSS grew {grew:.1f} MiB while the bf16 model loaded; its quantized layers hold "
        f"{held / 2**20:.1f} MiB for the file's {file_bytes / 2**20:.1f} MiB of quantized matrices"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--no-e2e", action="store_true")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)  # the fresh process of the memory figure
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_of:
        return report_memory(args.memory_of)
    module = get_cpu_kernels()
    if module is None or not quant_kernels.packed_kernel_available(module):
        raise SystemExit("the CPU kernels have no packed decode kernel here (no build, or neither AVX2 nor AVX-512)")
    isas = module.quant_packed_variants()
    rows_list = [int(r) for r in args.rows.split(",")]
    for path in args.files:
        subprocess.run(
            [sys.executable, __file__, path, "--memory-of", path, "--threads", str(args.threads)], check=True
        )
        matrices = decode_matrices(path, module)
        nbytes = sum(data.nbytes for _, data, *_ in matrices)
        steps = max(1, int(2e8 // nbytes))  # about 200 MB of weights per timing
        kernels = ["row-tiled", *isas]
        times: dict[tuple[int, str], list[float]] = {(r, k): [] for r in rows_list for k in kernels}
        bandwidths = []
        try:
            for _ in range(args.rounds):
                bandwidths.append(bandwidth_gb_s())
                for rows in rows_list:
                    for kernel in kernels:
                        if kernel != "row-tiled":
                            module.quant_packed_use(kernel)
                        times[rows, kernel].append(time_matmuls(module, matrices, rows, kernel != "row-tiled", steps))
        finally:
            module.quant_packed_use("auto")
        bw = statistics.median(bandwidths)
        print(
            f"\n{path}: {len(matrices)} quantized matrices, {nbytes / 1e6:.1f} MB per decode step; "
            f"{args.threads} threads; torch sum {bw:.1f} GB/s (median of {args.rounds}, "
            f"{min(bandwidths):.1f}-{max(bandwidths):.1f})"
        )
        print(
            "| rows | "
            + " | ".join(f"{k} ms" for k in kernels)
            + " | "
            + " | ".join(f"{k} speed-up, GB/s, share of roofline" for k in isas)
            + " |"
        )
        print("|---" * (1 + len(kernels) + len(isas)) + "|")
        for rows in rows_list:
            medians = {k: statistics.median(times[rows, k]) for k in kernels}
            print(
                f"| {rows} | "
                + " | ".join(f"{medians[k] * 1e3:.2f}" for k in kernels)
                + " | "
                + " | ".join(
                    f"{medians['row-tiled'] / medians[k]:.2f}x, {nbytes / medians[k] / 1e9:.1f}, "
                    f"{nbytes / medians[k] / 1e9 / bw:.0%}"
                    for k in isas
                )
                + " |"
            )
        del matrices
        if args.no_e2e:
            continue
        from raylm import LLM

        # In this process ("uni"), so that the switches below reach the model.
        llm = LLM(
            path,
            dtype="bfloat16",
            num_threads=args.threads,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=64 << 20,
            distributed_executor_backend="uni",
        )
        paths = {
            f"{isa}, {how}": (isa, one_call)
            for isa in isas
            for how, one_call in (("modules", False), ("one call", True))
        }
        tok_s: dict[str, list[float]] = {path: [] for path in paths}
        shares: dict[str, list[float]] = {path: [] for path in paths}
        bandwidths = []
        fused = llama_decode.ENABLED
        try:
            decode_tok_s(llm, 4)  # warm-up
            for _ in range(args.rounds):
                for name, (isa, one_call) in paths.items():
                    # The roofline right before each measurement: on a shared machine the
                    # load changes from one second to the next, so each share is a pair.
                    bandwidths.append(bandwidth_gb_s())
                    module.quant_packed_use(isa)
                    llama_decode.ENABLED = one_call
                    tok_s[name].append(decode_tok_s(llm, args.output_len))
                    shares[name].append(nbytes * tok_s[name][-1] / 1e9 / bandwidths[-1])
        finally:
            module.quant_packed_use("auto")
            llama_decode.ENABLED = fused
            llm.shutdown()
        for name, rates in tok_s.items():
            print(
                f"one request, batch-1 decode, {name}: {statistics.median(rates):.1f} tok/s "
                f"(spread {min(rates):.1f}-{max(rates):.1f}); share of roofline, each round against the torch "
                f"sum just before it: median {statistics.median(shares[name]):.0%}, spread "
                f"{min(shares[name]):.0%}-{max(shares[name]):.0%}"
            )
        print(f"torch sum {statistics.median(bandwidths):.1f} GB/s ({min(bandwidths):.1f}-{max(bandwidths):.1f})")


if __name__ == "__main__":
    main()
