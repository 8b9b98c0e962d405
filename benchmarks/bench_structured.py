"""Structured outputs: step time with and without constrained requests, and
how much of the grammar bitmask's time the forward hides.

The engine core computes a step's bitmask while the workers run its forward
(EngineCore._step_one_batch). Three runs of one workload (greedy, so every
run produces the same tokens and does the same work):

- free:        no request is constrained;
- overlapped:  half the requests follow a JSON schema, as the engine runs them;
- serialized:  the same, but the bitmask waits for the forward to finish first.

hidden share = (serialized - overlapped) / bitmask time: the part of the
bitmask's time that did not add to the run's time.

    python benchmarks/bench_structured.py --make-model large /tmp/llama-111m
    python benchmarks/bench_structured.py --model /tmp/llama-111m --backend mp
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

from compare_vllm import make_model  # noqa: E402

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
    """Wraps one engine core: times each step and its bitmask, and can make the
    bitmask wait for the forward (the serialized run)."""

    def __init__(self, core, serialize: bool):
        self.step_s: list[float] = []
        self.bitmask_s = 0.0
        self._forward = None
        scheduler, executor = core.scheduler, core.executor
        get_grammar_output, execute_model, step = scheduler.get_grammar_output, executor.execute_model, core.step

        def timed_execute_model(*args, **kwargs):
            self._forward = execute_model(*args, **kwargs)
            return self._forward

        def timed_grammar_output(scheduler_output):
            if serialize and self._forward is not None and hasattr(self._forward, "result"):
                self._forward.result()
            t = time.perf_counter()
            out = get_grammar_output(scheduler_output)
            if out is not None:
                self.bitmask_s += time.perf_counter() - t
            return out

        def timed_step():
            t = time.perf_counter()
            out = step()
            self.step_s.append(time.perf_counter() - t)
            return out

        executor.execute_model = timed_execute_model
        scheduler.get_grammar_output = timed_grammar_output
        core.step = timed_step


def run(args, mode: str) -> dict:
    from raylm import LLM, SamplingParams
    from raylm.sampling_params import StructuredOutputsParams

    llm = LLM(args.model, dtype=args.dtype, distributed_executor_backend=args.backend,
              tensor_parallel_size=args.tp, num_threads=args.num_threads,
              kv_cache_memory_bytes=args.kv_cache_gib << 30, max_model_len=args.input_len + args.output_len + 16)
    try:
        rng = random.Random(args.seed)
        vocab = llm.llm_engine.config.model_config.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(16, vocab) for _ in range(args.input_len)]}
                   for _ in range(args.num_prompts)]
        constrained = StructuredOutputsParams(json=SCHEMA)
        params = [SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                                 structured_outputs=constrained if mode != "free" and i % 2 == 0 else None)
                  for i in range(args.num_prompts)]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up: grammar compiled, first allocations
        core = llm.llm_engine.engine_core.engine_core
        timer = StepTimer(core, serialize=(mode == "serialized"))
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        valid = sum(_is_valid(o.outputs[0].text) for o, p in zip(outs, params)
                    if p.structured_outputs is not None and o.outputs[0].finish_reason == "stop")
        return {"mode": mode, "elapsed_s": elapsed, "tokens": tokens, "steps": len(timer.step_s),
                "median_step_ms": 1e3 * statistics.median(timer.step_s), "bitmask_s": timer.bitmask_s,
                "valid_finished_json": valid, "token_ids": [o.outputs[0].token_ids for o in outs]}
    finally:
        llm.shutdown()


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
    parser.add_argument("--backend", default="mp", help="uni, mp or ray (the forward runs in other processes)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.make_model:
        make_model(*args.make_model)
        return
    results: dict[str, list[dict]] = {"free": [], "overlapped": [], "serialized": []}
    for _ in range(args.rounds):  # alternating, so the machine's load falls on every mode alike
        for mode in results:
            results[mode].append(run(args, mode))
    assert results["overlapped"][0]["token_ids"] == results["serialized"][0]["token_ids"], "runs differ"
    best = {mode: min(rs, key=lambda r: r["elapsed_s"]) for mode, rs in results.items()}
    for mode, r in best.items():
        print(f"{mode:11s} {r['elapsed_s']:7.2f} s  {r['tokens'] / r['elapsed_s']:8.1f} tok/s  "
              f"median step {r['median_step_ms']:6.2f} ms  bitmask {r['bitmask_s'] * 1e3:7.1f} ms  "
              f"({r['steps']} steps; valid finished JSON: {r['valid_finished_json']})")
    bitmask = best["overlapped"]["bitmask_s"]
    saved = best["serialized"]["elapsed_s"] - best["overlapped"]["elapsed_s"]
    print(f"bitmask time {bitmask * 1e3:.1f} ms; serialized - overlapped = {saved * 1e3:.1f} ms; "
          f"hidden share {saved / bitmask:.0%}" if bitmask else "no bitmask computed")


if __name__ == "__main__":
    main()
