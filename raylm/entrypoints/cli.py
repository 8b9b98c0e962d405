"""The `raylm` command: `raylm generate` for text, `raylm bench latency|throughput`
for timing. Engine flags are shared by every subcommand and spelled as in vLLM."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from typing import Any, Callable, TextIO

import raylm
from raylm.engine.core_client import EngineDeadError
from raylm.entrypoints import bench as bench_lib

logger = logging.getLogger(__name__)

EXIT_USAGE_ERROR = 2
EXIT_ENGINE_DEAD = 1
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# Printed between prompts by `raylm generate`, batch and streaming alike.
_SEPARATOR = "-" * 40 + "\n"
_BYTE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """`1073741824`, `512MiB`, `4G`, `1.5GB` -> bytes (units are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 1073741824, 512MiB, 4G)")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """vLLM's spelling of token counts: `4096`, `4k` (4000), `25.6k` (25600),
    `32K` (32768): a lowercase suffix is a power of 1000, an uppercase one a
    power of 1024 (whole numbers only)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 4096, 4k, 32K)")
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        hint = f"; did you mean {number}{suffix.lower()}?" if suffix else ""
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}{hint}")
    return int(number) * _BINARY_SUFFIXES.get(suffix, 1)


def max_model_len_arg(text: str) -> int | None:
    """--max-model-len: a token count, or auto (-1 too) for the model's own."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    return human_readable_int(text)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only when there is one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool) or action.default == argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The flags that build an `LLM`; every subcommand takes them."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="PATH|ID",
                       help="Hugging Face model folder (config.json, *.safetensors, tokenizer) or Hub id "
                            "(org/name, downloaded into the Hugging Face cache; HF_HUB_OFFLINE=1 uses the "
                            "cache only); default: the small model embedded in raylm")
    model.add_argument("--tokenizer", default=None, metavar="PATH|ID",
                       help="tokenizer folder or Hub id, if not the model's")
    model.add_argument("--revision", default=None, metavar="REV",
                       help="branch, tag or commit of a Hub model; default: main")
    model.add_argument("--tokenizer-revision", default=None, metavar="REV",
                       help="branch, tag or commit of a Hub --tokenizer; default: main")
    model.add_argument("--download-dir", default=None, metavar="DIR",
                       help="Hugging Face cache to download Hub models into; default: HF_HUB_CACHE, "
                            "else HF_HOME/hub, else ~/.cache/huggingface/hub")
    model.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                       help="auto: the model's generation_config.json sets the default temperature, top_p, "
                            "top_k, min_p and repetition_penalty of requests that leave them unset; vllm: "
                            "ignore those; DIR: read generation_config.json from DIR")
    model.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                       help="Jinja chat template (a file, or the template itself) used instead of the "
                            "tokenizer's by chat requests")
    model.add_argument("-q", "--quantization", default=None, metavar="METHOD",
                       help="accepted for vLLM compatibility; raylm loads unquantized checkpoints only, "
                            "so any method is refused")
    model.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM compatibility; raylm runs no code from model repositories")
    model.add_argument("--dtype", default="auto",
                       help="weight and activation dtype: auto (the checkpoint's; bfloat16 for float32 "
                            "checkpoints on CUDA and for float16 on CPU), float32, bfloat16, float16")
    model.add_argument("--max-model-len", type=max_model_len_arg, default=None, metavar="N",
                       help="longest sequence (prompt + output) in tokens, e.g. 4096, 4k (4000), 32K "
                            "(32768); default (or auto): the model's max_position_embeddings")
    model.add_argument("--seed", type=int, default=0, metavar="N",
                       help="random seed of sampling (and of the random prompts in benchmarks)")

    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                          help="split every layer across N workers")
    parallel.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1, metavar="N",
                          help="split the layers into N consecutive stages")
    parallel.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS, default=None,
                          help="how workers run: uni (in this process), mp (local processes), "
                               "ray (Ray actors, local or on a cluster); default: uni for one "
                               "worker, else mp")
    parallel.add_argument("-dp", "--data-parallel-size", type=int, default=1, metavar="N",
                          help="N replicas of the whole engine (each with its own scheduler, KV cache and "
                               "workers) as Ray actors, requests routed to the least loaded")
    parallel.add_argument("--data-parallel-backend", choices=("ray",), default="ray",
                          help="how data-parallel replicas run")
    parallel.add_argument("--data-parallel-placement", choices=("pack", "spread"), default="pack",
                          help="replicas packed onto as few nodes as possible, or spread one per node")
    parallel.add_argument("--data-parallel-prefix-affinity", action="store_true",
                          help="requests sharing a long prompt prefix prefer the replica that cached it")
    parallel.add_argument("--ray-address", default=None, metavar="ADDR",
                          help="Ray cluster to join (e.g. auto or HOST:6379); default: RAY_ADDRESS, "
                               "else a local Ray is started")
    parallel.add_argument("--ray-placement-strategy", choices=PLACEMENT_STRATEGIES, default="PACK",
                          help="how Ray places the workers' bundles across nodes")
    parallel.add_argument("--ray-step-transport", choices=("mq", "cgraph"), default=None,
                          help="how each step reaches Ray workers: mq (shared-memory/ZMQ message queues) "
                               "or cgraph (a Ray Compiled Graph); default: the engine's")

    cache = parser.add_argument_group("KV cache and scheduling")
    cache.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None, metavar="BYTES",
                       help="KV cache size per worker, e.g. 2GiB; default: sized from free device memory")
    cache.add_argument("--block-size", type=int, default=16, metavar="N", help="tokens per KV cache block")
    cache.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True,
                       help="reuse the KV cache of shared prompt prefixes (the default)")
    cache.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="do not reuse the KV cache of shared prompt prefixes")
    cache.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                       help="fraction of the GPU's memory for this instance's weights, activations and KV "
                            "cache (default 0.9); GPUs only (on CPU see --kv-cache-memory-bytes)")
    cache.add_argument("--enforce-eager", action="store_true",
                       help="accepted for vLLM compatibility; raylm always runs eagerly (no CUDA graphs)")
    cache.add_argument("--max-num-seqs", type=int, default=256, metavar="N", help="most requests in one batch")
    cache.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                       help="most tokens in one forward pass; default: the engine's")

    device = parser.add_argument_group("device")
    device.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when available, else cpu")
    device.add_argument("--num-threads", type=int, default=None, metavar="N",
                        help="torch threads per worker on CPU; default: planned from the usable cores "
                             "(one kept for the engine loop on small machines)")
    device.add_argument("--cpu-bind", default=None, metavar="auto|all|GROUPS",
                        help="CPU cores of each rank on a node: 'auto' (default; pins when a node runs several "
                             "ranks), 'all' (no pinning), or one group per rank, e.g. '0-3|4-7'; "
                             "VLLM_CPU_OMP_THREADS_BIND is read when unset")
    faults = parser.add_argument_group("failures and recovery")
    faults.add_argument("--max-restarts", type=int, default=3, metavar="N",
                        help="executor (and engine-core) rebuilds allowed within --restart-window; "
                             "one more and the engine is dead")
    faults.add_argument("--restart-window", type=float, default=600.0, metavar="SECONDS",
                        help="the window over which --max-restarts counts")
    faults.add_argument("--execute-model-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="a step that takes longer means a hung worker: the engine recovers")
    faults.add_argument("--engine-start-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="an engine core (or a worker's start-up call) not ready by then is taken for hung: "
                             "killed, and counted as a failed (re)start; /health answers 503 once a recovery "
                             "has run this long")
    faults.add_argument("--health-check-interval", type=float, default=5.0, metavar="SECONDS",
                        help="how often an idle engine asks every worker for a sign of life")
    parser.add_argument("--log-level", default="warning",
                        choices=("debug", "info", "warning", "error"), help="logging verbosity (stderr)")


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of `raylm.LLM` that the engine flags describe."""
    kwargs: dict[str, Any] = {
        "model": args.model,
        "tokenizer": args.tokenizer,
        "dtype": args.dtype,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "distributed_executor_backend": args.distributed_executor_backend,
        "enable_prefix_caching": args.enable_prefix_caching,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "ray_placement_strategy": args.ray_placement_strategy,
        "data_parallel_size": args.data_parallel_size,
        "data_parallel_backend": args.data_parallel_backend,
        "data_parallel_placement": args.data_parallel_placement,
        "data_parallel_prefix_affinity": args.data_parallel_prefix_affinity,
        "max_restarts": args.max_restarts,
        "restart_window": args.restart_window,
        "execute_model_timeout": args.execute_model_timeout,
        "engine_start_timeout": args.engine_start_timeout,
        "health_check_interval": args.health_check_interval,
    }
    # Unset optional flags stay out, so the engine's own defaults apply.
    for name in ("revision", "tokenizer_revision", "download_dir", "chat_template", "quantization",
                 "gpu_memory_utilization"):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    kwargs.update(generation_config=args.generation_config, trust_remote_code=args.trust_remote_code,
                  enforce_eager=args.enforce_eager)
    for name in ("ray_address", "ray_step_transport", "kv_cache_memory_bytes", "max_num_batched_tokens", "device", "num_threads",
                 "cpu_bind"):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    return kwargs


