"""raylm as a Ray Serve application: each Serve replica is one raylm engine
(AsyncLLM) behind the same OpenAI routes as `raylm serve`, on Serve's HTTP proxy.

    from ray import serve
    from raylm.ray_serve import build_openai_app

    serve.run(build_openai_app({"model": "Qwen/Qwen3-0.6B", "tensor_parallel_size": 2},
                               deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}))

or from the command line, with `raylm serve`'s flags as key=value:

    serve run raylm.ray_serve:app model=Qwen/Qwen3-0.6B tensor_parallel_size=2

What Serve does and raylm does not: replicas are started, health-checked
(`check_health` asks the engine core for a sign of life), autoscaled and
restarted by Serve; a client that goes away makes Serve cancel its request,
which aborts it in the engine. A replica's tensor/pipeline-parallel ranks are
Ray actors in the replica's own placement group: Serve reserves it
(`placement_group_bundles`, one bundle for the replica and one per rank) and
raylm's Ray executor places its ranks on those bundles instead of making a
group of its own. A replica that dies takes its in-flight requests with it
(Serve restarts it); `raylm serve -dp N` instead keeps them and moves them to
another replica (docs/parallel.md, "Which to choose").
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from typing import Any

from ray import serve

from raylm.config.engine_args import EngineArgs
from raylm.entrypoints.openai.cli_args import add_serve_subcommand, resolve_api_key

# `raylm serve` flags that Serve's HTTP proxy owns (its address, TLS, its
# logs, how long a stopping replica may drain), with what to use instead.
_PROXY_SETTINGS = {
    "host": 'serve.start(http_options={"host": ...})',
    "port": 'serve.start(http_options={"port": ...})',
    "ssl_keyfile": "TLS in front of Serve's proxy",
    "ssl_certfile": "TLS in front of Serve's proxy",
    "uvicorn_log_level": "Serve's logging_config",
    "shutdown_grace_period": 'deployment_config={"graceful_shutdown_timeout_s": ...}',
}
# Deployment options that `serve run raylm.ray_serve:app` takes beside the
# engine's flags (values in JSON where they are not plain numbers).
DEPLOYMENT_OPTIONS = (
    "num_replicas",
    "autoscaling_config",
    "max_ongoing_requests",
    "max_queued_requests",
    "health_check_period_s",
    "health_check_timeout_s",
    "graceful_shutdown_timeout_s",
    "graceful_shutdown_wait_loop_s",
    "ray_actor_options",
    "name",
)
# Requests Serve lets into one replica at once. An engine batches many (and
# raylm's admission control answers 429 past its own queue); Serve's default
# (5) would serialise an LLM's requests behind each other.
DEFAULT_MAX_ONGOING_REQUESTS = 256
DEFAULT_DEPLOYMENT_NAME = "raylm"
DEFAULT_PD_DEPLOYMENT_NAME = "raylm-pd"
# The oldest Ray whose Serve runs raylm's replicas as tested (README,
# "Supported versions"; raylm's Ray floor is the same). On 2.40 a TP=2
# replica's rank actors were never scheduled on the bundles Serve reserved.
MIN_SERVE_RAY_VERSION = (2, 58)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


# ---- settings ----------------------------------------------------------------------


def _serve_parser() -> argparse.ArgumentParser:
    """`raylm serve`'s own parser: its flags, their types and defaults."""
    commands = argparse.ArgumentParser(prog="raylm").add_subparsers()
    parser = add_serve_subcommand(commands)

    def refuse(message: str):
        raise ValueError(f"raylm.ray_serve:app arguments: {message}")

    parser.error = refuse  # a ValueError that says why, not a SystemExit
    return parser


def _server_defaults() -> dict[str, Any]:
    """`raylm serve`'s server settings (not EngineArgs, not the proxy's) at their defaults."""
    engine_fields = {f.name for f in fields(EngineArgs)}
    namespace = vars(_serve_parser().parse_args([]))
    return {
        k: v
        for k, v in namespace.items()
        if k not in engine_fields and k not in _PROXY_SETTINGS and k not in ("handler", "model_tag")
    }


