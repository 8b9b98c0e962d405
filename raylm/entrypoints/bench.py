"""Offline benchmarks behind `raylm bench latency|throughput`: random-token
workloads with a fixed output length, timed on an already built `LLM`."""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from raylm.outputs import RequestOutput
from raylm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 99)


@dataclass
class RunResult:
    """One batch of requests run to completion."""

    elapsed_s: float
    outputs: list[RequestOutput]
    # Most KV-cache blocks held at once during the run (sampled after every step).
    peak_kv_cache_blocks: int

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for o in self.outputs for c in o.outputs)


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("latency workload")
    group.add_argument(
        "--input-len", type=int, metavar="N", default=32, help="prompt length in tokens (random token ids)"
    )
    group.add_argument(
        "--output-len", type=int, metavar="N", default=128, help="tokens generated per prompt (EOS ignored)"
    )
    group.add_argument(
        "--batch-size", type=int, metavar="N", default=8, help="prompts submitted together per iteration"
    )
    group.add_argument("--num-iters-warmup", type=int, metavar="N", default=2, help="untimed iterations first")
    group.add_argument("--num-iters", type=int, metavar="N", default=5, help="timed iterations")
    group.add_argument("--output-json", default=None, metavar="FILE", help="also write the results to FILE as JSON")
    group.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="skip turning output tokens into text (time the model and scheduler only)",
    )


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("throughput workload")
    group.add_argument(
        "--input-len", type=int, metavar="N", default=128, help="prompt length in tokens (random token ids)"
    )
    group.add_argument(
        "--output-len", type=int, metavar="N", default=128, help="tokens generated per prompt (EOS ignored)"
    )
    group.add_argument("--num-prompts", type=int, metavar="N", default=64, help="prompts submitted at once")
    group.add_argument("--output-json", default=None, metavar="FILE", help="also write the results to FILE as JSON")
    group.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="skip turning output tokens into text (time the model and scheduler only)",
    )


def random_prompt_token_ids(
    tokenizer: Any, vocab_size: int, num_prompts: int, input_len: int, rng: np.random.Generator
) -> list[list[int]]:
    """Prompts of exactly `input_len` random ids, never special tokens (a stray
    BOS/EOS mid-prompt is not what real traffic looks like)."""
    if num_prompts < 1 or input_len < 1:
        raise ValueError(f"num_prompts and input_len must be >= 1, got {num_prompts} and {input_len}")
    usable = min(vocab_size, len(tokenizer)) if tokenizer is not None else vocab_size
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    candidates = np.array([i for i in range(usable) if i not in special], dtype=np.int64)
    if candidates.size == 0:
        raise ValueError("the vocabulary has no non-special tokens to build prompts from")
    picks = rng.choice(candidates, size=(num_prompts, input_len))
    return picks.tolist()


def fixed_length_params(output_len: int, detokenize: bool = True) -> SamplingParams:
    """Greedy, EOS ignored: every request produces exactly `output_len` tokens."""
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=detokenize)


def run_requests(llm: Any, prompts: list[list[int]], params: SamplingParams) -> RunResult:
    """Submit all prompts at once and step the engine until every one finishes.

    Drives `LLMEngine.step` directly (as `LLM.generate` does) so the KV-cache
    occupancy can be sampled between steps at the cost of a dict lookup.
    """
    engine = llm.llm_engine
    num_blocks = engine.config.cache_config.num_blocks or 0
    validated = [engine.validate({"prompt_token_ids": ids}, params) for ids in prompts]
    start = time.perf_counter()
    request_ids = []
    for processed, finished_params in validated:
        rid = engine.next_request_id()
        engine.add_validated_request(rid, processed, finished_params)
        request_ids.append(rid)
    pending, results, peak_usage = set(request_ids), {}, 0.0
    try:
        while pending:
            for output in engine.step():
                if output.request_id in pending:
                    pending.discard(output.request_id)
                    results[output.request_id] = output
            peak_usage = max(peak_usage, engine.stats().get("kv_cache_usage", 0.0))
            if pending and not engine.has_unfinished_requests():
                raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")
    except BaseException:
        for rid in pending:
            engine.abort_request(rid)
        raise
    elapsed = time.perf_counter() - start
    return RunResult(elapsed, [results[r] for r in request_ids], round(peak_usage * num_blocks))