_EPILOG = """\
examples:
  raylm generate "ROMEO:" --max-tokens 32 --temperature 0      # greedy, embedded model
  raylm generate "ROMEO:" --stream -tp 2 --distributed-executor-backend ray
  raylm bench latency --input-len 32 --output-len 128 --batch-size 8 --dtype bfloat16
  raylm bench throughput --num-prompts 64 --output-json throughput.json

Every command takes the engine flags (--model, --dtype, -tp, -pp,
--distributed-executor-backend, --kv-cache-memory-bytes, ...);
`raylm COMMAND --help` explains each of them.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raylm",
        description="raylm: LLM inference whose model-parallel workers run as Ray actors.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"raylm {raylm.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    generate = commands.add_parser(
        "generate", help="complete one or more prompts and print the text",
        description="Complete each PROMPT and print it followed by its completion.",
        formatter_class=HelpFormatter,
    )
    generate.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to complete")
    sampling = generate.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64, metavar="N", help="most tokens generated per prompt")
    sampling.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy")
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass, in (0, 1]")
    sampling.add_argument("--top-k", type=int, default=-1, metavar="K", help="keep the k most likely tokens; -1 = all")
    sampling.add_argument("--stream", action="store_true",
                          help="print tokens as they are generated (prompts still run as one batch)")
    add_engine_args(generate)
    generate.set_defaults(handler=run_generate)

    bench = commands.add_parser("bench", help="measure latency or throughput on random-token prompts",
                                description="Benchmarks with random prompt token ids, greedy, EOS ignored.")
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    latency = bench_commands.add_parser(
        "latency", help="end-to-end latency of one batch (avg, p50/p90/p99), time to first token",
        description="Latency of one batch of --batch-size requests, over --num-iters iterations.",
        formatter_class=HelpFormatter,
    )
    bench_lib.add_latency_args(latency)
    add_engine_args(latency)
    latency.set_defaults(handler=run_bench_latency)

    throughput = bench_commands.add_parser(
        "throughput", help="requests/s and tokens/s with all prompts submitted at once",
        description="Offline throughput: --num-prompts requests submitted together.",
        formatter_class=HelpFormatter,
    )
    bench_lib.add_throughput_args(throughput)
    add_engine_args(throughput)
    throughput.set_defaults(handler=run_bench_throughput)

    # The OpenAI server's commands live with the server (raylm/entrypoints/openai).
    from raylm.entrypoints.openai.cli_args import add_bench_serve, add_serve_subcommand

    add_serve_subcommand(commands)
    add_bench_serve(bench_commands)
    from raylm.entrypoints.plan import add_plan_subcommand  # imports this module: kept local

    add_plan_subcommand(commands)
    return parser


def _sampling_params_from_args(args: argparse.Namespace) -> "raylm.SamplingParams":
    return raylm.SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
    )


def run_generate(args: argparse.Namespace, out: TextIO) -> None:
    params = _sampling_params_from_args(args)
    with raylm.LLM(**engine_kwargs_from_args(args)) as llm:
        if args.stream:
            stream_completions(llm, args.prompts, params, out)
            return
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
        for i, output in enumerate(outputs):
            if i:
                out.write(_SEPARATOR)
            completion = output.outputs[0]
            out.write(f"{args.prompts[i]}{completion.text}\n")
            if completion.finish_reason == "error":
                print(f"error: prompt {i} failed: {completion.error}", file=sys.stderr)
        out.flush()



def stream_completions(llm: "raylm.LLM", prompts: list[str], params: "raylm.SamplingParams", out: TextIO) -> None:
    """Run all prompts as one batch; print the first one's tokens live, buffer
    the others' and print each in turn, so the text never interleaves."""
    engine = llm.llm_engine
    validated = [engine.validate(p, params) for p in prompts]
    request_ids = []
    for processed, finished_params in validated:
        rid = engine.next_request_id()
        engine.add_validated_request(rid, processed, finished_params)
        request_ids.append(rid)
    buffered: dict[str, list[str]] = {rid: [] for rid in request_ids}
    finished: set[str] = set()
    current = 0
    out.write(prompts[0])
    out.flush()
    try:
        while current < len(request_ids):
            for delta in engine.step(stream=True):
                text = delta.outputs[0].text if delta.outputs else ""
                if delta.request_id == request_ids[current]:
                    out.write(text)
                    out.flush()
                elif delta.request_id in buffered:
                    buffered[delta.request_id].append(text)
                if delta.finished:
                    finished.add(delta.request_id)
            while current < len(request_ids) and request_ids[current] in finished:
                out.write("\n")
                current += 1
                if current < len(request_ids):
                    out.write(_SEPARATOR + prompts[current] + "".join(buffered.pop(request_ids[current])))
                out.flush()
            if current < len(request_ids) and not engine.has_unfinished_requests():
                raise RuntimeError("the engine stopped with requests unfinished")
    except BaseException:
        for rid in request_ids[current:]:
            engine.abort_request(rid)
        raise