def split_settings(settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(EngineArgs keyword arguments, server settings) from one dict of
    `raylm serve` settings by their Python names; ValueError naming a key that
    is neither, or that Serve's proxy owns."""
    engine_fields = {f.name for f in fields(EngineArgs)}
    server = _server_defaults()
    engine: dict[str, Any] = {}
    for key, value in settings.items():
        if key in _PROXY_SETTINGS:
            raise ValueError(f"{key}: under Ray Serve the HTTP proxy owns this; use {_PROXY_SETTINGS[key]}")
        if key in engine_fields:
            engine[key] = value
        elif key in server:
            server[key] = value
        else:
            raise ValueError(
                f"{key}: not a setting of raylm's engine or server (see `raylm serve --help`, with - written _)"
            )
    if isinstance(server["served_model_name"], str):
        server["served_model_name"] = [server["served_model_name"]]
    server["lora_modules"] = _lora_modules(server["lora_modules"])
    if server["lora_modules"] and not engine.get("enable_lora"):
        raise ValueError("lora_modules: needs enable_lora")
    _check_server_settings(server)
    return EngineArgs(**engine).to_kwargs(), server


def _lora_modules(value: Any) -> list | None:
    """lora_modules as `raylm serve --lora-modules` reads them: each a
    "name=path" string, vLLM's JSON object (or a dict of it), or one parsed."""
    from raylm.entrypoints.openai.serving_lora import LoRAModule, parse_lora_module

    if value is None:
        return None
    if isinstance(value, (str, dict, LoRAModule)):
        value = [value]
    modules = []
    for item in value:
        if isinstance(item, dict):
            item = json.dumps(item)
        try:
            modules.append(item if isinstance(item, LoRAModule) else parse_lora_module(str(item)))
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"lora_modules: {e}") from None
    return modules


def _check_server_settings(server: dict[str, Any]) -> None:
    """ValueError naming a server setting that `raylm serve`'s parser would
    refuse, here at the application's build rather than in every replica."""
    from raylm.entrypoints.openai.reasoning_parsers import reasoning_parser_names
    from raylm.entrypoints.openai.structured_outputs import StructuredOutputDefaults

    if server["allow_runtime_lora_updating"]:
        # Serve sends a load to one replica: the others would not serve the name.
        raise ValueError(
            "allow_runtime_lora_updating: not under Ray Serve (a load would reach one replica); "
            "name the adapters with lora_modules"
        )
    if server["max_served_loras"] < 1 or len(server["lora_modules"] or ()) > server["max_served_loras"]:
        raise ValueError("max_served_loras: at least 1, and at least as many as lora_modules")
    parser = server["reasoning_parser"]
    if parser is not None and parser not in reasoning_parser_names():
        raise ValueError(f"reasoning_parser: one of {reasoning_parser_names()}, got {parser!r}")
    StructuredOutputDefaults.from_json(server["structured_outputs_config"])


