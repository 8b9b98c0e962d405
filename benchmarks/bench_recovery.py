"""What an executor failure costs: recovery in place (docs/architecture.md, "The failure model") timed per
scenario and model, and the idle heartbeat's effect on throughput (optional).

    python benchmarks/bench_recovery.py [--models small large] [--repeats 5] \\
        [--scenarios mp-kill ray-kill mp-hang] [--hang-timeout 5] [--throughput] \\
        [--model-root /tmp/raylm_bench_models] [--output-json recovery.json]

Models: the ~7M ("small") and ~111M ("large") random-weight bf16 Llama folders of
`compare_vllm.py --make-model`, written under --model-root on first use.

Scenarios, each on one engine (TP=2, num_threads=1 per worker) that serves every repeat:
  mp-kill   mp executor, SIGKILL of rank 1 mid-decode
  ray-kill  Ray executor (mq transport), SIGKILL of rank 1's actor process
  mp-hang   mp executor, SIGSTOP of rank 1; caught by execute_model_timeout (--hang-timeout)

Workload: 16 requests of 64 random prompt token ids, max_tokens 128, greedy, ignore_eos, prefix
caching off (so every repeat does the same work). The first run on each engine is uninterrupted:
it warms the engine up and is the oracle the struck runs' outputs must equal. Each repeat then
strikes once every request has >= 8 output tokens, and measures:
  detection   strike (time.monotonic() just before os.kill) -> RecoveryEvent.noticed_at
  recovery    strike -> return of the first engine step after the recovery that gave any
              request a new token (detection + rebuild + the re-queued requests' recompute)
  rebuild     RecoveryEvent.seconds: failure noticed -> new executor up, requests re-queued
The engine's restart budget is replaced with a fresh one before each strike: the budget backs
off 1, 2, 4 ... s before the k-th restart within its window, which would time the backoff,
not the recovery.

Greedy outputs are compared with the uninterrupted run's token for token. In bf16 they may
differ after the strike (never before it): the recovered requests recompute their KV cache in
one prefill, which rounds differently from the decode steps that built it first, and these
random-weight models have near-flat logits. So each scenario is also struck once in float32
(--fp32-check, the small model by default), where the outputs must be identical.

--throughput: the same workload through LLM.generate (mp TP=2) with health_check_interval 0.5 s
vs 1e9 s (off), one engine at a time, alternating over --throughput-rounds, plus the round
trip of one executor.check_health(), the heartbeat's cost per interval while idle. The
heartbeat runs only in an idle engine-core process (the server); LLM.generate's in-process
core never idles and never calls it, so the on/off ratio there can only show noise.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from compare_vllm import make_model, random_prompts

from raylm import LLM, SamplingParams
from raylm.engine.restart_budget import RestartBudget

logger = logging.getLogger("bench_recovery")

MODELS = {"small": "llama-7m", "large": "llama-111m"}  # --models name -> folder under --model-root
NUM_REQUESTS, PROMPT_LEN, MAX_TOKENS, STRIKE_AT_TOKENS = 16, 64, 128, 8
HEARTBEAT_ON_S, HEARTBEAT_OFF_S = 0.5, 1e9


@dataclass(frozen=True)
class Scenario:
    backend: str
    signum: int
    engine_kwargs: dict = field(default_factory=dict)


def scenarios(hang_timeout: float) -> dict[str, Scenario]:
    return {
        "mp-kill": Scenario("mp", signal.SIGKILL),
        "ray-kill": Scenario("ray", signal.SIGKILL, {"ray_step_transport": "mq"}),
        "mp-hang": Scenario("mp", signal.SIGSTOP, {"execute_model_timeout": hang_timeout}),
    }


@dataclass
class Repeat:
    kind: str
    detection_s: float
    recovery_to_first_token_s: float
    rebuild_s: float
    num_requests: int
    identical_requests: int  # of NUM_REQUESTS, token for token against the uninterrupted run
    # Requests whose tokens generated before the strike equal the uninterrupted run's (all of
    # them, unless something before the failure already differed).
    identical_before_strike: int
    tokens_at_strike: list[int] = field(default_factory=list)
    first_divergence: list[int | None] = field(default_factory=list)  # token index, None if identical


@dataclass
class ScenarioResult:
    scenario: str
    model: str
    dtype: str
    build_s: float
    decode_step_ms: float  # median step of the uninterrupted run, for scale
    repeats: list[Repeat] = field(default_factory=list)
    deadline_s: float | None = None  # mp-hang: the execute_model_timeout the detection includes
    error: str | None = None


def _core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def drive(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str, strike: Callable[[], float] | None = None
) -> dict[str, Any]:
    """Run the requests through LLMEngine.step (streaming deltas), calling `strike()` (which
    returns the strike's monotonic time) once every request has STRIKE_AT_TOKENS tokens."""
    engine = llm.llm_engine
    core = _core(llm)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    finished: set[str] = set()
    recoveries_before = len(core.recoveries)
    struck_at = first_token_at = None
    tokens_at_strike: list[int] = []
    step_s: list[float] = []
    while engine.has_unfinished_requests():
        t0 = time.monotonic()
        outputs = engine.step(stream=True)
        t1 = time.monotonic()
        step_s.append(t1 - t0)
        grew = False
        for out in outputs:
            delta = out.outputs[0].token_ids
            grew |= bool(delta)
            tokens[out.request_id].extend(delta)
            if out.finished:
                finished.add(out.request_id)
        if struck_at is not None and first_token_at is None and grew and len(core.recoveries) > recoveries_before:
            first_token_at = t1
        if strike is not None and struck_at is None and all(len(t) >= STRIKE_AT_TOKENS for t in tokens.values()):
            if finished:
                raise RuntimeError(f"{len(finished)} request(s) finished before the strike")
            tokens_at_strike = [len(tokens[rid]) for rid in ids]
            struck_at = strike()
    if strike is not None and struck_at is None:
        raise RuntimeError("the workload ended before the strike")
    return {
        "tokens": [tokens[rid] for rid in ids],
        "struck_at": struck_at,
        "first_token_at": first_token_at,
        "tokens_at_strike": tokens_at_strike,
        "new_recoveries": core.recoveries[recoveries_before:],
        "step_s": step_s,
    }


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def run_scenario(
    name: str,
    scenario: Scenario,
    model_name: str,
    model_dir: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    struck: list[psutil.Process],
    dtype: str = "bfloat16",
    repeats: int | None = None,
) -> ScenarioResult:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    t0 = time.monotonic()
    repeats = args.repeats if repeats is None else repeats
    llm = LLM(
        model_dir,
        dtype=dtype,
        tensor_parallel_size=2,
        distributed_executor_backend=scenario.backend,
        num_threads=1,
        enable_prefix_caching=False,
        max_model_len=PROMPT_LEN + MAX_TOKENS + 16,
        kv_cache_memory_bytes=args.kv_cache_mib << 20,
        max_restarts=1000,
        restart_window=3600.0,
        **scenario.engine_kwargs,
    )
    result = ScenarioResult(
        name,
        model_name,
        dtype,
        build_s=time.monotonic() - t0,
        decode_step_ms=float("nan"),
        deadline_s=scenario.engine_kwargs.get("execute_model_timeout"),
    )
    try:
        reference = drive(llm, prompts, params, tag="ref")
        result.decode_step_ms = statistics.median(reference["step_s"][1:]) * 1e3
        logger.info(
            "%s/%s/%s: engine built in %.1f s, uninterrupted run %.1f s (%.1f ms/step)",
            name,
            model_name,
            dtype,
            result.build_s,
            sum(reference["step_s"]),
            result.decode_step_ms,
        )
        core = _core(llm)
        ft = core.config.fault_tolerance
        for i in range(repeats):
            core.restart_budget = RestartBudget(ft.max_restarts, ft.restart_window_s)  # no backoff: see top

            def strike() -> float:
                proc = psutil.Process(core.executor.worker_pids[1])
                struck.append(proc)
                at = time.monotonic()
                os.kill(proc.pid, scenario.signum)
                return at

            run = drive(llm, prompts, params, tag=f"r{i}", strike=strike)
            if len(run["new_recoveries"]) != 1:
                raise RuntimeError(f"expected one recovery, got {[e.kind for e in run['new_recoveries']]}")
            event = run["new_recoveries"][0]
            ref_tokens = reference["tokens"]
            divergence = [_first_divergence(a, b) for a, b in zip(run["tokens"], ref_tokens)]
            rep = Repeat(
                kind=event.kind,
                detection_s=event.noticed_at - run["struck_at"],
                recovery_to_first_token_s=run["first_token_at"] - run["struck_at"],
                rebuild_s=event.seconds,
                num_requests=event.num_requests,
                identical_requests=sum(d is None for d in divergence),
                identical_before_strike=sum(d is None or d >= n for d, n in zip(divergence, run["tokens_at_strike"])),
                tokens_at_strike=run["tokens_at_strike"],
                first_divergence=divergence,
            )
            result.repeats.append(rep)
            logger.info(
                "%s/%s/%s repeat %d: %s, detection %.0f ms, recovery to first token %.2f s, rebuild %.2f s, "
                "%d/%d identical",
                name,
                model_name,
                dtype,
                i,
                rep.kind,
                rep.detection_s * 1e3,
                rep.recovery_to_first_token_s,
                rep.rebuild_s,
                rep.identical_requests,
                NUM_REQUESTS,
            )
    except Exception as e:  # report it and go on with the next scenario
        logger.exception("%s/%s/%s failed", name, model_name, dtype)
        result.error = f"{type(e).__name__}: {e}"
    finally:
        llm.shutdown()
        kill_leftovers(struck)
    return result


def kill_leftovers(struck: list[psutil.Process]) -> None:
    """A struck worker the executor's shutdown left behind (a SIGSTOPped one above all) is
    killed here; psutil.Process checks the creation time, so a reused pid is never hit."""
    for proc in struck:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                logger.warning("killing leftover struck worker pid %d", proc.pid)
                proc.kill()
        except psutil.NoSuchProcess:
            pass


def measure_throughput(
    model_name: str, model_dir: str, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    """Same workload through LLM.generate (mp TP=2), heartbeat on (0.5 s) vs off (1e9 s), one
    engine at a time, alternating the order round by round; plus the heartbeat's own cost."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    rates: dict[str, list[float]] = {"on": [], "off": []}
    check_health_ms: list[float] = []
    for round_index in range(args.throughput_rounds):
        order = ["on", "off"] if round_index % 2 == 0 else ["off", "on"]
        for label in order:
            interval = HEARTBEAT_ON_S if label == "on" else HEARTBEAT_OFF_S
            llm = LLM(
                model_dir,
                dtype="bfloat16",
                tensor_parallel_size=2,
                distributed_executor_backend="mp",
                num_threads=1,
                enable_prefix_caching=False,
                max_model_len=PROMPT_LEN + MAX_TOKENS + 16,
                kv_cache_memory_bytes=args.kv_cache_mib << 20,
                health_check_interval=interval,
            )
            try:
                llm.generate(
                    [{"prompt_token_ids": p} for p in prompts[:2]],
                    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False),
                    use_tqdm=False,
                )
                t = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                elapsed = time.perf_counter() - t
                rates[label].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
                if label == "on":
                    executor = _core(llm).executor
                    for _ in range(20):
                        t = time.perf_counter()
                        executor.check_health()
                        check_health_ms.append((time.perf_counter() - t) * 1e3)
            finally:
                llm.shutdown()
            logger.info(
                "throughput %s round %d heartbeat %s: %.1f out tok/s", model_name, round_index, label, rates[label][-1]
            )
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    rtt = statistics.median(check_health_ms)
    return {
        "model": model_name,
        "rounds": args.throughput_rounds,
        "tok_s_on": rates["on"],
        "tok_s_off": rates["off"],
        "median_tok_s_on": on,
        "median_tok_s_off": off,
        "ratio_on_off": on / off,
        "check_health_ms_median": rtt,
        "idle_heartbeat_duty": rtt / 1e3 / HEARTBEAT_ON_S,
    }


def _fmt(values: list[float], scale: float, digits: int) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.{digits}f} [{min(v):.{digits}f}-{max(v):.{digits}f}]"


def _identity_cell(r: ScenarioResult) -> str:
    reps = r.repeats
    if all(x.identical_requests == NUM_REQUESTS for x in reps):
        return "yes"
    counts = ", ".join(str(x.identical_requests) for x in reps)
    before = (
        "all equal before the strike"
        if all(x.identical_before_strike == NUM_REQUESTS for x in reps)
        else "DIFFER BEFORE the strike"
    )
    return f"no ({counts} of {NUM_REQUESTS}; {before})"


def _identity_line(r: ScenarioResult) -> str:
    reps = r.repeats
    n, total = sum(x.identical_requests for x in reps), NUM_REQUESTS * len(reps)
    head = (
        f"- {r.scenario}/{r.model}/{r.dtype}: greedy outputs after recovery "
        f"{'equal' if n == total else 'NOT all equal'} to the uninterrupted run's: {n}/{total} requests "
        f"over {len(reps)} strike(s) ({', '.join(sorted({x.kind for x in reps}))}, "
        f"{reps[0].num_requests} requests re-queued)"
    )
    if n == total:
        return head
    diverged = [d for x in reps for d in x.first_divergence if d is not None]
    at_strike = [t for x in reps for t in x.tokens_at_strike]
    before = sum(x.identical_before_strike for x in reps)
    return (
        f"{head}; {before}/{total} equal up to the strike (at {min(at_strike)}-{max(at_strike)} tokens), "
        f"the others first differ at token {min(diverged)}-{max(diverged)} "
        f"(median {statistics.median(diverged):g})"
    )


def print_report(
    results: list[ScenarioResult],
    checks: list[ScenarioResult],
    throughput: list[dict[str, Any]],
    args: argparse.Namespace,
) -> None:
    print(
        f"\n## Recovery in place: TP=2, bf16, num_threads=1 per worker, {NUM_REQUESTS} requests x "
        f"{PROMPT_LEN} prompt tokens -> {MAX_TOKENS} tokens, strike at >= {STRIKE_AT_TOKENS} tokens each, "
        f"{args.repeats} repeats on one engine\n"
    )
    print(
        "| scenario | model | detection ms median [min-max] | recovery to first token s median [min-max] "
        "| rebuild s median | decode step ms | outputs identical |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if not r.repeats:
            print(f"| {r.scenario} | {r.model} | failed: {r.error} | | | | |")
            continue
        reps = r.repeats
        print(
            f"| {r.scenario} | {r.model} | {_fmt([x.detection_s for x in reps], 1e3, 0)} | "
            f"{_fmt([x.recovery_to_first_token_s for x in reps], 1, 2)} | "
            f"{statistics.median(x.rebuild_s for x in reps):.2f} | {r.decode_step_ms:.1f} | {_identity_cell(r)} |"
        )
    print()
    for r in results:
        if r.deadline_s is not None and r.repeats:
            over = [x.detection_s - r.deadline_s for x in r.repeats]
            print(
                f"- {r.scenario}/{r.model}: detection minus the {r.deadline_s:g} s execute_model_timeout: "
                f"{_fmt(over, 1e3, 0)} ms"
            )
    for r in results + checks:
        if r.repeats:
            print(_identity_line(r))
        if r.error:
            print(f"- {r.scenario}/{r.model}/{r.dtype}: stopped early: {r.error}")
    if any(x.identical_requests < NUM_REQUESTS for r in results for x in r.repeats):
        print(
            "- Why bf16 can differ: a recovered request recomputes its KV cache in one prefill of prompt + "
            "generated tokens, where the uninterrupted run built it token by token in decode steps; in bf16 "
            "the two round differently and the near-flat logits of these random-weight models flip greedy "
            "ties (a new request whose prompt is an old one's prompt + first tokens diverges alike, no failure "
            "involved). The float32 strikes above are the exactness check."
        )
    if throughput:
        print(
            f"\n## Heartbeat on ({HEARTBEAT_ON_S} s) vs off ({HEARTBEAT_OFF_S:g} s): LLM.generate, mp TP=2, "
            f"median of {args.throughput_rounds} alternating rounds\n"
        )
        print("| model | out tok/s on | out tok/s off | on/off | check_health round trip ms | idle duty at 0.5 s |")
        print("|---|---|---|---|---|---|")
        for t in throughput:
            print(
                f"| {t['model']} | {t['median_tok_s_on']:.1f} | {t['median_tok_s_off']:.1f} | "
                f"{t['ratio_on_off']:.3f} | {t['check_health_ms_median']:.2f} | {t['idle_heartbeat_duty']:.2%} |"
            )
        print(
            "\nNote: the heartbeat runs only while the engine core is idle (EngineCoreProc's loop, i.e. the "
            "server); LLM.generate drives the in-process core, which never idles between steps and never "
            "calls check_health_if_due, so on/off run identical code here and the ratio is noise. The idle "
            "cost is the round trip of one executor.check_health() every interval (last column)."
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small", "large"], choices=sorted(MODELS))
    parser.add_argument(
        "--model-root", default="/tmp/raylm_bench_models", help="where the model folders are (written there if missing)"
    )
    parser.add_argument(
        "--scenarios", nargs="+", default=["mp-kill", "ray-kill", "mp-hang"], choices=["mp-kill", "ray-kill", "mp-hang"]
    )
    parser.add_argument("--repeats", type=int, default=5, help="strikes per scenario and model")
    parser.add_argument("--hang-timeout", type=float, default=5.0, help="execute_model_timeout of mp-hang, s")
    parser.add_argument("--kv-cache-mib", type=int, default=64, help="KV cache per rank, MiB")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt token ids")
    parser.add_argument(
        "--fp32-check",
        default="small",
        choices=[*sorted(MODELS), "none"],
        help="also strike each scenario once on this model in float32, where greedy outputs must "
        "equal the uninterrupted run's token for token (bf16 recompute may flip ties)",
    )
    parser.add_argument("--throughput", action="store_true", help="also compare throughput, heartbeat on vs off")
    parser.add_argument("--throughput-rounds", type=int, default=3)
    parser.add_argument("--output-json", help="write the results here as JSON")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # The engine logs every recovery at WARNING/ERROR; expected here, so keep the output readable.
    logging.getLogger("raylm").setLevel(logging.CRITICAL if args.log_level == "INFO" else args.log_level)
    catalog = scenarios(args.hang_timeout)
    uses_ray = "ray-kill" in args.scenarios
    if uses_ray:
        import ray

        # A Ray of our own, never a cluster another process left running on this host.
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    results: list[ScenarioResult] = []
    checks: list[ScenarioResult] = []
    throughput: list[dict[str, Any]] = []
    struck: list[psutil.Process] = []
    try:
        for model_name in args.models:
            model_dir = pathlib.Path(args.model_root, MODELS[model_name])
            if not (model_dir / "config.json").exists():
                make_model(model_name, str(model_dir))
            vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            prompts = random_prompts(NUM_REQUESTS, PROMPT_LEN, vocab_size, args.seed)
            for name in args.scenarios:
                results.append(run_scenario(name, catalog[name], model_name, str(model_dir), prompts, args, struck))
            if args.fp32_check == model_name:
                for name in args.scenarios:
                    checks.append(
                        run_scenario(
                            name,
                            catalog[name],
                            model_name,
                            str(model_dir),
                            prompts,
                            args,
                            struck,
                            dtype="float32",
                            repeats=1,
                        )
                    )
            if args.throughput:
                throughput.append(measure_throughput(model_name, str(model_dir), prompts, args))
    finally:
        kill_leftovers(struck)
        if uses_ray:
            ray.shutdown()
    print_report(results, checks, throughput, args)
    if args.output_json:
        report = {
            "args": vars(args),
            "workload": {
                "num_requests": NUM_REQUESTS,
                "prompt_len": PROMPT_LEN,
                "max_tokens": MAX_TOKENS,
                "strike_at_tokens": STRIKE_AT_TOKENS,
            },
            "scenarios": [asdict(r) for r in results],
            "fp32_checks": [asdict(r) for r in checks],
            "throughput": throughput,
        }
        pathlib.Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
