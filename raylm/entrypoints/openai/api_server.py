"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) around an AsyncLLM, and
`run_server`, which `raylm serve` calls: load, serve, shut down gracefully.

Client mistakes are 400s with an OpenAI error body; a dead engine is a 503.
An engine dead for good (a fatal core error, or no restart left) makes the
server exit non-zero, so that its supervisor starts a fresh one.

Bounded (limits.py): a full queue is a 429 with Retry-After, an oversized body
a 413, too many prompts, completions or stop strings a 400. Shutdown always
finishes: on SIGTERM/SIGINT new requests get 503, in-flight ones have the grace
period, then every one still running is ended (streams with finish_reason
"abort" and [DONE], whole responses with a 503), and the engine core stops.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import raylm
from raylm.engine.async_llm import AsyncLLM
from raylm.engine.errors import EngineDeadError, EngineRecoveryTimeoutError, RequestFailedError
from raylm.entrypoints.openai.data_parallel_routes import install_data_parallel_routes, replica_states
from raylm.entrypoints.openai.limits import (
    AdmissionControl,
    BodySizeLimitMiddleware,
    ServerLimits,
    running_capacity,
)
from raylm.entrypoints.openai.metrics import PrometheusStatLogger
from raylm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelList
from raylm.entrypoints.openai.serving_chat import OpenAIServingChat
from raylm.entrypoints.openai.serving_common import ClientDisconnected, OpenAIError, error_response
from raylm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from raylm.entrypoints.openai.serving_lora import DEFAULT_MAX_SERVED_LORAS, ServedAdapters, install_lora_routes
from raylm.entrypoints.openai.serving_tokenize import install_tokenize_routes
from raylm.entrypoints.openai.serving_tools import ToolCallConfig
from raylm.entrypoints.openai.structured_outputs import StructuredOutputDefaults
from raylm.log_text import loggable, traceback_frames
from raylm.startup_heap import freeze_startup_heap

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "raylm-default"
# Status nginx uses for "client closed request"; nobody reads it, logs do.
_CLIENT_CLOSED = 499
# Exit status of a server whose engine died: a supervisor should restart it.
EXIT_ENGINE_DEAD = 1
# How long a server with a dead engine still answers (503, /health too) before
# it exits: long enough for load balancers and probes to see why.
_DEAD_ENGINE_LINGER_S = 2.0
# What answers without the API key: probes and scrapers. Everything else,
# /tokenize and /detokenize included, needs it.
_OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
# After the grace period, how often requests that reached the engine late
# (admitted just before shutdown began) are ended too.
_SWEEP_INTERVAL_S = 0.1


def _validation_param(error: dict) -> str | None:
    """The top-level field at fault (pydantic adds union members and indices after it)."""
    loc = [part for part in error.get("loc", ()) if part != "body"]
    if error.get("type") == "json_invalid" or not loc or not isinstance(loc[0], str):
        return None
    return loc[0]


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(f"malformed JSON body: {first.get('msg', '')}", 400)
        param = _validation_param(first)
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg', '')}"
            for e in errors[:3]
        )
        return error_response(message, 400, param)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(f"the engine is not running: {exc}", 503)

    @app.exception_handler(RequestFailedError)
    async def request_failed(request: Request, exc: RequestFailedError) -> JSONResponse:
        return error_response(str(exc), 500)

    @app.exception_handler(ClientDisconnected)
    async def client_disconnected(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=_CLIENT_CLOSED)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)


