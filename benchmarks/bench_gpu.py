"""GPU benchmark: throughput and batch-1 latency of raylm on a ~1B-parameter
Llama built here with random weights, against Hugging Face generate, with the
share of the memory-bandwidth roofline that batch-1 decode reaches.

    python benchmarks/bench_gpu.py --out result.json          # on a GPU (bf16, ~1.1B)
    python benchmarks/bench_gpu.py --tiny --out result.json   # anywhere, in seconds

Random weights give random tokens; with ignore_eos every request makes its
full output length, which is all a speed measurement needs. HF generate runs
on a smaller batch (its time grows with the batch too), and the ratio compares
output tokens per second.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

# ~1.1B parameters: Llama-style shapes between TinyLlama and Llama-3.2-1B.
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
TINY = dict(max_position_embeddings=2048)


def build_model(folder: Path, tiny: bool, dtype: torch.dtype) -> Path:
    from raylm.testing.tiny_models import make_tiny_model

    if (folder / "config.json").exists():
        return folder
    return make_tiny_model("llama", folder, dtype=dtype, **(TINY if tiny else LLAMA_1B))


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_raylm(model: Path, args, device: str) -> dict:
    from raylm import LLM, SamplingParams
    from raylm.model.arch_config import ArchConfig
    from raylm.model.layers import gpu_attention

    arch = ArchConfig.from_model_dir(str(model))
    memory = {"gpu_memory_utilization": 0.85} if device == "cuda" else {"kv_cache_memory_bytes": 256 << 20}
    llm = LLM(
        str(model),
        dtype=args.dtype,
        distributed_executor_backend="uni",
        device=device,
        max_model_len=args.input_len + args.output_len,
        max_num_seqs=args.num_prompts,
        **memory,
    )
    try:
        runner = llm.llm_engine.engine_core.engine_core.executor.driver_worker.worker.model_runner
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        kv_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)

        def run(prompts, max_tokens):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            _sync(device)
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            _sync(device)
            return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

        run(_prompts(4, 32, arch.vocab_size, 0), 8)  # warm-up: first kernels, allocator
        prompts = _prompts(args.num_prompts, args.input_len, arch.vocab_size, 1)
        elapsed, out_tokens = run(prompts, args.output_len)
        throughput = {
            "elapsed_s": elapsed,
            "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (out_tokens + args.num_prompts * args.input_len) / elapsed,
        }
        one = _prompts(1, args.input_len, arch.vocab_size, 2)
        prefill_s, _ = run(one, 1)
        full_s, _ = run(one, args.output_len)
        decode_step_s = (full_s - prefill_s) / (args.output_len - 1)
        # A decode step must read every weight but the input embedding (one row
        # of it) and the KV cache so far; bytes over bandwidth is its floor.
        element = torch.empty((), dtype=runner.config.model_config.dtype).element_size()
        embed = arch.vocab_size * arch.hidden_size * element
        kv_per_token = runner.kv_cache_bytes_per_block() // runner.block_size
        mean_context = args.input_len + args.output_len / 2
        bytes_per_step = weight_bytes - (0 if arch.tie_word_embeddings else embed) + kv_per_token * mean_context
        roofline_step_s = bytes_per_step / (args.bandwidth_tb_s * 1e12)
        latency = {
            "request_s": full_s,
            "prefill_s": prefill_s,
            "decode_ms_per_token": decode_step_s * 1e3,
            "roofline_ms_per_token": roofline_step_s * 1e3,
            "roofline_share": roofline_step_s / decode_step_s,
        }
        result = {
            "throughput": throughput,
            "latency": latency,
            "memory": {"weights_gib": weight_bytes / 2**30, "kv_cache_gib": kv_bytes / 2**30},
            "attention_backend": gpu_attention.active_backend_name() if device == "cuda" else "cpu",
            "num_parameters": sum(p.numel() for p in runner.model.parameters()),
        }
        if device == "cuda":
            result["memory"]["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return result
    finally:
        llm.shutdown()


@torch.inference_mode()
def bench_hf(model: Path, args, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    hf = AutoModelForCausalLM.from_pretrained(str(model)).to(device, dtype).eval()
    vocab = hf.config.vocab_size
    ids = torch.tensor(_prompts(args.hf_prompts, args.input_len, vocab, 3), device=device)
    hf.generate(ids[:1, :16], max_new_tokens=4, do_sample=False)  # warm-up
    _sync(device)
    start = time.perf_counter()
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=args.output_len,
        min_new_tokens=args.output_len,
        do_sample=False,
        pad_token_id=0,
    )
    _sync(device)
    elapsed = time.perf_counter() - start
    new_tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"batch": args.hf_prompts, "elapsed_s": elapsed, "output_tokens_per_s": new_tokens / elapsed}


def summary_line(result: dict) -> str:
    r, lat, mem = result["raylm"], result["raylm"]["latency"], result["raylm"]["memory"]
    hf = result.get("hf")
    ratio = f"{r['throughput']['output_tokens_per_s'] / hf['output_tokens_per_s']:.1f}x" if hf else "n/a"
    return (
        f"{result['model']} {result['dtype']} on {result['device']} ({r['attention_backend']}): "
        f"{r['throughput']['output_tokens_per_s']:.0f} out tok/s ({result['num_prompts']}x"
        f"{result['input_len']}/{result['output_len']}), {ratio} HF generate; batch-1 "
        f"{lat['decode_ms_per_token']:.2f} ms/token = {100 * lat['roofline_share']:.0f}% of roofline; "
        f"weights {mem['weights_gib']:.2f} GiB, KV {mem['kv_cache_gib']:.2f} GiB"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model and workload (runs on CPU in seconds)")
    p.add_argument("--model-dir", type=Path, help="where to build (or find) the model; default a temp folder")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--hf-prompts", type=int, default=None, help="batch for HF generate (0 skips it)")
    p.add_argument("--bandwidth-tb-s", type=float, default=4.8, help="device memory bandwidth (H200: 4.8)")
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    defaults = (
        dict(dtype="float32", num_prompts=8, input_len=32, output_len=16, hf_prompts=2)
        if args.tiny
        else dict(dtype="bfloat16", num_prompts=256, input_len=512, output_len=256, hf_prompts=32)
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    with tempfile.TemporaryDirectory(prefix="raylm-bench-") as tmp:
        folder = args.model_dir or Path(tmp) / "model"
        start = time.perf_counter()
        model = build_model(folder, args.tiny, getattr(torch, args.dtype))
        result = {
            "model": "tiny-llama" if args.tiny else "llama-1b-random",
            "dtype": args.dtype,
            "device": device,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "build_s": time.perf_counter() - start,
        }
        result["raylm"] = bench_raylm(model, args, device)
        if args.hf_prompts:
            result["hf"] = bench_hf(model, args, device)
    result["summary"] = summary_line(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2), file=sys.stderr)
    print(result["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