def peak_rss_bytes() -> int:
    """Peak resident memory of this (driver) process; ru_maxrss is KiB on Linux, bytes on macOS."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _check_lengths(llm: Any, input_len: int, output_len: int) -> None:
    max_len = llm.llm_engine.config.model_config.max_model_len
    if input_len + output_len > max_len:
        raise ValueError(f"input_len + output_len ({input_len + output_len}) exceeds max_model_len ({max_len})")


def _prompt_source(llm: Any, seed: int):
    engine = llm.llm_engine
    rng = np.random.default_rng(seed)
    vocab_size = engine.config.model_config.vocab_size

    def make(num_prompts: int, input_len: int) -> list[list[int]]:
        return random_prompt_token_ids(engine.tokenizer, vocab_size, num_prompts, input_len, rng)

    return make


def _describe_engine(llm: Any) -> dict:
    config = llm.llm_engine.config
    return {
        "model": config.model_config.model,
        "dtype": str(config.model_config.dtype).replace("torch.", ""),
        "device": config.device,
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "pipeline_parallel_size": config.parallel_config.pipeline_parallel_size,
        "context_parallel_size": config.parallel_config.context_parallel_size,
        "num_kv_cache_blocks": config.cache_config.num_blocks,
        "block_size": config.cache_config.block_size,
    }


def _spec_decode_stats(llm: Any) -> dict:
    """The engine's speculative decoding totals (warm-up included), when it speculates."""
    if llm.llm_engine.config.speculative_config is None:
        return {}
    totals = {k: v for k, v in llm.llm_engine.stats().items() if k.startswith("spec_decode_")}
    return {"spec_decode": {k.removeprefix("spec_decode_"): v for k, v in totals.items()}}


def _format_spec_decode(result: dict) -> list[str]:
    spec = result.get("spec_decode")
    if not spec:
        return []
    drafts, drafted, accepted = spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]
    per_position = [round(n / drafts, 2) if drafts else 0.0 for n in spec["num_accepted_tokens_per_pos"]]
    return [
        f"Speculative decoding: acceptance {accepted / drafted if drafted else 0.0:.2f} ({accepted} of {drafted} "
        f"draft tokens, {drafts} drafts), per position {per_position}; steps aside {spec['num_steps_aside']} "
        f"{spec['steps_aside_by_reason'] or ''}".rstrip()
    ]


def bench_latency(
    llm: Any,
    input_len: int = 32,
    output_len: int = 128,
    batch_size: int = 8,
    num_iters_warmup: int = 2,
    num_iters: int = 5,
    seed: int = 0,
    detokenize: bool = True,
) -> dict:
    """Time one batch end to end, `num_iters` times, with fresh random prompts
    each iteration so the prefix cache never hands out a free prefill.

    Time to first token is the latency of the same batch with max_tokens=1.
    """
    if batch_size < 1 or num_iters < 1 or num_iters_warmup < 0:
        raise ValueError("batch_size and num_iters must be >= 1 and num_iters_warmup >= 0")
    _check_lengths(llm, input_len, output_len)
    make_prompts = _prompt_source(llm, seed)
    full, first_token = fixed_length_params(output_len, detokenize), fixed_length_params(1, detokenize)
    for _ in range(num_iters_warmup):
        run_requests(llm, make_prompts(batch_size, input_len), full)
    latencies, ttfts = [], []
    for i in range(num_iters):
        latencies.append(run_requests(llm, make_prompts(batch_size, input_len), full).elapsed_s)
        ttfts.append(run_requests(llm, make_prompts(batch_size, input_len), first_token).elapsed_s)
        logger.info("iteration %d: latency %.4f s, ttft %.4f s", i, latencies[-1], ttfts[-1])
    avg_latency, avg_ttft = float(np.mean(latencies)), float(np.mean(ttfts))
    result = {
        **_describe_engine(llm),
        "input_len": input_len,
        "output_len": output_len,
        "batch_size": batch_size,
        "num_iters_warmup": num_iters_warmup,
        "num_iters": num_iters,
        "avg_latency": avg_latency,
        **{f"p{p}_latency": float(np.percentile(latencies, p)) for p in PERCENTILES},
        "latencies": latencies,
        "avg_ttft": avg_ttft,
        **{f"p{p}_ttft": float(np.percentile(ttfts, p)) for p in PERCENTILES},
        "ttfts": ttfts,
        # The decode share of a request: what each token after the first costs.
        "avg_time_per_output_token": (max(avg_latency - avg_ttft, 0.0) / (output_len - 1) if output_len > 1 else None),
        "detokenize": detokenize,
        "peak_rss_bytes": peak_rss_bytes(),
        **_spec_decode_stats(llm),
    }
    return result