class UnhandledErrorMiddleware:
    """A 500 for a fault nothing else answered, logged with what the client
    wrote escaped (raylm.log_text): the decoded path and the exception's
    message, which may quote the body; the traceback's frames apart.

    Not Starlette's handler for Exception: that one answers, then re-raises
    to uvicorn, which logs the raw message ("Exception in ASGI application")."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.error(
                "unhandled error on %s: %s\n%s",
                loggable(scope.get("path", "")),
                loggable(f"{type(exc).__name__}: {exc}"),
                traceback_frames(exc),
            )
            if not started:  # else the answer is cut off: uvicorn closes the connection
                await error_response(f"internal server error: {type(exc).__name__}", 500)(scope, receive, send)


@dataclass
class CorsSettings:
    """Which cross-origin browser requests are answered; vLLM's defaults (any)."""

    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str],
    api_key: str | None = None,
    stat_logger: PrometheusStatLogger | None = None,
    limits: ServerLimits | None = None,
    cors: CorsSettings | None = None,
    tool_config: ToolCallConfig | None = None,
    trust_request_chat_template: bool = False,
    structured_outputs_defaults: StructuredOutputDefaults | None = None,
    reasoning_parser: str | None = None,
    host: str | None = None,
    adapters: ServedAdapters | None = None,
) -> FastAPI:
    """The app; `app.state.admission` is its AdmissionControl (closed at shutdown).
    `trust_request_chat_template`: render chat templates sent with requests.
    `host`: the address it is served on; without `api_key`, the admin routes
    (/scale, /replicas/{i}/restart) are refused unless it is a loopback one.
    `adapters`: the LoRA adapters served by name (default: none, and the
    run-time routes off)."""
    limits = limits or ServerLimits()
    cors = cors or CorsSettings()
    app = FastAPI(title="raylm", version=raylm.__version__)
    admission = AdmissionControl(
        running_capacity(engine),
        limits.max_waiting_requests,
        on_change=stat_logger.record_admitted if stat_logger is not None else None,
        on_refused=stat_logger.record_refused if stat_logger is not None else None,
    )
    app.state.admission = admission
    adapters = adapters or ServedAdapters(engine, served_model_names)
    app.state.adapters = adapters
    completions = OpenAIServingCompletion(engine, served_model_names, admission, adapters)
    chat = OpenAIServingChat(
        engine, served_model_names, admission, tool_config, trust_request_chat_template, reasoning_parser, adapters
    )
    _install_error_handlers(app)

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def check_api_key(request: Request, call_next):
            if request.url.path not in _OPEN_PATHS:
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    return error_response("missing or invalid API key (Authorization: Bearer ...)", 401)
            return await call_next(request)

    # A body is measured before anything else reads it.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=limits.max_request_body_bytes, on_refused=admission.refused)
    # Around them: a fault anywhere inside is answered (with the CORS headers)
    # and logged escaped.
    app.add_middleware(UnhandledErrorMiddleware)
    # Outermost: a browser's preflight is answered without an API key, and
    # every answer, errors too, carries the CORS headers the browser needs.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=cors.allowed_origins,
        allow_methods=cors.allowed_methods,
        allow_headers=cors.allowed_headers,
        allow_credentials=cors.allow_credentials,
    )

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        request._structured_outputs_defaults = structured_outputs_defaults
        with adapters.holding(request.model):
            return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        request._structured_outputs_defaults = structured_outputs_defaults
        with adapters.holding(request.model):
            return await chat.create(request, raw_request)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        max_len = engine.config.model_config.max_model_len
        return ModelList(data=adapters.cards(engine.config.model_config.model, max_len))

    install_lora_routes(app, adapters)

    @app.get("/health")
    async def health() -> Response:
        if admission.closed:
            return error_response("the server is shutting down", 503, error_type="service_unavailable")
        try:
            await engine.check_health()
        except EngineRecoveryTimeoutError as e:
            return error_response(str(e), 503, error_type="service_unavailable")
        except EngineDeadError as e:
            return error_response(f"the engine is not running: {e}", 503)
        body: dict[str, Any] = {}
        recovery = engine.recovery_status()
        if recovery is not None:
            # Still under its limit: serving resumes by itself, requests wait.
            body.update(
                status="recovering",
                recovering=recovery["recovering"],
                recovering_for_s=round(recovery["seconds"], 1),
                limit_s=recovery["limit_s"],
            )
        replicas = replica_states(engine)  # data parallel: each replica's state
        if replicas is not None:
            body["replicas"] = replicas
        return JSONResponse(body) if body else Response(status_code=200)

    install_tokenize_routes(app, engine, served_model_names, trust_request_chat_template)
    install_data_parallel_routes(
        app, engine, api_key, stat_logger, served_model_names[0] if served_model_names else "", host=host
    )

    @app.get("/metrics")
    async def metrics() -> Response:
        body = stat_logger.render() if stat_logger is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": raylm.__version__}

    return app


class GracefulServer(uvicorn.Server):
    """uvicorn's server with raylm's shutdown: on SIGTERM/SIGINT stop accepting
    (new requests on open connections get 503), give in-flight requests
    `grace_period` seconds, then end the rest with finish_reason "abort" so
    every stream still closes with [DONE]; a request that reaches the engine
    after that (it was admitted just before) is ended as soon as it does."""

    def __init__(
        self, config: uvicorn.Config, engine: AsyncLLM, grace_period: float, admission: AdmissionControl | None = None
    ):
        super().__init__(config)
        self.engine = engine
        self.grace_period = grace_period
        self.admission = admission
        self._loop: asyncio.AbstractEventLoop | None = None
        self._grace_task: asyncio.Task | None = None
        # Set when the server stopped because the engine died for good.
        self.engine_error: EngineDeadError | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        watcher = self._loop.create_task(self._stop_when_engine_dead(), name="raylm-engine-watcher")
        try:
            await super().serve(sockets)
        finally:
            watcher.cancel()
            if self._grace_task is not None:
                self._grace_task.cancel()

    async def _stop_when_engine_dead(self) -> None:
        """Every request already gets a 503 once the engine is dead; after a
        short linger, stop serving so run_server can exit non-zero."""
        error = await self.engine.wait_until_dead()
        logger.error("the engine is dead (%s); exiting in %.0fs", loggable(error, limit=1000), _DEAD_ENGINE_LINGER_S)
        await asyncio.sleep(_DEAD_ENGINE_LINGER_S)
        self.engine_error = error
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        # uvicorn would record the signal and re-raise it once serving ends,
        # killing the process before the engine core is stopped; we exit normally.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        if self._loop is not None and self._grace_task is None:
            self._loop.call_soon_threadsafe(self._start_grace)

    def _start_grace(self) -> None:
        if self.admission is not None:
            self.admission.close()
        if self._grace_task is None:
            self._grace_task = self._loop.create_task(self._end_in_flight(), name="raylm-shutdown-grace")

    def _num_in_flight(self) -> int:
        admitted = self.admission.in_flight if self.admission is not None else 0
        return max(admitted, self.engine.num_unfinished_requests)

    async def _end_in_flight(self) -> None:
        deadline = time.monotonic() + self.grace_period
        pending = self._num_in_flight()
        if pending:
            logger.info("shutting down: waiting up to %.1fs for %d request(s)", self.grace_period, pending)
        while self._num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.num_unfinished_requests:
            ended = self.engine.finish_all()
            logger.warning("shutting down: grace period over, ended %d request(s)", ended)
        # Until uvicorn is done (serve() cancels this): a request admitted
        # before shutdown began may reach the engine only now.
        while True:
            await asyncio.sleep(_SWEEP_INTERVAL_S)
            if self.engine.num_unfinished_requests:
                ended = self.engine.finish_all()
                logger.warning("shutting down: ended %d late request(s)", ended)