def settings_from_strings(args: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine/server settings, deployment options) from `serve run`'s
    key=value arguments, each parsed as `raylm serve` parses its flag."""
    parser = _serve_parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    argv: list[str] = []
    deployment: dict[str, Any] = {}
    for key, text in args.items():
        name = key.replace("-", "_")
        if name in DEPLOYMENT_OPTIONS:
            deployment[name] = _json_or_text(text)
            continue
        if name in _PROXY_SETTINGS:
            raise ValueError(f"{key}: under Ray Serve the HTTP proxy owns this; use {_PROXY_SETTINGS[name]}")
        action = actions.get(name)
        if action is None:
            raise ValueError(
                f"{key}: not a flag of `raylm serve` (with - written _) nor a deployment option "
                f"({', '.join(DEPLOYMENT_OPTIONS)})"
            )
        argv += _as_flag(action, key, str(text))
    namespace = parser.parse_args(argv)
    given = {a.dest for a in actions.values() if a.dest in {k.replace("-", "_") for k in args}}
    settings = {k: v for k, v in vars(namespace).items() if k in given}
    return settings, deployment


def _as_flag(action: argparse.Action, key: str, text: str) -> list[str]:
    """The command-line words that set `action` to `text`."""
    flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
    if action.nargs == 0:  # store_true, or --x/--no-x
        word = text.strip().lower()
        if word not in _TRUE | _FALSE:
            raise ValueError(f"{key}: expected true or false, got {text!r}")
        if word in _TRUE:
            return [next(s for s in action.option_strings if s.startswith("--") and not s.startswith("--no-"))]
        negative = [s for s in action.option_strings if s.startswith("--no-")]
        return negative[:1]
    if action.nargs in ("+", "*"):
        return [flag, *[part.strip() for part in text.split(",") if part.strip()]]
    return [flag, text]


def _json_or_text(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _device(engine: dict[str, Any]) -> str:
    """Where the replicas' models run: as set, else CUDA when the Ray cluster
    (or, before Ray is up, this machine) has GPUs. Decided once, here, so that
    what Serve reserves and what each replica's engine asks for agree."""
    if engine.get("device"):
        return engine["device"]
    import ray

    if ray.is_initialized():
        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _refuse_data_parallelism(engine: dict[str, Any]) -> None:
    """ValueError for the settings that would run a data-parallel engine
    inside each Serve replica: its own replicas and router, and with
    `autoscale` its own autoscaler, under Serve's (two autoscalers, neither
    seeing the other's replicas). Serve's replicas are the data parallelism."""
    if (engine.get("data_parallel_size") or 1) != 1:
        raise ValueError(
            "data_parallel_size: under Ray Serve, scale with replicas (num_replicas or "
            "autoscaling_config) instead; each replica is one engine"
        )
    if engine.get("autoscale"):
        raise ValueError(
            "autoscale: under Ray Serve, Serve scales the replicas: use the deployment's "
            "autoscaling_config (min_replicas, max_replicas, target_ongoing_requests) instead; "
            "each replica is one engine"
        )


def plan_replica(engine: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the engine settings a replica runs with, the deployment options that
    reserve its resources). With more than one rank the ranks are Ray actors
    (distributed_executor_backend "ray") on bundles 1..N of the replica's
    placement group; bundle 0 holds the replica itself (and its engine loop)."""
    from raylm.executor.ray_placement import engine_actor_bundles

    engine = dict(engine)
    _refuse_data_parallelism(engine)
    world = (
        (engine.get("tensor_parallel_size") or 1)
        * (engine.get("pipeline_parallel_size") or 1)
        * (engine.get("context_parallel_size") or 1)
    )
    backend = engine.get("distributed_executor_backend") or ("ray" if world > 1 else None)
    if backend not in (None, "uni", "mp", "ray"):
        raise ValueError(f"distributed_executor_backend: one of uni, mp, ray under Ray Serve, got {backend!r}")
    engine["distributed_executor_backend"] = backend
    engine["device"] = _device(engine)
    ray_ranks = backend == "ray"
    if ray_ranks and engine["device"] == "cpu":
        # Each rank's bundle is sized from num_threads: the executor must ask for exactly that.
        engine["num_threads"] = engine.get("num_threads") or 1
    bundles, replica_cpus, _ = engine_actor_bundles(world, engine["device"], engine.get("num_threads"), ray_ranks)
    options: dict[str, Any] = {"max_ongoing_requests": DEFAULT_MAX_ONGOING_REQUESTS}
    if ray_ranks:
        options["ray_actor_options"] = {"num_cpus": replica_cpus}
        options["placement_group_bundles"] = bundles
        options["placement_group_strategy"] = engine.get("ray_placement_strategy") or "PACK"
    else:
        options["ray_actor_options"] = {"num_cpus": bundles[0].get("CPU", 1.0), "num_gpus": bundles[0].get("GPU", 0)}
    return engine, options


# ---- the deployment ---------------------------------------------------------------

# The raylm app of the replica in this process (a Serve replica is an actor, a
# process of its own): set once its engine is up.
_replica_app = None


def _serve_replica_app(app) -> None:
    global _replica_app
    _replica_app = app


class ReplicaIngress:
    """The ASGI app Serve runs in each replica: every HTTP request goes, as it
    came, to the replica's raylm app (the routes of `raylm serve`, built once
    the engine exists). A plain ASGI callable, not a FastAPI app: Serve
    pickles what it is given, and FastAPI apps do not pickle the same way in
    every Ray and FastAPI version."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":  # nothing to start or stop: the replica's constructor did
            while True:
                message = await receive()
                kind = message["type"].rpartition(".")[2]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if _replica_app is None:
            raise RuntimeError("no raylm engine in this process yet")
        await _replica_app(scope, receive, send)


