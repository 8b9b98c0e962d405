"""The operator's guide against the code (docs/operations.md, docs/grafana,
docs/kuberay): the Grafana dashboard queries only metrics raylm exports, with
labels they carry; the guide names every metric; the Serve config's
application resolves and its builder accepts its arguments; the RayService
embeds that same config. In-process, no Ray started, a few seconds."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
import yaml

DOCS = Path(__file__).resolve().parents[2] / "docs"
DASHBOARD = DOCS / "grafana" / "raylm-dashboard.json"
OPERATIONS = DOCS / "operations.md"
SERVE_CONFIG = DOCS / "kuberay" / "serve_config.yaml"
RAYSERVICE = DOCS / "kuberay" / "rayservice.yaml"

# The names a family of each type is exposed under (prometheus_client: a
# counter's name gets _total, a histogram's its series).
_SERIES_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gauge": ("",),
}
# Labels Prometheus adds to every series it scrapes, and a histogram bucket's bound.
_SCRAPE_LABELS = {"instance", "job"}
_BUCKET_LABEL = "le"
# raylm's metric namespaces (vLLM's names, raylm's own).
_METRIC_NAME = re.compile(r"(?<![\w:])(?:vllm|raylm):[A-Za-z0-9_:]+")
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^()]*)\)")


class _DataParallelEngine:
    """What the server's per-replica collector reads from a data-parallel
    engine: one replica in each state it exports."""

    def replica_states(self) -> list[dict]:
        return [
            {
                "replica": i,
                "state": state,
                "node_ip": "10.0.0.1",
                "in_flight": 1,
                "num_running": 1,
                "num_waiting": 0,
                "kv_cache_usage": 0.5,
                "num_routed": 3,
                "prefix_cache_hit_rate": 0.25,
            }
            for i, state in enumerate(("serving", "draining", "restarting"))
        ]

    def routing_decisions(self) -> dict[str, int]:
        return {"prefix": 2, "load": 1}


def _exported() -> dict[str, tuple[str, set[str]]]:
    """Family name -> (type, label names) of every metric a `raylm serve`
    /metrics serves: the stat logger's registry as run_server builds it, with
    the per-replica collector that install_data_parallel_routes registers
    for a data-parallel engine."""
    from fastapi import FastAPI

    from raylm.engine.protocol import SchedulerStats
    from raylm.entrypoints.openai.data_parallel_routes import install_data_parallel_routes
    from raylm.entrypoints.openai.metrics import PrometheusStatLogger

    stat_logger = PrometheusStatLogger("m")
    install_data_parallel_routes(FastAPI(), _DataParallelEngine(), None, stat_logger, "m")
    # The label sets these counters make only when first used.
    stat_logger.record_finished("stop", 1.0, 3, 2, 0.5, 0.6)
    stat_logger.record_autoscale("up", "test")
    stat_logger.max_loras = 2  # --enable-lora: vllm:lora_requests_info is reported
    stat_logger.record_scheduler_stats(SchedulerStats(lora_running=["a"], lora_waiting=["b"]))
    families = {}
    for family in stat_logger.registry.collect():
        labels = {label for sample in family.samples for label in sample.labels}
        families[family.name] = (family.type, labels)
    assert len(families) > 20, sorted(families)
    return families


@pytest.fixture(scope="module")
def exported() -> dict[str, tuple[str, set[str]]]:
    return _exported()


def _series(exported) -> dict[str, str]:
    """Every name a scrape shows -> its family."""
    return {name + suffix: name for name, (kind, _) in exported.items() for suffix in _SERIES_SUFFIXES[kind]}


def _queries(node) -> list[str]:
    """Every PromQL string of the dashboard: panel targets and template variables."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                found.append(value)
            elif key == "query" and isinstance(value, str) and "(" in value:
                found.append(value)
            else:
                found.extend(_queries(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(_queries(item))
    return found


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_dashboard_queries_only_metrics_raylm_exports(exported, dashboard):
    series = _series(exported)
    queries = _queries(dashboard)
    assert len(queries) > 30
    unknown = {}
    for query in queries:
        names = _METRIC_NAME.findall(query)
        assert names, f"a query names no raylm metric: {query}"
        for name in names:
            if name not in series:
                unknown.setdefault(name, query)
    assert not unknown, f"the dashboard queries metrics raylm does not export (exported: {sorted(series)}): {unknown}"


def test_the_dashboard_filters_and_groups_by_labels_the_metrics_carry(exported, dashboard):
    series = _series(exported)
    for query in _queries(dashboard):
        # (A name raylm does not export is the test above's to report.)
        families = {series[name] for name in _METRIC_NAME.findall(query) if name in series}
        carried = set().union(*(exported[f][1] for f in families)) | _SCRAPE_LABELS | {_BUCKET_LABEL}
        used = {label for group in _MATCHERS.findall(query) for label in _MATCHER_LABEL.findall(group)}
        used |= {label.strip() for group in _GROUPING.findall(query) for label in group.split(",") if label.strip()}
        assert used <= carried, f"labels {sorted(used - carried)} are on none of {sorted(families)}: {query}"


def test_the_dashboard_shows_every_metric(exported, dashboard):
    series = _series(exported)
    shown = {series[name] for query in _queries(dashboard) for name in _METRIC_NAME.findall(query) if name in series}
    assert not set(exported) - shown, f"not on the dashboard: {sorted(set(exported) - shown)}"


def test_the_dashboard_panels_are_grafana_panels(dashboard):
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "model_name", "instance"} <= variables


def test_the_guide_names_every_metric_as_scraped(exported):
    """docs/operations.md lists each metric under the name a scrape shows."""
    text = OPERATIONS.read_text()
    missing = []
    for name, (kind, _) in exported.items():
        shown = name + "_total" if kind == "counter" else name
        if not re.search(rf"(?<![\w:]){re.escape(shown)}(?![\w:])", text):
            missing.append(shown)
    assert not missing, f"docs/operations.md does not name: {missing}"


# ---- Ray Serve / KubeRay --------------------------------------------------------------


def _builder(import_path: str):
    module, _, attr = import_path.partition(":")
    assert attr, f"import_path {import_path!r} is not module:attribute"
    return getattr(importlib.import_module(module), attr)


def test_the_serve_config_builds_its_application_without_ray():
    import ray
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(SERVE_CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(config)
    assert schema.applications, "no application"
    was_up = ray.is_initialized()
    for application in config["applications"]:
        assert application["import_path"] == "raylm.ray_serve:app"
        built = _builder(application["import_path"])(dict(application.get("args") or {}))
        assert isinstance(built, serve.Application)
    assert ray.is_initialized() == was_up, "building the application started Ray"


def test_the_serve_config_arguments_are_raylm_serve_settings():
    """Each argument is a `raylm serve` setting (as the builder parses it)
    or a Serve deployment option, never a setting Serve's proxy owns."""
    from raylm.ray_serve import DEPLOYMENT_OPTIONS, plan_replica, settings_from_strings, split_settings

    for application in yaml.safe_load(SERVE_CONFIG.read_text())["applications"]:
        args = application["args"]
        settings, deployment = settings_from_strings(dict(args))
        assert set(settings) | set(deployment) == {key.replace("-", "_") for key in args}
        assert set(deployment) <= set(DEPLOYMENT_OPTIONS)
        engine, options = plan_replica(split_settings(settings)[0])
        # A replica with Ray ranks reserves one bundle for itself and one per rank.
        world = engine["tensor_parallel_size"] * engine["pipeline_parallel_size"] * engine["context_parallel_size"]
        if engine["distributed_executor_backend"] == "ray":
            assert len(options["placement_group_bundles"]) == world + 1


def test_the_rayservice_embeds_the_serve_config():
    from raylm.entrypoints.openai.cli_args import API_KEY_ENV_VARS
    from raylm.ray_serve import check_serve_ray_version

    service = yaml.safe_load(RAYSERVICE.read_text())
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    spec = service["spec"]
    assert yaml.safe_load(spec["serveConfigV2"]) == yaml.safe_load(SERVE_CONFIG.read_text())
    cluster = spec["rayClusterConfig"]
    check_serve_ray_version(cluster["rayVersion"])
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    containers = [c for group in groups for c in group["template"]["spec"]["containers"]]
    assert len({c["image"] for c in containers}) == 1, "head and workers run different images"
    for container in containers:
        env = {e["name"] for e in container.get("env", [])}
        assert env & set(API_KEY_ENV_VARS), f"{container['name']}: no API key variable raylm reads"
        assert "/dev/shm" in {m["mountPath"] for m in container.get("volumeMounts", [])}, container["name"]
