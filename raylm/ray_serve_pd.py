"""Ray Serve LLM's prefill/decode application, `build_pd_openai_app`, in its
argument shape, mapped onto raylm (issue 50; `raylm.ray_serve.build_pd_openai_app`
binds what `pd_settings` decides here).

    build_pd_openai_app({
        "prefill_config": {"model_loading_config": {"model_id": "qwen", "model_source": "Qwen/Qwen3-0.6B"},
                           "engine_kwargs": {"num_threads": 4},
                           "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}},
        "decode_config": {...the same model and engine_kwargs, its own num_threads and replicas...},
        "ingress_deployment_config": {"max_ongoing_requests": 512},
    })

Ray Serve LLM makes two deployments (prefill, decode) behind an ingress, and
its KV connector moves each request's K/V between them. raylm keeps every
request in one ledger, held by the supervisor that owns the engine cores
(docs/architecture.md, "Data parallel and the supervisor"): that is what
lets a prefill or decode replica die without costing a request. So the two
configs become the two roles of one raylm engine: one Serve deployment (one
replica: the ingress and the supervisor, with the ledger), whose engine runs
`prefill_config`'s replicas as its prefill role and `decode_config`'s as its
decode role (`--prefill-replicas`), each role with its own threads per
worker, both pools scaled by raylm's per-role autoscaler. Two Serve
deployments would each hold half of a request's life, and the death of
either would lose the requests it held. docs/operations.md, "Prefill/decode
under Ray Serve", says what survives what and how a transfer's key travels.

What cannot map is refused by name (ValueError): keys raylm has no use for,
the two configs naming different models or different engine settings (TP/PP
layouts included: the transport moves K/V between equal layouts only), and
settings the roles' sizes decide.
"""

from __future__ import annotations

from typing import Any

PD_SERVING_ARGS = ("prefill_config", "decode_config", "ingress_deployment_config")
LLM_CONFIG_KEYS = ("model_loading_config", "engine_kwargs", "deployment_config")
MODEL_LOADING_KEYS = ("model_id", "model_source")
# Serve's autoscaling_config keys that raylm's role autoscaler has (in its
# words: --autoscale MIN:MAX and its settings).
AUTOSCALING_KEYS = {
    "min_replicas": None,
    "max_replicas": None,
    "initial_replicas": None,
    "target_ongoing_requests": "autoscale_target_ongoing_requests",
    "upscale_delay_s": "autoscale_upscale_delay",
    "downscale_delay_s": "autoscale_downscale_delay",
}
# Engine settings the app sets from the two configs (the roles' sizes, their
# threads, the model), which engine_kwargs may not set.
SET_BY_THE_APP = (
    "model",
    "data_parallel_size",
    "prefill_replicas",
    "prefill_num_threads",
    "decode_num_threads",
    "data_parallel_backend",
    "autoscale",
    "autoscale_prefill",
    "autoscale_decode",
    *(name for name in AUTOSCALING_KEYS.values() if name),
)
# The one engine setting each role may have its own of: the threads per worker.
PER_ROLE = {"num_threads": ("prefill_num_threads", "decode_num_threads")}


