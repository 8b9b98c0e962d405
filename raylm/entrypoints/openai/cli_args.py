"""`raylm serve` and `raylm bench serve`: their flags and handlers, registered
into the CLI's parser by `add_serve_subcommand` and `add_bench_serve`."""

from __future__ import annotations

import argparse
from typing import TextIO


def add_serve_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from raylm.entrypoints.cli import HelpFormatter, add_engine_args, parse_bytes
    from raylm.entrypoints.openai.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS

    serve = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve MODEL (default: the embedded model) over an OpenAI-compatible API: "
                    "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /version.",
        formatter_class=HelpFormatter,
    )
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="Hugging Face model folder (same as --model)")
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model name(s) clients use; default: MODEL as given")
    server.add_argument("--shutdown-grace-period", type=float, default=10.0, metavar="SECONDS",
                        help="on SIGTERM/SIGINT, how long in-flight requests may run before they are ended")
    limits = serve.add_argument_group("limits")
    limits.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS, metavar="N",
                        help="requests that may wait beyond what the engine runs at once (--max-num-seqs; each "
                             "of a request's n completions per prompt counts); one more gets HTTP 429 with "
                             "Retry-After. The default queues 16 full batches: latency stays bounded and a "
                             "load balancer learns to go elsewhere")
    limits.add_argument("--max-request-body-bytes", type=parse_bytes, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        metavar="BYTES", help="largest request body (e.g. 16MiB); a larger one gets HTTP 413")
    add_engine_args(serve)
    serve.set_defaults(handler=run_serve)
    return serve


def run_serve(args: argparse.Namespace, out: TextIO) -> None:
    from raylm.entrypoints.cli import engine_kwargs_from_args
    from raylm.entrypoints.openai.api_server import run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"MODEL ({args.model_tag}) and --model ({args.model}) disagree; give one")
        args.model = args.model_tag
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.shutdown_grace_period < 0:
        raise ValueError(f"--shutdown-grace-period must be >= 0, got {args.shutdown_grace_period}")
    if args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    run_server(args, engine_kwargs_from_args(args))


def add_bench_serve(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from raylm.entrypoints.cli import HelpFormatter
    from raylm.entrypoints.openai import bench_serve

    parser = bench_subparsers.add_parser(
        "serve", help="load-test a running server with streaming completions",
        description="Send --num-prompts streaming completions to a running OpenAI-compatible server "
                    "and report throughput, TTFT, TPOT and ITL.",
        formatter_class=HelpFormatter,
    )
    bench_serve.add_bench_serve_args(parser)
    parser.set_defaults(handler=run_bench_serve)
    return parser


def run_bench_serve(args: argparse.Namespace, out: TextIO) -> None:
    from raylm.entrypoints.openai import bench_serve

    bench_serve.main(args, out)
