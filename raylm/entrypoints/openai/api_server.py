"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) around an AsyncLLM, and
`run_server`, which `raylm serve` calls: load, serve, shut down gracefully.

Client mistakes are 400s with an OpenAI error body; a dead engine is a 503.
An engine dead for good (a fatal core error, or no restart left) makes the
server exit non-zero, so that its supervisor starts a fresh one.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import signal
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import raylm
from raylm.engine.async_llm import AsyncLLM, RequestFailedError
from raylm.engine.core_client import EngineDeadError
from raylm.entrypoints.openai.metrics import PrometheusStatLogger
from raylm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from raylm.entrypoints.openai.serving_chat import OpenAIServingChat
from raylm.entrypoints.openai.serving_common import ClientDisconnected, OpenAIError, error_response
from raylm.entrypoints.openai.serving_completion import OpenAIServingCompletion

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "raylm-default"
# Status nginx uses for "client closed request"; nobody reads it, logs do.
_CLIENT_CLOSED = 499
# Exit status of a server whose engine died: a supervisor should restart it.
EXIT_ENGINE_DEAD = 1
# How long a server with a dead engine still answers (503, /health too) before
# it exits: long enough for load balancers and probes to see why.
_DEAD_ENGINE_LINGER_S = 2.0


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

    @app.exception_handler(Exception)
    async def server_fault(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(f"internal server error: {type(exc).__name__}", 500)


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: str | None = None,
              stat_logger: PrometheusStatLogger | None = None) -> FastAPI:
    app = FastAPI(title="raylm", version=raylm.__version__)
    completions = OpenAIServingCompletion(engine, served_model_names)
    chat = OpenAIServingChat(engine, served_model_names)
    _install_error_handlers(app)

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def check_api_key(request: Request, call_next):
            if request.url.path.startswith("/v1"):
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    return error_response("missing or invalid API key (Authorization: Bearer ...)", 401)
            return await call_next(request)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create(request, raw_request)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        max_len = engine.config.model_config.max_model_len
        root = engine.config.model_config.model
        return ModelList(data=[ModelCard(id=name, root=root, max_model_len=max_len) for name in served_model_names])

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except EngineDeadError as e:
            return error_response(f"the engine is not running: {e}", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = stat_logger.render() if stat_logger is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": raylm.__version__}

    return app


class GracefulServer(uvicorn.Server):
    """uvicorn's server with raylm's shutdown: on SIGTERM/SIGINT stop accepting,
    give in-flight requests `grace_period` seconds, then end the rest with
    finish_reason "abort" so every stream still closes with [DONE]."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, grace_period: float):
        super().__init__(config)
        self.engine = engine
        self.grace_period = grace_period
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

    async def _stop_when_engine_dead(self) -> None:
        """Every request already gets a 503 once the engine is dead; after a
        short linger, stop serving so run_server can exit non-zero."""
        error = await self.engine.wait_until_dead()
        logger.error("the engine is dead (%s); exiting in %.0fs", error, _DEAD_ENGINE_LINGER_S)
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
        if self._grace_task is None:
            self._grace_task = self._loop.create_task(self._end_in_flight())

    async def _end_in_flight(self) -> None:
        pending = self.engine.num_unfinished_requests
        if pending:
            logger.info("shutting down: waiting up to %.1fs for %d request(s)", self.grace_period, pending)
        if not await self.engine.wait_until_idle(self.grace_period):
            ended = self.engine.finish_all()
            logger.warning("shutting down: grace period over, ended %d request(s)", ended)


def served_model_names_from(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    return [args.model or DEFAULT_MODEL_NAME]


def run_server(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> None:
    """Load the model in the engine-core process, then serve until a signal."""
    names = served_model_names_from(args)
    stat_logger = PrometheusStatLogger(names[0])
    engine = AsyncLLM.from_engine_args(stat_loggers=[stat_logger], **engine_kwargs)
    try:
        app = build_app(engine, names, api_key=args.api_key, stat_logger=stat_logger)
        config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level,
            # A backstop only: the engine ends in-flight streams at the grace period.
            timeout_graceful_shutdown=args.shutdown_grace_period + 5,
            timeout_keep_alive=5,
        )
        server = GracefulServer(config, engine, args.shutdown_grace_period)
        logger.info("serving %s on http://%s:%d", names, args.host, args.port)
        asyncio.run(server.serve())
    finally:
        engine.shutdown()
    if server.engine_error is not None:
        logger.error("exiting with status %d: %s", EXIT_ENGINE_DEAD, server.engine_error)
        raise SystemExit(EXIT_ENGINE_DEAD)