def engine_config_in_replica(engine_kwargs: dict[str, Any]):
    """The replica's EngineConfig: with Ray ranks, they go on bundles 1..N of
    the placement group Serve made for this replica, in the cluster this
    replica runs in (the engine core, a process of its own, joins it)."""
    import ray
    from ray.util.placement_group import get_current_placement_group

    from raylm.config.engine_args import create_engine_config

    kwargs = dict(engine_kwargs)
    ray_ranks = kwargs.get("distributed_executor_backend") == "ray"
    group = get_current_placement_group() if ray_ranks else None
    if ray_ranks:
        if group is None:
            raise RuntimeError(
                "a raylm Serve replica with Ray ranks runs in a placement group "
                "(placement_group_bundles); this one has none"
            )
        kwargs["placement_group"] = group
        kwargs["ray_address"] = kwargs.get("ray_address") or ray.get_runtime_context().gcs_address
    kwargs.pop("usage_context", None)
    config = create_engine_config(usage_context="api_server", **kwargs)
    if ray_ranks:
        config.parallel_config.placement_group_bundles = list(range(1, config.parallel_config.world_size + 1))
    return config


# The address a replica's app is built for (build_app's `host`). Serve's
# proxy is what listens, where its http_options say (0.0.0.0 on KubeRay), and
# passes on whoever reaches it: without an API key the admin routes
# (/scale, /replicas/{i}/restart) must be refused as on a server bound to the
# network (data_parallel_routes' loopback rule), never answered as on
# loopback, which a replica built without a host was taken for.
SERVE_PROXY_HOST = "0.0.0.0"


def build_replica_app(engine, names: list[str], server: dict[str, Any], stat_logger=None, tool_config=None):
    """The OpenAI app of `raylm serve` (api_server.build_app) around a
    replica's engine, with the server settings `server`, as reachable from
    the network (SERVE_PROXY_HOST)."""
    from raylm.entrypoints.openai.api_server import CorsSettings, build_app, served_adapters_from
    from raylm.entrypoints.openai.limits import ServerLimits
    from raylm.entrypoints.openai.structured_outputs import StructuredOutputDefaults

    return build_app(
        engine,
        names,
        api_key=resolve_api_key(server["api_key"]),
        stat_logger=stat_logger,
        limits=ServerLimits(
            max_waiting_requests=server["max_waiting_requests"], max_request_body_bytes=server["max_request_body_bytes"]
        ),
        cors=CorsSettings(
            server["allowed_origins"], server["allowed_methods"], server["allowed_headers"], server["allow_credentials"]
        ),
        tool_config=tool_config,
        trust_request_chat_template=server["trust_request_chat_template"],
        # Every server setting `raylm serve` passes (they were accepted here
        # and ignored: a replica served without its reasoning parser).
        structured_outputs_defaults=StructuredOutputDefaults.from_json(server["structured_outputs_config"]),
        reasoning_parser=server["reasoning_parser"],
        host=SERVE_PROXY_HOST,
        # --lora-modules, checked in each replica as at `raylm serve`'s start.
        adapters=served_adapters_from(argparse.Namespace(**server), engine, names, stat_logger),
    )


class ReplicaEngine:
    """What one Serve replica runs: a raylm engine and the OpenAI app of
    `raylm serve` around it (the same routes, built by build_replica_app)."""

    def __init__(self, engine_kwargs: dict[str, Any], server: dict[str, Any]):
        from raylm.engine.async_llm import AsyncLLM
        from raylm.entrypoints.openai.api_server import DEFAULT_MODEL_NAME
        from raylm.entrypoints.openai.metrics import PrometheusStatLogger
        from raylm.entrypoints.openai.serving_tools import ToolCallConfig

        config = engine_config_in_replica(engine_kwargs)
        names = list(server["served_model_name"] or [engine_kwargs.get("model") or DEFAULT_MODEL_NAME])
        tool_config = ToolCallConfig.from_args(argparse.Namespace(**server))
        stat_logger = PrometheusStatLogger(names[0])
        self.engine = AsyncLLM(config, stat_loggers=[stat_logger])
        try:
            self.app = build_replica_app(self.engine, names, server, stat_logger, tool_config)
        except BaseException:
            self.engine.shutdown()
            raise