def served_model_names_from(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    return [args.model or DEFAULT_MODEL_NAME]


def startup_line(config: Any, names: list[str], args: argparse.Namespace) -> str:
    scheme = "https" if args.ssl_certfile else "http"
    mc, pc = config.model_config, config.parallel_config
    backend = pc.distributed_executor_backend or ("uni" if pc.world_size == 1 else "mp")
    backend = getattr(backend, "__name__", backend)  # a custom Executor class
    model = mc.model_name or "the embedded model"
    source = f" ({mc.model})" if mc.model_name and mc.model_name != mc.model else ""
    return (
        f"raylm {raylm.__version__} serving {model}{source} as {', '.join(names)} on "
        f"{scheme}://{args.host}:{args.port} | tp={pc.tensor_parallel_size} pp={pc.pipeline_parallel_size} "
        f"dp={pc.data_parallel_size} | executor={backend} device={config.device} dtype={mc.dtype} "
        f"max_model_len={mc.max_model_len}"
    )


def served_adapters_from(
    args: argparse.Namespace, engine: AsyncLLM, names: list[str], stat_logger: PrometheusStatLogger | None
) -> ServedAdapters:
    """--lora-modules, each checked against the base model now (a bad one
    stops the start, naming it), and the run-time settings (`raylm serve`'s,
    or a Ray Serve replica's: raylm.ray_serve)."""
    runtime = getattr(args, "allow_runtime_lora_updating", False)
    adapters = ServedAdapters(
        engine,
        names,
        getattr(args, "max_served_loras", DEFAULT_MAX_SERVED_LORAS),
        args.lora_directory if runtime else None,
    )
    if engine.config.lora_config is not None and stat_logger is not None:
        engine.input_processor.adapters.on_load = stat_logger.record_lora_load
        stat_logger.max_loras = engine.config.lora_config.max_loras
    for module in getattr(args, "lora_modules", None) or ():
        try:
            adapters.add(module.name, module.path, module.base_model_name)
        except ValueError as e:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {e}") from e
    return adapters


def run_server(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> None:
    """Load the model in the engine-core process, then serve until a signal."""
    names = served_model_names_from(args)
    stat_logger = PrometheusStatLogger(names[0])
    limits = ServerLimits(
        max_waiting_requests=args.max_waiting_requests, max_request_body_bytes=args.max_request_body_bytes
    )
    engine = AsyncLLM.from_engine_args(stat_loggers=[stat_logger], **engine_kwargs)
    try:
        adapters = served_adapters_from(args, engine, names, stat_logger)
        cors = CorsSettings(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)
        app = build_app(
            engine,
            names,
            api_key=args.api_key,
            stat_logger=stat_logger,
            limits=limits,
            cors=cors,
            tool_config=ToolCallConfig.from_args(args),
            trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
            structured_outputs_defaults=StructuredOutputDefaults.from_json(
                getattr(args, "structured_outputs_config", None)
            ),
            reasoning_parser=getattr(args, "reasoning_parser", None),
            host=args.host,
            adapters=adapters,
        )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level or args.log_level,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            # A backstop only: every request is ended at the grace period, and its
            # answer goes out at once (unless its client stopped reading). Shutdown
            # takes at most the grace period + 5 s: 2 s here, the rest for the core.
            timeout_graceful_shutdown=args.shutdown_grace_period + 2,
            timeout_keep_alive=5,
        )
        server = GracefulServer(config, engine, args.shutdown_grace_period, app.state.admission)
        # Printed whatever the log level: where to connect and what runs there.
        print(startup_line(engine.config, names, args), file=sys.stderr, flush=True)
        freeze_startup_heap()
        asyncio.run(server.serve())
    finally:
        engine.shutdown()
    if server.engine_error is not None:
        logger.error("exiting with status %d: %s", EXIT_ENGINE_DEAD, loggable(server.engine_error, limit=1000))
        raise SystemExit(EXIT_ENGINE_DEAD)
