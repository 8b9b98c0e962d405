"""The server's data-parallel surface: `POST /scale` and
`POST /replicas/{i}/restart` (admin, behind the API key), each replica's
state for `/health`, and per-replica gauges on `/metrics`, read from the
routing client when scraped.

Without an API key the admin routes answer anyone who can reach the server,
which is safe only when that is this machine: a server bound to a loopback
address (127.0.0.0/8, ::1, localhost) serves them without a key; one bound
to any other address (0.0.0.0 included) refuses them with a 403 that says to
set an API key (--api-key, RAYLM_API_KEY).

`/scale` is bounded and serialized: at most MAX_DATA_PARALLEL_SIZE replicas
(and, on a Ray cluster, no more than it has CPUs: a replica needs one at
least), past that a 400; one scale at a time, so that two calls racing cannot
both plan the same scale-up and start twice the replicas asked for."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel

from raylm.config import MAX_DATA_PARALLEL_SIZE
from raylm.engine.routing import ROUTING_REASONS
from raylm.entrypoints.openai.serving_common import error_response

logger = logging.getLogger(__name__)


def is_loopback_host(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only.
    A name other than localhost may resolve anywhere: not loopback."""
    if host.strip().lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


class ScaleRequest(BaseModel):
    data_parallel_size: int


def replica_states(engine: Any) -> list[dict] | None:
    """Each replica's node, load and state; None without data parallelism."""
    return engine.replica_states()


