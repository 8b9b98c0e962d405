"""Structured outputs: step time with and without constrained requests, and
how much of the grammar bitmask's time the forward hides.

The engine core computes a step's bitmask while the workers run its forward
(EngineCore._step_one_batch). Two runs of one workload, alternating: `free`
(no request constrained) and `constrained` (--constrained-share of the
requests follow a JSON schema, with --whitespace: raylm's bounded default,
none, or any run of it as xgrammar allows). The time per output token of each
run, and their ratio, say what a constrained token costs against a free one.
In the constrained run the engine times each step's bitmask and the ranks
time each step's forward (execute_model); a step's bitmask is hidden up to
the forward's length, since both start when the step is sent:

    hidden share = sum(min(bitmask, forward)) / sum(bitmask)

    python benchmarks/bench_structured.py --make-model large /tmp/llama-111m
    python benchmarks/bench_structured.py --model /tmp/llama-111m --backend mp
    python benchmarks/bench_structured.py --model /tmp/llama-111m --constrained-share 1 --whitespace none
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from bench_step_overhead import install_timer, take_times
from compare_vllm import make_model

# A realistic constrained output: an object with free text, numbers and an enum
# (its bitmask costs more than a regex's).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        "notes": {"type": "string"},
    },
    "required": ["name", "age", "tags", "notes"],
}


class StepTimer:
    """Wraps one engine core: times each step and each step's bitmask."""

    def __init__(self, core):
        self.step_s: list[float] = []
        self.bitmask_s: list[float] = []  # per step that ran a forward; 0 when nothing was constrained
        scheduler, step = core.scheduler, core.step
        get_grammar_output = scheduler.get_grammar_output

        def timed_grammar_output(scheduler_output):
            t = time.perf_counter()
            out = get_grammar_output(scheduler_output)
            self.bitmask_s.append(time.perf_counter() - t if out is not None else 0.0)
            return out

        def timed_step():
            t = time.perf_counter()
            out = step()
            self.step_s.append(time.perf_counter() - t)
            return out

        scheduler.get_grammar_output = timed_grammar_output
        core.step = timed_step


def run(args, mode: str) -> dict:
    from raylm import LLM, SamplingParams
    from raylm.sampling_params import StructuredOutputsParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        distributed_executor_backend=args.backend,
        tensor_parallel_size=args.tp,
        num_threads=args.num_threads,
        kv_cache_memory_bytes=args.kv_cache_gib << 30,
        max_model_len=args.input_len + args.output_len + 16,
    )
    try:
        rng = random.Random(args.seed)
        vocab = llm.llm_engine.config.model_config.vocab_size
        prompts = [
            {"prompt_token_ids": [rng.randrange(16, vocab) for _ in range(args.input_len)]}
            for _ in range(args.num_prompts)
        ]
        constrained = StructuredOutputsParams(json=SCHEMA, **WHITESPACE[args.whitespace])
        every = max(1, round(1 / args.constrained_share)) if args.constrained_share > 0 else None
        params = [
            SamplingParams(
                temperature=0,
                max_tokens=args.output_len,
                ignore_eos=True,
                structured_outputs=constrained if mode == "constrained" and every and i % every == 0 else None,
            )
            for i in range(args.num_prompts)
        ]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up: grammar compiled, first allocations
        core = llm.llm_engine.engine_core.engine_core
        timer = StepTimer(core)
        core.executor.collective_rpc(install_timer)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        # The slowest rank's forward of each step, in step order.
        ranks = core.executor.collective_rpc(take_times)
        forward_s = [max(times) for times in zip(*(r["execute_model"] for r in ranks))]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        constrained_tokens = sum(
            len(o.outputs[0].token_ids) for o, p in zip(outs, params) if p.structured_outputs is not None
        )
        valid = sum(
            _is_valid(o.outputs[0].text)
            for o, p in zip(outs, params)
            if p.structured_outputs is not None and o.outputs[0].finish_reason == "stop"
        )
        return {
            "mode": mode,
            "elapsed_s": elapsed,
            "tokens": tokens,
            "steps": len(timer.step_s),
            "median_step_ms": 1e3 * statistics.median(timer.step_s),
            "bitmask_s": sum(timer.bitmask_s),
            "hidden_s": sum(min(b, f) for b, f in zip(timer.bitmask_s, forward_s)),
            "median_forward_ms": 1e3 * statistics.median(forward_s),
            "valid_finished_json": valid,
            "constrained_tokens": constrained_tokens,
            "ms_per_token": 1e3 * elapsed / tokens,
        }
    finally:
        llm.shutdown()


# --whitespace: what may stand between JSON tokens.
WHITESPACE = {"bounded": {}, "none": {"disable_any_whitespace": True}, "any": {"whitespace_pattern": r"[ \n\r\t]*"}}


def _is_valid(text: str) -> bool:
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except Exception:
        return False


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make-model", nargs=2, metavar=("PRESET", "PATH"))
    parser.add_argument("--model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--backend",
        default="mp",
        choices=["mp", "ray"],
        help="executors whose forward runs in other processes, alongside the bitmask",
    )
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--constrained-share",
        type=float,
        default=0.5,
        help="share of the requests constrained in the constrained run (1: all)",
    )
    parser.add_argument(
        "--whitespace",
        default="bounded",
        choices=sorted(WHITESPACE),
        help="JSON whitespace of the constrained requests",
    )
    args = parser.parse_args(argv)
    if args.make_model:
        make_model(*args.make_model)
        return
    results: dict[str, list[dict]] = {"free": [], "constrained": []}
    for _ in range(args.rounds):  # alternating, so the machine's load falls on both alike
        for mode in results:
            results[mode].append(run(args, mode))
    for mode, rs in results.items():
        for r in rs:
            print(
                f"{mode:11s} {r['elapsed_s']:7.2f} s  {r['tokens'] / r['elapsed_s']:8.1f} tok/s  "
                f"median step {r['median_step_ms']:6.2f} ms (forward {r['median_forward_ms']:6.2f} ms)  "
                f"bitmask {r['bitmask_s'] * 1e3:7.1f} ms in all, hidden {r['hidden_s'] * 1e3:7.1f} ms  "
                f"({r['steps']} steps; valid finished JSON: {r['valid_finished_json']})"
            )
    bitmask = sum(r["bitmask_s"] for r in results["constrained"])
    hidden = sum(r["hidden_s"] for r in results["constrained"])
    print(f"bitmask hidden behind the forward: {hidden / bitmask:.1%} of {bitmask * 1e3:.1f} ms")
    per_token = {mode: statistics.median(r["ms_per_token"] for r in rs) for mode, rs in results.items()}
    constrained_tokens = sum(r["constrained_tokens"] for r in results["constrained"])
    print(
        f"time per output token (median of rounds): free {per_token['free']:.3f} ms, constrained "
        f"{per_token['constrained']:.3f} ms ({per_token['constrained'] / per_token['free']:.2f}x); bitmask "
        f"{1e6 * bitmask / max(constrained_tokens, 1):.0f} us per constrained token "
        f"({args.constrained_share:g} of the requests constrained, whitespace {args.whitespace})"
    )


if __name__ == "__main__":
    main()
