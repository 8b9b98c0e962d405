"""Where a decode step's time goes on one in-process engine: the parts of a step, timed.

One greedy request (--input-len in, --output-len out, EOS ignored) runs --runs
times after a warm-up; every call of each part of the step below is timed
(wall clock, inclusive: "model forward" holds "fused decode"). The table gives
each part's median time per call, over the quieter half of the runs (the
fastest by request time) and over all of them, and its calls per run. On a
small model most of a step is not the model's arithmetic; this shows which part
of the rest is what.

    python benchmarks/bench_step_parts.py --model /tmp/bench_models/llama-7m

For a before/after figure run it on both trees alternately, each from its own
folder (PYTHONPATH=<folder>), on the same machine at the same time.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

# (label, module, owner attribute or None for a module function, name). The
# labels' numbers give the nesting: 3.2.1 runs inside 3.2, inside 3.
PARTS = [
    ("0 engine step (LLMEngine.step)", "raylm.engine.llm_engine", "LLMEngine", "step"),
    ("1 engine core step", "raylm.engine.llm_engine", "InprocClient", "get_output"),
    ("2 scheduler.schedule", "raylm.core.scheduler", "Scheduler", "schedule"),
    ("2 scheduler.update_from_output", "raylm.core.scheduler", "Scheduler", "update_from_output"),
    ("3 runner.execute_model", "raylm.worker.model_runner", "ModelRunner", "execute_model"),
    ("3.1 input preparation (prepare_batch)", "raylm.worker.model_runner", None, "prepare_batch"),
    ("3.2 model forward", "raylm.model.llama", "LlamaForCausalLM", "forward"),
    ("3.2.1 fused decode layers (C++ call)", "raylm.model.llama_decode", "FusedDecode", "__call__"),
    ("4 runner.sample_tokens", "raylm.worker.model_runner", "ModelRunner", "sample_tokens"),
    ("4.1 LM head (C++ call, to float)", "raylm.model.layers.embedding", "LogitsProcessor", "forward"),
    ("4.2 sampling metadata", "raylm.worker.model_runner", "ModelRunner", "_sampling_metadata"),
    ("4.3 sampler: greedy argmax", "raylm.worker.model_runner", None, "greedy_tokens"),
    ("4.3 sampler: Sampler module", "raylm.worker.sampler", "Sampler", "forward"),
    ("5 output processing (+ detokenizer)", "raylm.engine.output_processor", "OutputProcessor", "process_outputs"),
]


def install_timers(times: dict[str, list[float]]) -> list[str]:
    """Wrap every part that this tree has; returns the labels of those it lacks."""
    import importlib

    missing = []
    for label, module_name, owner_name, name in PARTS:
        module = importlib.import_module(module_name)
        owner = module if owner_name is None else getattr(module, owner_name, None)
        original = getattr(owner, name, None)
        if original is None:
            missing.append(label)  # e.g. an older tree without the greedy fast path
            continue

        def timed(*args, _original=original, _label=label, **kwargs):
            t = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                times[_label].append(time.perf_counter() - t)

        setattr(owner, name, timed)
    return missing


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-threads", type=int, default=None, help="default: the engine's choice")
    args = parser.parse_args(argv)
    if args.runs < 1:
        raise ValueError("--runs must be at least 1")

    times: dict[str, list[float]] = collections.defaultdict(list)
    missing = install_timers(times)
    from raylm import LLM, SamplingParams

    llm = LLM(
        args.model, dtype=args.dtype, max_model_len=args.input_len + args.output_len + 16, num_threads=args.num_threads
    )
    try:
        vocab = llm.llm_engine.config.model_config.vocab_size
        prompt = {"prompt_token_ids": [(i * 37) % (vocab - 16) + 16 for i in range(args.input_len)]}
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        for _ in range(3):
            llm.generate([prompt], params, use_tqdm=False)
        runs = []
        for _ in range(args.runs):
            times.clear()
            t = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            runs.append((time.perf_counter() - t, {label: list(v) for label, v in times.items()}))
    finally:
        llm.shutdown()

    runs.sort(key=lambda run: run[0])
    quiet = runs[: max(1, len(runs) // 2)]
    print(
        f"{args.runs} runs of one request {args.input_len} -> {args.output_len}: "
        f"best {1e3 * runs[0][0]:.1f} ms, median {1e3 * statistics.median(r[0] for r in runs):.1f} ms"
    )
    print(f"{'part (us per call, median)':42s} {'quieter half':>12s} {'all runs':>9s} {'calls/run':>9s}")
    for label, *_ in PARTS:
        if label in missing:
            continue
        quiet_calls = [x for _, parts in quiet for x in parts.get(label, [])]
        all_calls = [x for _, parts in runs for x in parts.get(label, [])]
        if not all_calls:
            print(f"{label:42s} {'-':>12s} {'-':>9s} {0:9d}")
            continue
        print(
            f"{label:42s} {1e6 * statistics.median(quiet_calls or all_calls):12.1f} "
            f"{1e6 * statistics.median(all_calls):9.1f} {len(all_calls) / args.runs:9.0f}"
        )


if __name__ == "__main__":
    main()