class ReplicaCollector:
    """Prometheus collector: one gauge per replica and quantity, at scrape time."""

    _GAUGES = (
        ("num_running", "raylm:dp_replica_num_requests_running", "Requests running on the replica"),
        ("num_waiting", "raylm:dp_replica_num_requests_waiting", "Requests waiting on the replica"),
        ("kv_cache_usage", "raylm:dp_replica_kv_cache_usage_perc", "KV cache usage of the replica (0-1)"),
        ("num_routed", "raylm:dp_replica_requests_routed", "Requests the router sent to the replica"),
        (
            "pd_handoffs_queued",
            "raylm:dp_replica_pd_handoffs_queued",
            "P/D: finished prefills on the (prefill) replica waiting for decode room (--pd-handoff-queue); a full "
            "queue takes the replica out of admission",
        ),
        (
            "prefix_cache_hit_rate",
            "raylm:dp_replica_prefix_cache_hit_rate",
            "Prompt tokens found cached (or in the tier of evicted blocks) over those looked up, on the replica "
            "since its core started (0-1)",
        ),
    )

    def __init__(self, engine: Any, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        states = [s for s in (replica_states(self.engine) or []) if s.get("state") != "starting"]
        for key, name, doc in self._GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model_name", "replica", "state"])
            for state in states:
                family.add_metric([self.model_name, str(state["replica"]), state["state"]], float(state.get(key, 0)))
            yield family
        decisions = getattr(self.engine, "routing_decisions", lambda: None)()
        if decisions is not None:
            family = CounterMetricFamily(
                "raylm:routing_decisions",
                "New requests routed, by reason: pinned (data_parallel_rank), prefix (to a replica holding some "
                "of the prompt's prefix), load (by load alone), queued (no replica serving)",
                labels=["model_name", "reason"],
            )
            for reason in ROUTING_REASONS:
                family.add_metric([self.model_name, reason], float(decisions.get(reason, 0)))
            yield family
        # A label of its own rather than one more on the gauges above (their
        # series stay what dashboards know): 1 per replica, labelled with its role.
        roles = GaugeMetricFamily(
            "raylm:dp_replica_role",
            "Each replica's P/D role (prefill, decode, or both without --prefill-replicas), as a label; always 1",
            labels=["model_name", "replica", "role"],
        )
        for state in states:
            roles.add_metric([self.model_name, str(state["replica"]), state.get("role", "both")], 1.0)
        yield roles


def _cluster_cpus() -> int | None:
    """The Ray cluster's CPUs, or None when this process is not on one."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return int(ray.cluster_resources().get("CPU", 0)) or None


async def max_data_parallel_size() -> tuple[int, str]:
    """The largest size /scale accepts, and why (for the 400)."""
    cpus = await asyncio.get_running_loop().run_in_executor(None, _cluster_cpus)
    if cpus is not None and cpus < MAX_DATA_PARALLEL_SIZE:
        return cpus, f"the Ray cluster has {cpus} CPUs and a replica needs one at least"
    return MAX_DATA_PARALLEL_SIZE, "raylm's limit (MAX_DATA_PARALLEL_SIZE)"


def install_data_parallel_routes(
    app: FastAPI, engine: Any, api_key: str | None, stat_logger=None, model_name: str = "", host: str | None = None
) -> None:
    """`host`: the address the server is bound to; without an API key, the
    admin routes answer only on a loopback one (None: not bound by raylm
    serve, e.g. an app driven in-process; taken as loopback)."""
    if stat_logger is not None and replica_states(engine) is not None:
        stat_logger.registry.register(ReplicaCollector(engine, model_name))

    scaling = asyncio.Lock()
    open_to_others = not api_key and host is not None and not is_loopback_host(host)
    if open_to_others:
        logger.warning(
            "no API key on a server bound to %s: POST /scale and /replicas/{i}/restart are refused "
            "(set --api-key or RAYLM_API_KEY to use them)",
            host,
        )

    def refused(request: Request) -> JSONResponse | None:
        if api_key:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {api_key}".encode()):
                return error_response("missing or invalid API key (Authorization: Bearer ...)", 401)
        elif open_to_others:
            # Anyone on the network could change the replica count or restart
            # replicas; without a key there is no telling who asks.
            return error_response(
                f"{request.url.path} needs an API key on a server bound to a non-loopback address ({host}): "
                "start it with --api-key KEY (or RAYLM_API_KEY) and send 'Authorization: Bearer KEY', "
                "or bind it to 127.0.0.1",
                403,
                error_type="permission_error",
            )
        return None

    @app.post("/replicas/{index}/restart")
    async def restart_replica(index: int, request: Request) -> JSONResponse:
        """Restart one replica without losing a request (its requests migrate
        to the others); answers once it serves again. 400 if it does not
        serve or no other replica could take its requests. Admin: needs the
        API key; without one, answers only on a loopback bind (403 otherwise)."""
        if (denied := refused(request)) is not None:
            return denied
        try:
            async with scaling:
                await engine.restart_replica(index)
        except ValueError as e:
            return error_response(str(e), 400, "index")
        except RuntimeError as e:
            return error_response(f"could not restart replica {index}: {e}", 409)
        return JSONResponse({"restarted": index, "replicas": replica_states(engine)})

    @app.post("/scale")
    async def scale(body: ScaleRequest, request: Request) -> JSONResponse:
        """Change the number of replicas; answers once new ones serve (removed
        ones migrate their requests away and leave in the background). 400 if
        the engine has no replicas or the size is past the bound; a call
        waits for the one before it. Admin: needs the API key; without one,
        answers only on a loopback bind (403 otherwise)."""
        if (denied := refused(request)) is not None:
            return denied
        limit, why = await max_data_parallel_size()
        if body.data_parallel_size > limit:
            return error_response(
                f"data_parallel_size: at most {limit} ({why}), got {body.data_parallel_size}", 400, "data_parallel_size"
            )
        try:
            async with scaling:
                await engine.scale(body.data_parallel_size)
        except ValueError as e:
            return error_response(str(e), 400, "data_parallel_size")
        except RuntimeError as e:  # could not be placed, or a new replica not ready in time: nothing changed
            return error_response(f"could not scale: {e}", 409)
        return JSONResponse({"data_parallel_size": body.data_parallel_size, "replicas": replica_states(engine)})
