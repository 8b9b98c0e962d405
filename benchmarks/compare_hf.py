"""raylm against Hugging Face transformers `generate` on the same throughput
workload (same random prompts, greedy, fixed output length), in one process.

    python benchmarks/compare_hf.py --model PATH --input-len 128 --output-len 128 --num-prompts 64
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time

import numpy as np
import torch

from raylm import LLM
from raylm.config import DEFAULT_MODEL_DIR, detect_device, resolve_dtype
from raylm.engine.arg_utils import parse_bytes
from raylm.engine.tokenizer import load_tokenizer
from raylm.entrypoints.bench import fixed_length_params, random_prompt_token_ids, run_requests
from raylm.model.arch_config import ArchConfig

logger = logging.getLogger("compare_hf")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model folder (default: raylm's embedded model)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default 128)")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens per request (default 128)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests in the workload (default 64)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto/float32/bfloat16/float16, resolved as raylm does, used by both (default auto)",
    )
    parser.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="prompts per HF generate() call; default: all of them in one call "
        "(faster than one by one); 1 = one by one",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads for both (CPU); default: torch's default"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=parse_bytes,
        default=None,
        help="raylm KV cache size, e.g. 2GiB (default: the engine's sizing)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    parser.add_argument("--output-json", default=None, metavar="FILE", help="also write the results as JSON")
    return parser.parse_args(argv)


def run_hf(
    model_dir: str, prompts: list[list[int]], output_len: int, dtype: torch.dtype, device: str, batch_size: int
) -> tuple[float, list[list[int]]]:
    """Seconds for all prompts, and the generated ids. Every prompt has the same
    length, so batches need no padding (left padding would be the right side)."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
    # min_new_tokens == max_new_tokens masks EOS at every step: exactly
    # output_len tokens per prompt, as raylm's ignore_eos gives.
    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        eos_token_id=eos,
        pad_token_id=pad,
    )

    def generate(batch: list[list[int]], config: GenerationConfig) -> torch.Tensor:
        input_ids = torch.tensor(batch, dtype=torch.long, device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
        return out[:, input_ids.shape[1] :]

    warmup_config = GenerationConfig(
        do_sample=False, max_new_tokens=2, min_new_tokens=2, eos_token_id=eos, pad_token_id=pad
    )
    generate(prompts[:1], warmup_config)
    _synchronize(device)
    start = time.perf_counter()
    generated: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        generated += generate(prompts[i : i + batch_size], generation_config).tolist()
    _synchronize(device)
    elapsed = time.perf_counter() - start
    # Drop the weights before raylm loads its copy (`generate` shares this
    # variable, so it is cleared rather than deleted).
    model = None
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return elapsed, generated


def run_raylm(
    model_dir: str,
    prompts: list[list[int]],
    output_len: int,
    dtype: torch.dtype,
    device: str,
    threads: int | None,
    kv_cache_memory_bytes: int | None,
) -> tuple[float, list[list[int]]]:
    kwargs = {"device": device}
    if threads is not None:
        kwargs["num_threads"] = threads
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    dtype_name = str(dtype).replace("torch.", "")
    with LLM(model=model_dir, dtype=dtype_name, **kwargs) as llm:
        # HF's generate returns ids only, so raylm skips detokenizing too.
        run_requests(llm, prompts[:1], fixed_length_params(2, detokenize=False))  # warm-up, as for HF
        run = run_requests(llm, prompts, fixed_length_params(output_len, detokenize=False))
    return run.elapsed_s, [list(o.outputs[0].token_ids) for o in run.outputs]


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    model_dir = args.model or str(DEFAULT_MODEL_DIR)
    try:
        arch = ArchConfig.from_model_dir(model_dir)
        device = args.device or detect_device()
        dtype = resolve_dtype(args.dtype, arch.dtype, device)
        tokenizer = load_tokenizer(model_dir)
        if min(args.input_len, args.output_len, args.num_prompts) < 1:
            raise ValueError("--input-len, --output-len and --num-prompts must be >= 1")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    prompts = random_prompt_token_ids(
        tokenizer, arch.vocab_size, args.num_prompts, args.input_len, np.random.default_rng(args.seed)
    )
    hf_batch_size = args.hf_batch_size or args.num_prompts

    output_tokens = args.num_prompts * args.output_len
    total_tokens = output_tokens + args.num_prompts * args.input_len
    print(
        f"workload: {args.num_prompts} prompts x ({args.input_len} in + {args.output_len} out) tokens, "
        f"greedy, {str(dtype).replace('torch.', '')} on {device}, threads={torch.get_num_threads()}"
    )

    hf_s, hf_tokens = run_hf(model_dir, prompts, args.output_len, dtype, device, hf_batch_size)
    print(
        f"HF transformers (batch {hf_batch_size}): {hf_s:.3f} s, {output_tokens / hf_s:.2f} output tokens/s, "
        f"{total_tokens / hf_s:.2f} total tokens/s"
    )
    raylm_s, raylm_tokens = run_raylm(
        model_dir, prompts, args.output_len, dtype, device, args.threads, args.kv_cache_memory_bytes
    )
    print(
        f"raylm:                   {raylm_s:.3f} s, {output_tokens / raylm_s:.2f} output tokens/s, "
        f"{total_tokens / raylm_s:.2f} total tokens/s"
    )
    ratio = hf_s / raylm_s
    # Low precision can flip near-tied argmaxes, so report agreement rather than demand it.
    identical = sum(a == b for a, b in zip(hf_tokens, raylm_tokens))
    print(f"raylm/HF throughput ratio: {ratio:.2f}x")
    print(f"greedy outputs identical for {identical}/{args.num_prompts} prompts")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "model": model_dir,
                    "dtype": str(dtype).replace("torch.", ""),
                    "device": device,
                    "threads": torch.get_num_threads(),
                    "input_len": args.input_len,
                    "output_len": args.output_len,
                    "num_prompts": args.num_prompts,
                    "hf_batch_size": hf_batch_size,
                    "hf_elapsed_time": hf_s,
                    "hf_output_tokens_per_second": output_tokens / hf_s,
                    "raylm_elapsed_time": raylm_s,
                    "raylm_output_tokens_per_second": output_tokens / raylm_s,
                    "raylm_over_hf": ratio,
                    "identical_greedy_outputs": identical,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
