"""Per-step overhead at TP > 1: an engine step's time minus the model's.

For every step of one greedy batch, the engine side times `EngineCore.step`
(scheduling, sending the step to the ranks, waiting, applying the output) and
each rank times its own `execute_model` + `sample_tokens` (the forward with its
collectives, and sampling). overhead = step - the slowest rank's compute: what
the step transport, the engine loop and the wake-ups cost on top of the model.

    python benchmarks/bench_step_overhead.py --model /tmp/llama-7m --backend mp
    python benchmarks/bench_step_overhead.py --model /tmp/llama-7m --backend ray --transport cgraph
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import cloudpickle

# Workers cannot import this script by name: its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def install_timer(worker) -> None:
    """Wrap the rank's step methods so each call's duration is recorded."""
    worker.bench_times = {"execute_model": [], "sample_tokens": []}
    for name in worker.bench_times:
        original = getattr(worker, name)

        def timed(*args, _original=original, _name=name, **kwargs):
            t = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                worker.bench_times[_name].append(time.perf_counter() - t)

        setattr(worker, name, timed)


def take_times(worker) -> dict:
    times = {name: list(values) for name, values in worker.bench_times.items()}
    for values in worker.bench_times.values():
        values.clear()
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backend", default="mp", choices=["mp", "ray"])
    parser.add_argument("--transport", default="mq", choices=["mq", "cgraph"], help="ray only")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args(argv)

    if args.backend == "ray":
        import ray.cloudpickle

        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    from raylm import LLM, SamplingParams

    extra = {"ray_step_transport": args.transport} if args.backend == "ray" else {}
    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        distributed_executor_backend=args.backend,
        tensor_parallel_size=args.tp,
        kv_cache_memory_bytes=1 << 30,
        max_model_len=args.input_len + args.output_len + 16,
        **extra,
    )
    startup = time.perf_counter() - t0
    try:
        core = llm.llm_engine.engine_core.engine_core
        rng = random.Random(0)
        vocab = llm.llm_engine.config.model_config.vocab_size
        prompts = [
            {"prompt_token_ids": [rng.randrange(16, vocab) for _ in range(args.input_len)]}
            for _ in range(args.num_prompts)
        ]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        core.executor.collective_rpc(install_timer)
        step, step_s = core.step, []

        def timed_step():
            t = time.perf_counter()
            out = step()
            step_s.append(time.perf_counter() - t)
            return out

        core.step = timed_step
        llm.generate(prompts, params, use_tqdm=False)
        core.step = step
        ranks = core.executor.collective_rpc(take_times)
    finally:
        llm.shutdown()
    # Steps that ran a forward, in order; every rank ran each once.
    compute = [
        max(r["execute_model"][i] + (r["sample_tokens"][i] if i < len(r["sample_tokens"]) else 0.0) for r in ranks)
        for i in range(min(len(r["execute_model"]) for r in ranks))
    ]
    steps = step_s[: len(compute)]
    overhead = [s - c for s, c in zip(steps, compute)]
    name = args.backend + (f"/{args.transport}" if args.backend == "ray" else "")
    print(
        f"{name} TP={args.tp}: {len(steps)} steps, median step {1e3 * statistics.median(steps):.2f} ms, "
        f"median rank compute {1e3 * statistics.median(compute):.2f} ms, "
        f"median overhead {1e3 * statistics.median(overhead):.2f} ms "
        f"(p90 {1e3 * sorted(overhead)[int(0.9 * len(overhead))]:.2f} ms); start-up {startup:.1f} s"
    )


if __name__ == "__main__":
    main()
