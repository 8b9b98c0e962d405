"""Quantized models against bf16: batch-1 decode speed, load time and the share
of memory bandwidth that decode reaches, per weight type.

    python benchmarks/bench_quant.py [--models default,large] [--variants bf16,int8,Q8_0,Q4_K_M]
                                     [--rounds 3] [--output-len 128] [--threads 2]
    python benchmarks/bench_quant.py --widen FILE.gguf [FILE.gguf ...] [--rounds 7] [--threads 1]

Models: `default`, the ~7M model embedded in raylm; `large`, the ~111M Llama
of benchmarks/compare_vllm.py (written once, deterministic weights). Variants:
the bf16 safetensors folder; the same with --quantization int8; GGUF files
written from it with raylm.testing.gguf_writer (Q8_0, and a Q4_K_M-like mix:
Q4_K with Q6_K for v, down and output, as llama-quantize does; tensors whose
rows are not whole blocks fall back to F16, as there).

Each round runs every variant once, in turn, so a shared, noisy machine
disturbs them alike; the medians are reported. Decode tok/s is
max_tokens / (time of a (1 + max_tokens)-token generation minus a 1-token
one) for one 16-token prompt; load time is raylm.model.loader.load_model alone
(file cache warm after the first round). "GB/s" is the bytes of weights read
per token (linear layers as stored, plus the LM head) times tok/s.

--widen times what a prefill step (more than 64 rows) does to each quantized
matrix of a bf16 model before oneDNN's matmul: layer 0's matrices of each
GGUF file widened to bf16, from the packed tiles that layers keep
(quant_packed_dequantize) against from the file's blocks (quant_dequantize),
alternating call by call; the minimum and median per layer over the rounds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

logger = logging.getLogger("bench_quant")
DEFAULT_MODEL = pathlib.Path(__file__).resolve().parent.parent / "raylm" / "data" / "default_model"


def q4_k_m(name: str, shape) -> str:
    return "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q4_K"


def prepare(model: str, workdir: pathlib.Path, variants: list[str]) -> dict[str, tuple[str, str | None]]:
    """variant -> (model path, quantization) for one model."""
    from raylm.testing.gguf_writer import write_gguf

    if model == "default":
        folder = DEFAULT_MODEL
    else:
        from compare_vllm import make_model

        folder = workdir / model
        if not (folder / "model.safetensors").exists():
            make_model(model, str(folder))
    paths: dict[str, tuple[str, str | None]] = {}
    for variant in variants:
        if variant == "bf16":
            paths[variant] = (str(folder), None)
        elif variant == "int8":
            paths[variant] = (str(folder), "int8")
        else:
            path = workdir / f"{model}-{variant}.gguf"
            if not path.exists():
                write_gguf(
                    folder,
                    path,
                    "Q4_K" if variant == "Q4_K_M" else variant,
                    tensor_type=q4_k_m if variant == "Q4_K_M" else None,
                )
            paths[variant] = (str(path), None)
    return paths


def weight_bytes_per_token(model) -> int:
    from raylm.model.layers.linear import LinearBase

    total = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            total += module.quant_matmul.nbytes if module.quant_matmul is not None else module.weight.nbytes
    return total + model.lm_head.weight.nbytes


def measure(path: str, quantization: str | None, args) -> dict:
    from raylm import LLM, SamplingParams
    from raylm.model.gguf import reader
    from raylm.model.loader import load_model

    torch.set_num_threads(args.threads)
    reader._open_checked.cache_clear()  # time the parse too, as a fresh process would
    t = time.perf_counter()
    model = load_model(path, torch.bfloat16, "cpu", quantization=quantization)
    load_s = time.perf_counter() - t
    bytes_per_token = weight_bytes_per_token(model)
    del model
    llm = LLM(
        path,
        dtype="bfloat16",
        quantization=quantization,
        num_threads=args.threads,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=512,
        enable_prefix_caching=False,
    )
    prompt = [{"prompt_token_ids": list(range(20, 36))}]

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - t

    run(8)
    short, long = min(run(1) for _ in range(3)), run(1 + args.output_len)
    llm.shutdown()
    tok_s = args.output_len / max(long - short, 1e-9)
    return {
        "load_s": load_s,
        "decode_tok_s": tok_s,
        "weight_MB_per_token": bytes_per_token / 1e6,
        "GB_s": bytes_per_token * tok_s / 1e9,
    }


def layer_matrices(path: str, layer: int = 0) -> list[tuple[str, int, torch.Tensor, int, int]]:
    """(name, type code, file blocks, rows, cols) of one layer's quantized matrices."""
    import numpy as np
    from gguf import GGUFReader

    from raylm.model.layers.quant_kernels import GGUF_TYPE_CODES

    return [
        (
            t.name,
            GGUF_TYPE_CODES[t.tensor_type.name],
            torch.from_numpy(np.array(t.data)),
            int(t.shape[1]),
            int(t.shape[0]),
        )
        for t in GGUFReader(path).tensors
        if t.name.startswith(f"blk.{layer}.") and t.tensor_type.name in GGUF_TYPE_CODES
    ]


