"""`raylm serve` and `raylm bench serve`: their flags and handlers, registered
into the CLI's parser by `add_serve_subcommand` and `add_bench_serve`."""

from __future__ import annotations

import argparse
import json
import os
from typing import TextIO

from raylm.engine.arg_utils import EngineArgs, HelpFormatter, parse_bytes

# Where the API key may come from when --api-key is not given, first match wins
# (VLLM_API_KEY, so that a vLLM deployment's environment works unchanged).
API_KEY_ENV_VARS = ("RAYLM_API_KEY", "VLLM_API_KEY")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def resolve_api_key(flag_value: str | None) -> str | None:
    """--api-key, else the first of API_KEY_ENV_VARS that is set, else no key."""
    if flag_value is not None:
        return flag_value
    return next((os.environ[name] for name in API_KEY_ENV_VARS if os.environ.get(name)), None)


def json_list(text: str) -> list[str]:
    """vLLM's spelling of a list flag: a JSON list (["*"]); a plain word or a
    comma-separated list is taken too."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return [part.strip() for part in text.split(",") if part.strip()]
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def add_serve_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from raylm.entrypoints.openai.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS

    serve = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve MODEL (default: the embedded model) over an OpenAI-compatible API: "
        "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /version.",
        formatter_class=HelpFormatter,
    )
    serve.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="Hugging Face model folder (same as --model)"
    )
    server = serve.add_argument_group("server")
    server.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; on any but a loopback one (127.0.0.1, ::1, localhost), "
        "POST /scale and /replicas/{i}/restart need --api-key",
    )
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every endpoint but /health, /metrics and "
        "/version; default: RAYLM_API_KEY, else VLLM_API_KEY, else no key (then every "
        "endpoint answers anyone who reaches --host, except the admin ones, /scale and "
        "/replicas/{i}/restart, which a non-loopback --host refuses with HTTP 403)",
    )
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat_template sent with a request (chat completions, /tokenize); without "
        "it such a request gets HTTP 400. Any render is bounded in time and size",
    )
    server.add_argument(
        "--ssl-keyfile",
        default=None,
        metavar="FILE",
        help="serve HTTPS with this private key (PEM), with --ssl-certfile",
    )
    server.add_argument(
        "--ssl-certfile",
        default=None,
        metavar="FILE",
        help="serve HTTPS with this certificate (PEM), with --ssl-keyfile",
    )
    server.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=UVICORN_LOG_LEVELS,
        help="uvicorn's log level (info logs every request); default: --log-level",
    )
    server.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted for vLLM compatibility: raylm does not log request contents",
    )
    cors = serve.add_argument_group("CORS (browsers calling the API from other origins)")
    cors.add_argument(
        "--allowed-origins",
        type=json_list,
        default=["*"],
        metavar="JSON",
        help="origins allowed, as a JSON list, e.g. '[\"https://app.example\"]'",
    )
    cors.add_argument(
        "--allowed-methods", type=json_list, default=["*"], metavar="JSON", help="HTTP methods allowed, as a JSON list"
    )
    cors.add_argument(
        "--allowed-headers",
        type=json_list,
        default=["*"],
        metavar="JSON",
        help="request headers allowed, as a JSON list",
    )
    cors.add_argument(
        "--allow-credentials",
        action="store_true",
        help="allow cookies and Authorization headers on cross-origin requests",
    )
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model name(s) clients use; default: MODEL as given",
    )
    server.add_argument(
        "--shutdown-grace-period",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long in-flight requests may run before they are ended",
    )
    limits = serve.add_argument_group("limits")
    limits.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        metavar="N",
        help="requests that may wait beyond what the engine runs at once (--max-num-seqs; each "
        "of a request's n completions per prompt counts); one more gets HTTP 429 with "
        "Retry-After. The default queues 16 full batches: latency stays bounded and a "
        "load balancer learns to go elsewhere",
    )
    limits.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        metavar="BYTES",
        help="largest request body (e.g. 16MiB); a larger one gets HTTP 413",
    )
    add_tool_calling_args(serve)
    add_lora_serving_args(serve)
    from raylm.entrypoints.openai.reasoning_parsers import reasoning_parser_names

    reasoning = serve.add_argument_group("reasoning models")
    reasoning.add_argument(
        "--reasoning-parser",
        default=None,
        choices=reasoning_parser_names(),
        help="split the model's <think>...</think> from its answer: the thinking goes to "
        "reasoning_content (streamed as deltas), the rest to content, and structured "
        "outputs hold from the end of the thinking (qwen3: Qwen3; deepseek_r1: "
        "DeepSeek-R1 and its distills, QwQ)",
    )
    structured = serve.add_argument_group("structured outputs")
    structured.add_argument(
        "--structured-outputs-config",
        default=None,
        metavar="JSON",
        help="JSON whitespace for requests that do not choose it, as vLLM's flag: "
        "'{\"disable_any_whitespace\": true}' (none at all) or "
        '\'{"whitespace_pattern": "REGEX"}\'; default: one space, or a newline and an '
        "indent of at most 20, between JSON tokens (a weak model cannot spin on blanks)",
    )
    EngineArgs.add_cli_args(serve)
    serve.set_defaults(handler=run_serve)
    return serve


def add_tool_calling_args(serve: argparse.ArgumentParser) -> None:
    from raylm.entrypoints.openai.tool_parsers import tool_parser_names

    tools = serve.add_argument_group("tool calling")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto", the default when '
        "a request has tools); needs --tool-call-parser",
    )
    tools.add_argument(
        "--tool-call-parser",
        default=None,
        choices=tool_parser_names(),
        help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>: Qwen2/2.5, "
        "Qwen3, Hermes), llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS]), qwen3_xml / "
        "qwen3_coder (Qwen3-Coder's <function=...> XML), pythonic ([f(a=1)]: Llama 3.2/4). "
        "A model whose own chat template does not write tools that way takes the one raylm "
        "ships for the parser: --chat-template raylm/entrypoints/openai/tool_parsers/"
        "templates/NAME.jinja",
    )


def add_lora_serving_args(serve: argparse.ArgumentParser) -> None:
    from raylm.entrypoints.openai.serving_lora import (
        DEFAULT_MAX_SERVED_LORAS,
        RUNTIME_UPDATING_ENV_VAR,
        parse_lora_module,
    )

    lora = serve.add_argument_group("LoRA adapters served by name (with --enable-lora)")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="adapters a request's model field names: name=path, or vLLM's JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; each is checked at start',
    )
    lora.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key; "
        f"{RUNTIME_UPDATING_ENV_VAR}=true does too); needs --lora-directory, and --api-key on a "
        "non-loopback --host",
    )
    lora.add_argument(
        "--lora-directory",
        default=None,
        metavar="DIR",
        help="the folder run-time loads read adapters from (a lora_path outside it, symlinks followed, is refused)",
    )
    lora.add_argument(
        "--max-served-loras",
        type=int,
        default=DEFAULT_MAX_SERVED_LORAS,
        metavar="N",
        help="adapters served by name at most (--lora-modules and run-time loads together)",
    )


def check_lora_serving_args(args: argparse.Namespace) -> None:
    """Refuse, before the model loads, LoRA serving flags that cannot work
    or would open the run-time routes to anyone."""
    from raylm.entrypoints.openai.data_parallel_routes import is_loopback_host
    from raylm.entrypoints.openai.serving_lora import runtime_updating_from_env

    args.allow_runtime_lora_updating = args.allow_runtime_lora_updating or runtime_updating_from_env()
    if (args.lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    if args.max_served_loras < 1:
        raise ValueError(f"--max-served-loras must be >= 1, got {args.max_served_loras}")
    if args.lora_modules and len(args.lora_modules) > args.max_served_loras:
        raise ValueError(f"--lora-modules: {len(args.lora_modules)} adapters, over --max-served-loras")
    if not args.allow_runtime_lora_updating:
        return
    if not args.lora_directory or not os.path.isdir(args.lora_directory):
        raise ValueError("--allow-runtime-lora-updating needs --lora-directory, an existing folder")
    if not args.api_key and not is_loopback_host(args.host):
        raise ValueError(
            f"--allow-runtime-lora-updating on a non-loopback --host ({args.host}) needs --api-key "
            "(or RAYLM_API_KEY): anyone who reaches the server could load adapters"
        )


def run_serve(args: argparse.Namespace, out: TextIO) -> None:
    from raylm.entrypoints.openai.api_server import run_server
    from raylm.entrypoints.openai.serving_tools import ToolCallConfig
    from raylm.entrypoints.openai.structured_outputs import StructuredOutputDefaults

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
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together; give both or neither")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag}: no such file {path!r}")
    ToolCallConfig.from_args(args)  # refuses a flag combination before the model loads
    StructuredOutputDefaults.from_json(args.structured_outputs_config)
    args.api_key = resolve_api_key(args.api_key)
    check_lora_serving_args(args)
    run_server(args, EngineArgs.from_cli_args(args).to_kwargs())


def add_bench_serve(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from raylm.entrypoints.openai import bench_serve

    parser = bench_subparsers.add_parser(
        "serve",
        help="load-test a running server with streaming completions",
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
