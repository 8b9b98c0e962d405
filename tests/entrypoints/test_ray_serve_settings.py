"""raylm.ray_serve's settings: `serve run raylm.ray_serve:app key=value`
arguments parse as `raylm serve`'s flags, bad ones name the field, and a
replica's reservation follows its parallelism; data parallelism inside a
replica (its replicas, its autoscaler) is refused; a replica's app refuses
its admin routes to a client without a key, as a server on the network does.
No Ray is started."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from raylm.ray_serve import (
    build_replica_app,
    plan_replica,
    settings_from_strings,
    split_settings,
)


def test_serve_run_arguments_parse_as_raylm_serve_flags():
    settings, deployment = settings_from_strings(
        {
            "model": "/m",
            "tensor-parallel-size": "2",
            "enable_prefix_caching": "false",
            "served_model_name": "a,b",
            "num_replicas": "3",
            "autoscaling_config": '{"min_replicas": 1, "max_replicas": 2}',
        }
    )
    assert settings == {
        "model": "/m",
        "tensor_parallel_size": 2,
        "enable_prefix_caching": False,
        "served_model_name": ["a", "b"],
    }
    assert deployment == {"num_replicas": 3, "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}
    engine, options = plan_replica(split_settings(settings)[0] | {"device": "cpu"})
    assert engine["distributed_executor_backend"] == "ray"
    assert options["placement_group_bundles"] == [{"CPU": 0.01}, {"CPU": 1.0}, {"CPU": 1.0}]


@pytest.mark.parametrize(
    "args, field",
    [
        ({"bogus": "1"}, "bogus"),
        ({"port": "8001"}, "port"),
        ({"tensor_parallel_size": "two"}, "tensor-parallel-size"),
        ({"enable_prefix_caching": "maybe"}, "enable_prefix_caching"),
    ],
)
def test_bad_serve_run_arguments_name_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        settings_from_strings(args)


def test_data_parallel_inside_a_replica_is_refused():
    with pytest.raises(ValueError, match="data_parallel_size"):
        plan_replica(split_settings({"data_parallel_size": 2, "device": "cpu"})[0])


@pytest.mark.parametrize("args", [{"autoscale": "1:4"}, {"autoscale": "2:2", "data_parallel_size": "1"}])
def test_raylms_own_autoscaling_inside_a_replica_is_refused(args):
    # Each Serve replica would run a data-parallel engine with its own
    # autoscaler, under Serve's: the message says which field, and what instead.
    settings, _ = settings_from_strings(args)
    with pytest.raises(ValueError, match=r"^autoscale: .*autoscaling_config"):
        plan_replica(split_settings(settings | {"device": "cpu"})[0])


# ---- a replica's app -------------------------------------------------------------------


def _engine() -> SimpleNamespace:
    """What build_app reads of an engine while it builds the app and
    answers an admin route: one engine, no data parallelism."""
    config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=64, model="/m"),
        scheduler_config=SimpleNamespace(max_num_seqs=1),
        parallel_config=SimpleNamespace(data_parallel_size=1),
        lora_config=None,
    )
    return SimpleNamespace(config=config, replica_states=lambda: None)


def _post(app, path: str, headers=None) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json={"data_parallel_size": 2}, headers=headers)

    return asyncio.run(go())


@pytest.mark.parametrize("path", ["/scale", "/replicas/0/restart"])
def test_a_replicas_admin_routes_refuse_a_client_without_a_key(monkeypatch, path):
    # Serve's proxy passes on whoever reaches it: not a loopback server.
    for name in ("RAYLM_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    _, server = split_settings({})
    response = _post(build_replica_app(_engine(), ["m"], server), path)
    assert response.status_code == 403, response.text
    assert response.json()["error"]["type"] == "permission_error"


def test_with_a_key_a_replicas_admin_routes_need_it():
    _, server = split_settings({"api_key": "k"})
    app = build_replica_app(_engine(), ["m"], server)
    assert _post(app, "/scale").status_code == 401
    assert _post(app, "/scale", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_a_ray_older_than_the_serve_support_is_refused():
    from raylm.ray_serve import check_serve_ray_version

    with pytest.raises(RuntimeError, match=r"needs Ray >= 2\.58 \(this is 2\.40\.0\)"):
        check_serve_ray_version("2.40.0")
    check_serve_ray_version("2.58.0")
    check_serve_ray_version("2.60.1")


def test_a_replica_is_built_with_every_server_setting_raylm_serve_passes(monkeypatch):
    """The reasoning parser and the structured-output defaults were accepted
    as settings and dropped: a replica served without them."""
    import raylm.entrypoints.openai.api_server as api_server

    built = {}
    monkeypatch.setattr(api_server, "build_app", lambda engine, names, **kwargs: built.update(kwargs))
    _, server = split_settings(
        {"reasoning_parser": "deepseek_r1", "structured_outputs_config": '{"disable_any_whitespace": true}'}
    )
    build_replica_app(_engine(), ["m"], server)
    assert built["reasoning_parser"] == "deepseek_r1"
    assert built["structured_outputs_defaults"].disable_any_whitespace is True


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"reasoning_parser": "nope"}, "reasoning_parser"),
        ({"structured_outputs_config": "{"}, "structured-outputs-config"),
    ],
)
def test_a_bad_server_setting_is_refused_at_build_naming_it(settings, field):
    with pytest.raises(ValueError, match=field):
        split_settings(settings)


# ---- build_pd_openai_app: Ray Serve LLM's P/D shape onto one raylm engine ----------------------


def _role(model_id="m", threads=None, deployment=None, **engine):
    config = {"model_loading_config": {"model_id": model_id}, "engine_kwargs": dict(engine)}
    if threads is not None:
        config["engine_kwargs"]["num_threads"] = threads
    if deployment is not None:
        config["deployment_config"] = deployment
    return config


def test_the_two_configs_become_the_roles_of_one_engine(tiny_model_dir):
    from raylm.config import create_engine_config
    from raylm.ray_serve_pd import pd_settings

    settings, ingress = pd_settings(
        {
            "prefill_config": _role(threads=2, deployment={"num_replicas": 2}, tensor_parallel_size=2),
            "decode_config": _role(threads=1, tensor_parallel_size=2),
            "ingress_deployment_config": {"max_ongoing_requests": 64},
        }
    )
    assert settings == {
        "tensor_parallel_size": 2,
        "model": "m",
        "served_model_name": ["m"],
        "prefill_num_threads": 2,
        "decode_num_threads": 1,
        "data_parallel_size": 3,
        "prefill_replicas": 2,
    }
    assert ingress == {"max_ongoing_requests": 64}
    # The settings are `raylm serve`'s (checked as they are for one replica).
    assert split_settings(settings)[0]["prefill_replicas"] == 2
    # Autoscaled: both pools by raylm's per-role autoscaler, within the sum of their bounds.
    scaling = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4}
    settings, _ = pd_settings(
        {
            "prefill_config": _role(deployment={"autoscaling_config": scaling}),
            "decode_config": _role(deployment={"autoscaling_config": dict(scaling, initial_replicas=2)}),
        }
    )
    assert (settings["data_parallel_size"], settings["prefill_replicas"], settings["autoscale"]) == (3, 1, "2:6")
    assert settings["autoscale_target_ongoing_requests"] == 4
    assert (settings["autoscale_prefill"], settings["autoscale_decode"]) == ("1:3", "1:3")
    # What the Serve replica's engine resolves them to (the model aside).
    engine = split_settings({**settings, "model": tiny_model_dir("llama")})[0]
    engine.pop("usage_context", None)
    config = create_engine_config(**engine)
    assert (config.autoscale.setting, config.autoscale.target_ongoing_requests) == ("2:6", 4.0)
    assert config.autoscale.role_range("prefill") == config.autoscale.role_range("decode") == (1, 3)
    assert (config.parallel_config.data_parallel_size, config.parallel_config.prefill_replicas) == (3, 1)


@pytest.mark.parametrize(
    "args, field",
    [
        ({"prefill_config": _role(), "decode_config": _role("other")}, "decode_config.model_loading_config"),
        (
            {"prefill_config": _role(tensor_parallel_size=2), "decode_config": _role()},
            "engine_kwargs.tensor_parallel_size: differs",
        ),
        (
            {"prefill_config": _role(pipeline_parallel_size=2), "decode_config": _role(pipeline_parallel_size=1)},
            "engine_kwargs.pipeline_parallel_size: differs",
        ),
        ({"prefill_config": _role(), "decode_config": _role(), "proxy_cls_config": {}}, "proxy_cls_config"),
        ({"prefill_config": _role() | {"accelerator_type": "A10G"}, "decode_config": _role()}, "accelerator_type"),
        ({"decode_config": _role()}, "prefill_config"),
        (
            {"prefill_config": _role(data_parallel_size=2), "decode_config": _role(data_parallel_size=2)},
            "prefill_config.engine_kwargs.data_parallel_size",
        ),
        (
            {"prefill_config": _role(deployment={"num_replicas": 0}), "decode_config": _role()},
            "prefill_config.deployment_config.num_replicas",
        ),
        (
            {"prefill_config": _role(deployment={"autoscaling_config": {"max_replicas": 2}}), "decode_config": _role()},
            "decode_config.deployment_config: autoscaling_config in both",
        ),
        (
            {
                "prefill_config": _role(deployment={"autoscaling_config": {"max_replicas": 2, "upscale_delay_s": 1}}),
                "decode_config": _role(deployment={"autoscaling_config": {"max_replicas": 2}}),
            },
            "upscale_delay_s",
        ),
        (
            {"prefill_config": _role(), "decode_config": _role(), "ingress_deployment_config": {"num_replicas": 2}},
            "ingress_deployment_config.num_replicas",
        ),
        ({"prefill_config": _role(port=8001), "decode_config": _role(port=8001)}, "port"),
    ],
)
def test_what_does_not_map_onto_one_engine_is_refused_by_name(args, field):
    from raylm.ray_serve import build_pd_openai_app

    with pytest.raises(ValueError, match=field):
        build_pd_openai_app(args)