def time_widening(module, path: str, rounds: int) -> dict[str, list[float]]:
    """Seconds per layer to widen layer 0's matrices to bf16, per round, from the
    packed tiles ("tiles") and from the file's blocks ("blocks"), alternating."""
    matrices = [
        (code, data, module.quant_pack(data, code), rows, cols) for _, code, data, rows, cols in layer_matrices(path)
    ]
    times: dict[str, list[float]] = {"tiles": [], "blocks": []}
    for _ in range(rounds):
        for source in times:
            start = time.perf_counter()
            for code, data, packed, rows, cols in matrices:
                if source == "tiles":
                    module.quant_packed_dequantize(packed, code, rows, cols, torch.bfloat16)
                else:
                    module.quant_dequantize(data, code, cols, torch.bfloat16)
            times[source].append(time.perf_counter() - start)
    return times


def report_widening(paths: list[str], rounds: int, threads: int) -> None:
    from raylm.model.layers.cpu_kernels import get_cpu_kernels

    torch.set_num_threads(threads)
    module = get_cpu_kernels()
    print(
        f"layer 0 widened to bf16, {threads} thread(s), {rounds} rounds, load average {os.getloadavg()[0]:.2f} before"
    )
    print(f"{'file':40s} {'tiles ms min/median':>20s} {'blocks ms min/median':>21s} {'tiles/blocks':>12s}")
    for path in paths:
        times = time_widening(module, path, rounds)
        tiles, blocks = (
            (1e3 * min(times["tiles"]), 1e3 * statistics.median(times["tiles"])),
            (1e3 * min(times["blocks"]), 1e3 * statistics.median(times["blocks"])),
        )
        print(
            f"{pathlib.Path(path).name:40s} {tiles[0]:9.2f} / {tiles[1]:8.2f} {blocks[0]:10.2f} / {blocks[1]:8.2f} "
            f"{tiles[0] / blocks[0]:12.2f}"
        )
    print(f"load average {os.getloadavg()[0]:.2f} after")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="default,large")
    parser.add_argument("--variants", default="bf16,int8,Q8_0,Q4_K_M")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/raylm_bench_quant")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--widen",
        nargs="+",
        metavar="FILE.gguf",
        help="only time prefill's widening of these files' layer 0 (see above)",
    )
    args = parser.parse_args(argv)
    if args.widen:
        report_widening(args.widen, args.rounds, args.threads)
        return
    logging.basicConfig(level=logging.WARNING)
    workdir = pathlib.Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAYLM_GGUF_CACHE", str(workdir / "gguf_cache"))
    variants = args.variants.split(",")
    report = {}
    for model in args.models.split(","):
        paths = prepare(model, workdir, variants)
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for round_index in range(args.rounds):
            for variant in variants:
                result = measure(*paths[variant], args)
                runs[variant].append(result)
                print(f"{model} {variant} round {round_index}: {result}", file=sys.stderr, flush=True)
        report[model] = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    print(
        f"\n{'model':8s} {'variant':8s} {'decode tok/s':>12s} {'vs bf16':>8s} {'load s':>7s} "
        f"{'MB/token':>9s} {'GB/s':>6s}"
    )
    for model, rows in report.items():
        base = rows.get("bf16", {}).get("decode_tok_s")
        for variant, r in rows.items():
            ratio = f"{r['decode_tok_s'] / base:.2f}x" if base else "-"
            print(
                f"{model:8s} {variant:8s} {r['decode_tok_s']:12.1f} {ratio:>8s} {r['load_s']:7.2f} "
                f"{r['weight_MB_per_token']:9.1f} {r['GB_s']:6.2f}"
            )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