def pd_settings(pd_serving_args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(`raylm serve` settings of the one P/D engine, the Serve deployment's
    options from ingress_deployment_config); ValueError naming what does not map."""
    if not isinstance(pd_serving_args, dict):
        raise ValueError(f"pd_serving_args must be a dict, got {type(pd_serving_args).__name__}")
    _known(pd_serving_args, PD_SERVING_ARGS, "pd_serving_args")
    roles = {}
    for role in ("prefill", "decode"):
        config = pd_serving_args.get(f"{role}_config")
        if not isinstance(config, dict):
            raise ValueError(f"{role}_config: an LLM config (a dict of {', '.join(LLM_CONFIG_KEYS)}) is required")
        _known(config, LLM_CONFIG_KEYS, f"{role}_config")
        roles[role] = config
    settings = _common_engine_settings(roles["prefill"], roles["decode"])
    settings.update(_model(roles["prefill"], roles["decode"]))
    for setting, (prefill_name, decode_name) in PER_ROLE.items():
        for role, name in (("prefill", prefill_name), ("decode", decode_name)):
            value = (roles[role].get("engine_kwargs") or {}).get(setting)
            if value is not None:
                settings[name] = value
    settings.update(_replicas(roles["prefill"], roles["decode"]))
    ingress = dict(pd_serving_args.get("ingress_deployment_config") or {})
    for key in ("num_replicas", "autoscaling_config"):
        if key in ingress:
            raise ValueError(
                f"ingress_deployment_config.{key}: the P/D app is one Serve replica (the supervisor holding "
                "every request's ledger); scale the roles with each config's deployment_config"
            )
    return settings, ingress


def _known(given: dict, allowed: tuple[str, ...], where: str) -> None:
    unknown = [key for key in given if key not in allowed]
    if unknown:
        raise ValueError(
            f"{where}.{unknown[0]}: not something raylm's P/D app maps ({where} takes {', '.join(allowed)})"
        )


def _common_engine_settings(prefill: dict, decode: dict) -> dict[str, Any]:
    """The engine_kwargs both roles share: equal in both, or refused by name."""
    kwargs = {
        role: dict(config.get("engine_kwargs") or {}) for role, config in (("prefill", prefill), ("decode", decode))
    }
    for role, given in kwargs.items():
        for key in given:
            if key in SET_BY_THE_APP:
                raise ValueError(
                    f"{role}_config.engine_kwargs.{key}: set by the P/D app from the two configs "
                    "(model_loading_config, deployment_config, each role's num_threads)"
                )
    shared = {}
    for key in sorted(set(kwargs["prefill"]) | set(kwargs["decode"])):
        if key in PER_ROLE:
            continue
        missing = object()
        p, d = kwargs["prefill"].get(key, missing), kwargs["decode"].get(key, missing)
        if p is missing or d is missing or p != d:
            shown = {role: "unset" if v is missing else repr(v) for role, v in (("prefill", p), ("decode", d))}
            raise ValueError(
                f"engine_kwargs.{key}: differs between prefill_config ({shown['prefill']}) and decode_config "
                f"({shown['decode']}); the two roles are one engine's replicas (a request's K/V moves between "
                f"equal layouts): only {', '.join(PER_ROLE)} may differ"
            )
        shared[key] = p
    return shared


def _model(prefill: dict, decode: dict) -> dict[str, Any]:
    """The model to load (model_source, else model_id) and the name it is
    served under (model_id); the same in both configs. Neither set: raylm's
    embedded default model."""
    loading = {}
    for role, config in (("prefill", prefill), ("decode", decode)):
        given = config.get("model_loading_config") or {}
        _known(given, MODEL_LOADING_KEYS, f"{role}_config.model_loading_config")
        loading[role] = (given.get("model_id"), given.get("model_source") or given.get("model_id"))
    if loading["prefill"] != loading["decode"]:
        raise ValueError(
            f"decode_config.model_loading_config: model {loading['decode']} differs from prefill_config's "
            f"{loading['prefill']}; both roles serve one model"
        )
    model_id, source = loading["prefill"]
    out: dict[str, Any] = {}
    if source is not None:
        out["model"] = source
    if model_id is not None:
        out["served_model_name"] = [model_id]
    return out


def _replicas(prefill: dict, decode: dict) -> dict[str, Any]:
    """Each role's replicas (num_replicas, or autoscaling_config's start) as
    -dp P+D --prefill-replicas P; with autoscaling, raylm's per-role
    autoscaler, each pool within its config's bounds (--autoscale-prefill,
    --autoscale-decode) and both within their sum (--autoscale), each scaled
    on its own load with one target and one pair of delays for both."""
    counts, bounds, tuning = {}, {}, {}
    for role, config in (("prefill", prefill), ("decode", decode)):
        deployment = dict(config.get("deployment_config") or {})
        _known(deployment, ("num_replicas", "autoscaling_config"), f"{role}_config.deployment_config")
        scaling = deployment.get("autoscaling_config")
        if scaling is None:
            count = deployment.get("num_replicas", 1)
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ValueError(f"{role}_config.deployment_config.num_replicas must be an integer >= 1, got {count!r}")
            counts[role] = count
            continue
        if "num_replicas" in deployment:
            raise ValueError(f"{role}_config.deployment_config: num_replicas or autoscaling_config, not both")
        _known(scaling, tuple(AUTOSCALING_KEYS), f"{role}_config.deployment_config.autoscaling_config")
        low, high = scaling.get("min_replicas", 1), scaling.get("max_replicas", 1)
        for name, value in (("min_replicas", low), ("max_replicas", high)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"{role}_config.deployment_config.autoscaling_config.{name} must be an integer >= 1, got {value!r}"
                )
        if high < low:
            raise ValueError(f"{role}_config.deployment_config.autoscaling_config: max_replicas < min_replicas")
        start = scaling.get("initial_replicas", low)
        if not isinstance(start, int) or not low <= start <= high:
            raise ValueError(
                f"{role}_config.deployment_config.autoscaling_config.initial_replicas must be from "
                f"min_replicas to max_replicas, got {start!r}"
            )
        counts[role], bounds[role] = start, (low, high)
        tuning[role] = {AUTOSCALING_KEYS[k]: v for k, v in scaling.items() if AUTOSCALING_KEYS[k]}
    if len(bounds) == 1:
        fixed = "decode" if "prefill" in bounds else "prefill"
        raise ValueError(
            f"{fixed}_config.deployment_config: autoscaling_config in both configs or neither "
            "(raylm's per-role autoscaler scales both pools)"
        )
    settings: dict[str, Any] = {
        "data_parallel_size": counts["prefill"] + counts["decode"],
        "prefill_replicas": counts["prefill"],
    }
    if bounds:
        if tuning["prefill"] != tuning["decode"]:
            raise ValueError(
                "decode_config.deployment_config.autoscaling_config: target_ongoing_requests, upscale_delay_s "
                f"and downscale_delay_s must equal prefill_config's (one rule scales both pools), got "
                f"{tuning['decode']} and {tuning['prefill']}"
            )
        low = bounds["prefill"][0] + bounds["decode"][0]
        high = bounds["prefill"][1] + bounds["decode"][1]
        settings["autoscale"] = f"{low}:{high}"
        for role in ("prefill", "decode"):
            settings[f"autoscale_{role}"] = "{}:{}".format(*bounds[role])
        settings.update(tuning["prefill"])
    return settings