# Serve pickles this class by value (its decorator replaces the module's
# name for it), with the module globals its methods name as they are now: it
# names only what is defined above.
@serve.ingress(ReplicaIngress())
class RaylmServer:
    """One Serve replica: Serve's view of a ReplicaEngine."""

    def __init__(self, engine_kwargs: dict[str, Any], server: dict[str, Any]):
        self.replica = ReplicaEngine(engine_kwargs, server)
        _serve_replica_app(self.replica.app)

    async def check_health(self) -> None:
        """Serve's health check: the engine core answers a ping (or recovers
        within its limit); raising makes Serve replace this replica."""
        await self.replica.engine.check_health()

    def num_unfinished_requests(self) -> int:
        """Requests this replica's engine holds now (for tests and operators)."""
        return self.replica.engine.num_unfinished_requests

    def __del__(self) -> None:
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.engine.shutdown()


def check_serve_ray_version(version: str | None = None) -> None:
    """RuntimeError for a Ray older than raylm's Serve support."""
    import ray

    version = version or ray.__version__
    if tuple(int(p) for p in version.split(".")[:2]) < MIN_SERVE_RAY_VERSION:
        raise RuntimeError(
            f"raylm.ray_serve needs Ray >= {'.'.join(map(str, MIN_SERVE_RAY_VERSION))} "
            f"(this is {version}): pip install 'raylm[serve]'"
        )


def build_openai_app(engine_args: dict[str, Any] | None = None, deployment_config: dict[str, Any] | None = None):
    """A Serve application of raylm replicas. `engine_args`: `raylm serve`'s
    settings by their Python names (EngineArgs fields, and served_model_name,
    api_key, tool_call_parser, ...); `deployment_config`: Serve deployment
    options (num_replicas, autoscaling_config, max_ongoing_requests,
    health_check_period_s, ...), over raylm's (the resources a replica needs)."""
    check_serve_ray_version()
    engine, server = split_settings(dict(engine_args or {}))
    engine, options = plan_replica(engine)
    options.update(deployment_config or {})
    options.setdefault("name", DEFAULT_DEPLOYMENT_NAME)
    return serve.deployment(RaylmServer).options(**options).bind(engine, server)


def build_pd_openai_app(pd_serving_args: dict[str, Any]):
    """Ray Serve LLM's P/D application shape: `prefill_config` and
    `decode_config` (each an LLM config: model_loading_config, engine_kwargs
    of `raylm serve`'s settings, deployment_config with num_replicas or
    autoscaling_config) and `ingress_deployment_config`. One Serve replica
    runs one raylm engine whose prefill and decode roles are the two
    configs' replicas, on Ray actors of their own (raylm/ray_serve_pd.py
    says why one deployment, and what is refused)."""
    from raylm.ray_serve_pd import pd_settings

    check_serve_ray_version()
    settings, ingress = pd_settings(pd_serving_args)
    engine, server = split_settings(settings)
    engine["device"] = _device(engine)
    # The replica runs the supervisor (the ledger, HTTP, detokenizing); each
    # role's replicas reserve their own CPUs (or GPUs) in groups of their own.
    options: dict[str, Any] = {
        "max_ongoing_requests": DEFAULT_MAX_ONGOING_REQUESTS,
        "ray_actor_options": {"num_cpus": 1},
    }
    options.update(ingress)
    options.setdefault("name", DEFAULT_PD_DEPLOYMENT_NAME)
    return serve.deployment(RaylmServer).options(**options).bind(engine, server)


def app(args: dict[str, str]):
    """`serve run raylm.ray_serve:app model=... tensor_parallel_size=2`: the
    engine and server settings are `raylm serve`'s flags (key=value, - or _),
    beside Serve's deployment options (num_replicas=2,
    autoscaling_config='{"min_replicas": 1, "max_replicas": 4}')."""
    settings, deployment = settings_from_strings(dict(args))
    return build_openai_app(settings, deployment)