def _run_bench(args: argparse.Namespace, out: TextIO, bench: Callable[..., dict],
               formatter: Callable[[dict], str], workload: dict[str, Any]) -> None:
    # Checked before the model loads, which is the slow part.
    for name, value in workload.items():
        minimum = 0 if name == "num_iters_warmup" else 1
        if name not in ("seed", "detokenize") and value < minimum:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")
    with raylm.LLM(**engine_kwargs_from_args(args)) as llm:
        result = bench(llm, **workload)
    out.write(formatter(result) + "\n")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        out.write(f"Results written to {args.output_json}\n")
    out.flush()


def run_bench_latency(args: argparse.Namespace, out: TextIO) -> None:
    _run_bench(args, out, bench_lib.bench_latency, bench_lib.format_latency, {
        "input_len": args.input_len, "output_len": args.output_len, "batch_size": args.batch_size,
        "num_iters_warmup": args.num_iters_warmup, "num_iters": args.num_iters, "seed": args.seed,
        "detokenize": not args.disable_detokenize,
    })


def run_bench_throughput(args: argparse.Namespace, out: TextIO) -> None:
    _run_bench(args, out, bench_lib.bench_throughput, bench_lib.format_throughput, {
        "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
        "seed": args.seed, "detokenize": not args.disable_detokenize,
    })


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args.handler(args, sys.stdout)
    except ValueError as e:
        # Bad input (a wrong path, an impossible setting): the message is the
        # whole story, a traceback would only hide it.
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return EXIT_USAGE_ERROR
    except EngineDeadError as e:
        # Recovery gave up (see --max-restarts): say why, without a traceback.
        print(f"error: the engine is dead: {e}", file=sys.stderr)
        return EXIT_ENGINE_DEAD
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
