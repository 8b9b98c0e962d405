"""The server's data-parallel surface: `POST /scale` (admin, behind the API
key), each replica's state for `/health`, and per-replica gauges on
`/metrics`, read from the routing client when scraped."""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel

from raylm.entrypoints.openai.serving_common import error_response

logger = logging.getLogger(__name__)


class ScaleRequest(BaseModel):
    data_parallel_size: int


def replica_states(engine: Any) -> list[dict] | None:
    """Each replica's node, load and state; None without data parallelism."""
    states = getattr(engine.engine_core, "replica_states", None)
    return states() if states is not None else None


class ReplicaCollector:
    """Prometheus collector: one gauge per replica and quantity, at scrape time."""

    _GAUGES = (
        ("num_running", "raylm:dp_replica_num_requests_running", "Requests running on the replica"),
        ("num_waiting", "raylm:dp_replica_num_requests_waiting", "Requests waiting on the replica"),
        ("kv_cache_usage", "raylm:dp_replica_kv_cache_usage_perc", "KV cache usage of the replica (0-1)"),
        ("num_routed", "raylm:dp_replica_requests_routed", "Requests the router sent to the replica"),
    )

    def __init__(self, engine: Any, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        states = [s for s in (replica_states(self.engine) or []) if s.get("state") != "starting"]
        for key, name, doc in self._GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model_name", "replica", "state"])
            for state in states:
                family.add_metric([self.model_name, str(state["replica"]), state["state"]], float(state[key]))
            yield family


def install_data_parallel_routes(app: FastAPI, engine: Any, api_key: str | None, stat_logger=None,
                                 model_name: str = "") -> None:
    if stat_logger is not None and replica_states(engine) is not None:
        stat_logger.registry.register(ReplicaCollector(engine, model_name))

    @app.post("/scale")
    async def scale(body: ScaleRequest, request: Request) -> JSONResponse:
        """Change the number of replicas; answers once new ones serve (removed
        ones drain in the background). 400 if the engine has no replicas."""
        if api_key:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {api_key}".encode()):
                return error_response("missing or invalid API key (Authorization: Bearer ...)", 401)
        try:
            await engine.scale(body.data_parallel_size)
        except ValueError as e:
            return error_response(str(e), 400, "data_parallel_size")
        except RuntimeError as e:  # could not be placed: nothing changed
            return error_response(f"could not scale: {e}", 409)
        return JSONResponse({"data_parallel_size": body.data_parallel_size, "replicas": replica_states(engine)})
