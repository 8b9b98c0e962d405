"""The bf16 matmuls of one decode token on CPU: raylm's packed kernel
(csrc/bf16_gemm.cpp) against oneDNN's packed matmul and against float32's
matmul on the weight widened per call (what a CPU without bf16 arithmetic
runs above cpu_gemm.EMULATED_BF16_KERNEL_MAX_ROWS rows), by number of rows.

Runs every weight matrix of a Llama model of the given shape once per "token"
(the work of one decode step's matmuls, nothing else) and reports the time
per token, the weight bytes read per second, and that rate as a share of the
machine's read bandwidth measured in the same run (a torch sum over a buffer
much larger than the caches): the roofline of batch-1 decode.
The two paths alternate round by round; each figure is the median round.

  python benchmarks/bench_cpu_gemm.py                       # ~111M shapes, 1 thread
  python benchmarks/bench_cpu_gemm.py --threads 2 --rows 1,2,4,8,16,64
  python benchmarks/bench_cpu_gemm.py --preset small        # ~7M shapes
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from raylm.model.layers import cpu_gemm
from raylm.model.layers.cpu_kernels import get_cpu_kernels

# (hidden, intermediate, layers, vocab, q heads, kv heads, head_dim): compare_vllm.py's presets.
PRESETS = {
    "large": (1024, 2816, 8, 8192, 16, 8, 64),
    "small": (256, 688, 4, 8192, 8, 4, 32),
}


def weight_shapes(preset: str) -> list[tuple[int, int]]:
    hidden, inter, layers, vocab, heads, kv_heads, head_dim = PRESETS[preset]
    qkv = (heads + 2 * kv_heads) * head_dim
    per_layer = [(qkv, hidden), (hidden, heads * head_dim), (2 * inter, hidden), (hidden, inter)]
    return per_layer * layers + [(vocab, hidden)]


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second that a torch sum reads from a buffer far larger than the caches."""
    buf = torch.ones(mib * 2**20 // 4)
    buf.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return buf.numel() * 4 / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="large")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens-per-round", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = get_cpu_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels are not available here")

    shapes = weight_shapes(args.preset)
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(o, i, generator=gen) * 0.02).to(torch.bfloat16) for o, i in shapes]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    # Without bf16 arithmetic (AVX2) raylm never runs oneDNN's bf16 matmul, and
    # timing it gave nonsense there (0.14 ms for 205 MB of weights): no column.
    with_onednn = cpu_gemm.cpu_has_bf16_arithmetic()
    onednn = [cpu_gemm._pack_onednn(w) for w in weights] if with_onednn else []
    ours = [kernels.bf16_pack(w) for w in weights]
    bandwidth = read_bandwidth()
    print(
        f"preset {args.preset}: {len(weights)} matrices, {nbytes / 1e6:.1f} MB of bf16 weights; "
        f"{args.threads} thread(s); read bandwidth {bandwidth / 1e9:.1f} GB/s "
        f"(roofline {bandwidth / nbytes:.0f} tokens/s at one row)"
    )
    print(f"bf16 arithmetic on this CPU: {cpu_gemm.cpu_has_bf16_arithmetic()}")
    print(
        f"{'rows':>4} | {'oneDNN ms/token':>15} | {'float32 ms/token':>16} | {'raylm ms/token':>14} | "
        f"{'raylm GB/s':>10} | {'of roofline':>11} | {'raylm / oneDNN speed':>20} | {'raylm / float32':>15}"
    )
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen).to(torch.bfloat16) for w in weights}

        # Each takes this round's inputs as a default argument: bound here, not looked up in the loop later.
        def run_onednn(xs=xs):
            for w, p in zip(weights, onednn):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

        def run_float32(xs=xs):
            for w in weights:
                cpu_gemm.linear_in_float32(xs[w.shape[1]], w, None)

        def run_ours(xs=xs):
            for w, p in zip(weights, ours):
                kernels.bf16_linear(xs[w.shape[1]], p, w.shape[0], None)

        times: dict[str, list[float]] = {"onednn": [], "float32": [], "ours": []}
        for rnd in range(args.rounds):
            order = [("onednn", run_onednn)] if with_onednn else []
            order += [("float32", run_float32), ("ours", run_ours)]
            for name, fn in order if rnd % 2 == 0 else order[::-1]:
                fn()  # warm
                t = time.perf_counter()
                for _ in range(args.tokens_per_round):
                    fn()
                times[name].append((time.perf_counter() - t) / args.tokens_per_round)
        f, b = (statistics.median(times[name]) for name in ("float32", "ours"))
        a = statistics.median(times["onednn"]) if with_onednn else None
        onednn_ms = f"{a * 1e3:>15.2f}" if a is not None else f"{'-':>15}"
        onednn_ratio = f"{a / b:>19.2f}x" if a is not None else f"{'-':>20}"
        print(
            f"{rows:>4} | {onednn_ms} | {f * 1e3:>16.2f} | {b * 1e3:>14.2f} | {nbytes / b / 1e9:>10.1f} | "
            f"{nbytes / b / bandwidth:>10.0%} | {onednn_ratio} | {f / b:>14.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
