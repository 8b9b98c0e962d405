"""The `raylm` command: `generate` for text, `serve` for the OpenAI-compatible
server (openai/cli_args.py), `plan` for a dry run of the placement (plan.py),
`bench latency|throughput|serve` for timing. Every command that runs an engine
takes the engine's flags, made from EngineArgs (spelled as in vLLM)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from typing import Any, TextIO

import raylm
from raylm.engine.arg_utils import EngineArgs, HelpFormatter
from raylm.engine.errors import EngineDeadError
from raylm.entrypoints import bench as bench_lib
from raylm.entrypoints.openai.cli_args import add_bench_serve, add_serve_subcommand
from raylm.entrypoints.plan import add_plan_subcommand

logger = logging.getLogger(__name__)

EXIT_USAGE_ERROR = 2
EXIT_ENGINE_DEAD = 1
LOG_LEVELS = ("debug", "info", "warning", "error")
# Printed between prompts by `raylm generate`, batch and streaming alike.
_SEPARATOR = "-" * 40 + "\n"


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
        "generate",
        help="complete one or more prompts and print the text",
        description="Complete each PROMPT and print it followed by its completion.",
        formatter_class=HelpFormatter,
    )
    generate.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to complete")
    sampling = generate.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=64, metavar="N", help="most tokens generated per prompt")
    sampling.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy")
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass, in (0, 1]")
    sampling.add_argument("--top-k", type=int, default=-1, metavar="K", help="keep the k most likely tokens; -1 = all")
    sampling.add_argument(
        "--stream", action="store_true", help="print tokens as they are generated (prompts still run as one batch)"
    )
    EngineArgs.add_cli_args(generate)
    generate.set_defaults(handler=run_generate)

    bench = commands.add_parser(
        "bench",
        help="measure latency or throughput on random-token prompts",
        description="Benchmarks with random prompt token ids, greedy, EOS ignored.",
    )
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    latency = bench_commands.add_parser(
        "latency",
        help="end-to-end latency of one batch (avg, p50/p90/p99), time to first token",
        description="Latency of one batch of --batch-size requests, over --num-iters iterations.",
        formatter_class=HelpFormatter,
    )
    bench_lib.add_latency_args(latency)
    EngineArgs.add_cli_args(latency)
    latency.set_defaults(handler=run_bench_latency)

    throughput = bench_commands.add_parser(
        "throughput",
        help="requests/s and tokens/s with all prompts submitted at once",
        description="Offline throughput: --num-prompts requests submitted together.",
        formatter_class=HelpFormatter,
    )
    bench_lib.add_throughput_args(throughput)
    EngineArgs.add_cli_args(throughput)
    throughput.set_defaults(handler=run_bench_throughput)

    # The OpenAI server's commands live with the server (raylm/entrypoints/openai).
    add_serve_subcommand(commands)
    add_bench_serve(bench_commands)
    add_plan_subcommand(commands)
    for command in (*commands.choices.values(), *bench_commands.choices.values()):
        if command is not bench and "log_level" not in {action.dest for action in command._actions}:
            command.add_argument(
                "--log-level", default="warning", choices=LOG_LEVELS, help="logging verbosity (stderr)"
            )
    return parser


def _sampling_params_from_args(args: argparse.Namespace) -> raylm.SamplingParams:
    return raylm.SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
    )


def run_generate(args: argparse.Namespace, out: TextIO) -> None:
    params = _sampling_params_from_args(args)
    with raylm.LLM(**EngineArgs.from_cli_args(args).to_kwargs()) as llm:
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


def stream_completions(llm: raylm.LLM, prompts: list[str], params: raylm.SamplingParams, out: TextIO) -> None:
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


def _run_bench(
    args: argparse.Namespace,
    out: TextIO,
    bench: Callable[..., dict],
    formatter: Callable[[dict], str],
    workload: dict[str, Any],
) -> None:
    # Checked before the model loads, which is the slow part.
    for name, value in workload.items():
        minimum = 0 if name == "num_iters_warmup" else 1
        if name not in ("seed", "detokenize") and value < minimum:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")
    with raylm.LLM(**EngineArgs.from_cli_args(args).to_kwargs()) as llm:
        result = bench(llm, **workload)
    out.write(formatter(result) + "\n")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        out.write(f"Results written to {args.output_json}\n")
    out.flush()


def run_bench_latency(args: argparse.Namespace, out: TextIO) -> None:
    _run_bench(
        args,
        out,
        bench_lib.bench_latency,
        bench_lib.format_latency,
        {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "batch_size": args.batch_size,
            "num_iters_warmup": args.num_iters_warmup,
            "num_iters": args.num_iters,
            "seed": args.seed,
            "detokenize": not args.disable_detokenize,
        },
    )


def run_bench_throughput(args: argparse.Namespace, out: TextIO) -> None:
    _run_bench(
        args,
        out,
        bench_lib.bench_throughput,
        bench_lib.format_throughput,
        {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_prompts": args.num_prompts,
            "seed": args.seed,
            "detokenize": not args.disable_detokenize,
        },
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
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