def bench_throughput(
    llm: Any, input_len: int = 128, output_len: int = 128, num_prompts: int = 64, seed: int = 0, detokenize: bool = True
) -> dict:
    """Submit `num_prompts` requests at once and time until the last finishes."""
    _check_lengths(llm, input_len, output_len)
    make_prompts = _prompt_source(llm, seed)
    # A short untimed request pays one-time costs (allocator growth, lazy init).
    run_requests(llm, make_prompts(1, input_len), fixed_length_params(2, detokenize))
    run = run_requests(llm, make_prompts(num_prompts, input_len), fixed_length_params(output_len, detokenize))
    output_tokens = run.num_output_tokens
    total_tokens = num_prompts * input_len + output_tokens
    return {
        **_describe_engine(llm),
        "input_len": input_len,
        "output_len": output_len,
        "num_prompts": num_prompts,
        "elapsed_time": run.elapsed_s,
        "num_requests": num_prompts,
        "total_num_tokens": total_tokens,
        "num_output_tokens": output_tokens,
        "requests_per_second": num_prompts / run.elapsed_s,
        "tokens_per_second": total_tokens / run.elapsed_s,
        "output_tokens_per_second": output_tokens / run.elapsed_s,
        "peak_kv_cache_blocks": run.peak_kv_cache_blocks,
        "detokenize": detokenize,
        "peak_rss_bytes": peak_rss_bytes(),
        **_spec_decode_stats(llm),
    }


def format_latency(result: dict) -> str:
    lines = [f"Avg latency: {result['avg_latency']:.4f} seconds"]
    lines += [f"{p}% percentile latency: {result[f'p{p}_latency']:.4f} seconds" for p in PERCENTILES]
    lines.append(
        f"Avg time to first token: {result['avg_ttft']:.4f} seconds "
        f"(batch of {result['batch_size']}, {result['input_len']}-token prompts)"
    )
    if result["avg_time_per_output_token"] is not None:
        lines.append(f"Avg time per output token: {result['avg_time_per_output_token'] * 1000:.2f} ms")
    lines += _format_spec_decode(result)
    lines.append(f"Peak RSS (driver process): {result['peak_rss_bytes'] / 2**20:.1f} MiB")
    return "\n".join(lines)


def format_throughput(result: dict) -> str:
    lines = [
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s",
        f"Elapsed: {result['elapsed_time']:.3f} s for {result['num_requests']} requests "
        f"({result['input_len']} in + {result['output_len']} out tokens each)",
    ]
    if result.get("num_kv_cache_blocks"):
        lines.append(
            f"KV cache blocks in use at peak: {result['peak_kv_cache_blocks']} of {result['num_kv_cache_blocks']}"
        )
    lines += _format_spec_decode(result)
    lines.append(f"Peak RSS (driver process): {result['peak_rss_bytes'] / 2**20:.1f} MiB")
    return "\n".join(lines)
