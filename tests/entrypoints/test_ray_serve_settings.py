"""raylm.ray_serve's settings: `serve run raylm.ray_serve:app key=value`
arguments parse as `raylm serve`'s flags, bad ones name the field, and a
replica's reservation follows its parallelism. No Ray is started."""

from __future__ import annotations

import pytest

from raylm.ray_serve import plan_replica, settings_from_strings, split_settings


def test_serve_run_arguments_parse_as_raylm_serve_flags():
    settings, deployment = settings_from_strings({
        "model": "/m", "tensor-parallel-size": "2", "enable_prefix_caching": "false", "served_model_name": "a,b",
        "num_replicas": "3", "autoscaling_config": '{"min_replicas": 1, "max_replicas": 2}'})
    assert settings == {"model": "/m", "tensor_parallel_size": 2, "enable_prefix_caching": False,
                        "served_model_name": ["a", "b"]}
    assert deployment == {"num_replicas": 3, "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}
    engine, options = plan_replica(split_settings(settings)[0] | {"device": "cpu"})
    assert engine["distributed_executor_backend"] == "ray"
    assert options["placement_group_bundles"] == [{"CPU": 0.01}, {"CPU": 1.0}, {"CPU": 1.0}]


@pytest.mark.parametrize("args, field", [
    ({"bogus": "1"}, "bogus"),
    ({"port": "8001"}, "port"),
    ({"tensor_parallel_size": "two"}, "tensor-parallel-size"),
    ({"enable_prefix_caching": "maybe"}, "enable_prefix_caching"),
])
def test_bad_serve_run_arguments_name_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        settings_from_strings(args)


def test_data_parallel_inside_a_replica_is_refused():
    with pytest.raises(ValueError, match="data_parallel_size"):
        plan_replica(split_settings({"data_parallel_size": 2, "device": "cpu"})[0])


def test_a_ray_older_than_the_serve_support_is_refused():
    from raylm.ray_serve import check_serve_ray_version

    with pytest.raises(RuntimeError, match=r"needs Ray >= 2\.58 \(this is 2\.40\.0\)"):
        check_serve_ray_version("2.40.0")
    check_serve_ray_version("2.58.0")
    check_serve_ray_version("2.60.1")
