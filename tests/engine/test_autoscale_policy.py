"""AutoscalePolicy: how many replicas the load calls for, and the delays
before acting (pure: time is an argument)."""

import pytest

from raylm.config import AutoscaleConfig, create_engine_config
from raylm.engine.autoscaler import AutoscalePolicy


def _replicas(*in_flight, waiting=0, kv=0.0, state="serving"):
    return [{"replica": i, "state": state, "in_flight": n, "num_waiting": waiting, "kv_cache_usage": kv}
            for i, n in enumerate(in_flight)]


def _policy(**overrides):
    settings = dict(min_replicas=1, max_replicas=3, target_ongoing_requests=2.0, upscale_delay_s=1.0,
                    downscale_delay_s=5.0)
    return AutoscalePolicy(AutoscaleConfig(**{**settings, **overrides}))


def test_scale_out_after_the_upscale_delay_and_not_past_max():
    policy = _policy()
    assert policy.decide(_replicas(9), now=0.0) is None  # asks for 3 (capped from 5), since 0.0
    assert policy.decide(_replicas(9), now=0.5) is None
    decision = policy.decide(_replicas(9), now=1.1)
    assert decision.num_replicas == 3 and decision.direction == "up" and "9 request(s) in flight" in decision.reason


def test_a_short_burst_moves_nothing():
    policy = _policy()
    assert policy.decide(_replicas(9), now=0.0) is None
    assert policy.decide(_replicas(1), now=0.6) is None  # the burst is over: the clock restarts
    assert policy.decide(_replicas(9), now=1.2) is None
    assert policy.decide(_replicas(9), now=2.3).num_replicas == 3


def test_scale_in_after_the_downscale_delay_not_below_min():
    policy = _policy()
    assert policy.decide(_replicas(0, 0, 0), now=0.0) is None
    assert policy.decide(_replicas(0, 0, 0), now=4.0) is None
    decision = policy.decide(_replicas(0, 0, 0), now=5.5)
    assert decision.num_replicas == 1 and decision.direction == "down"


def test_kv_pressure_and_queues_ask_for_one_more():
    policy = _policy(upscale_delay_s=0.0)
    assert policy.decide(_replicas(2, kv=0.9), now=0.0).num_replicas == 2
    assert "KV cache usage" in policy.decide(_replicas(2, 2, kv=0.95), now=1.0).reason
    assert policy.decide(_replicas(1, 1, waiting=3), now=2.0).num_replicas == 3


def test_nothing_is_decided_while_replicas_start_or_leave():
    policy = _policy(upscale_delay_s=0.0)
    assert policy.decide(_replicas(9) + [{"replica": 1, "state": "starting"}], now=0.0) is None


@pytest.mark.parametrize("value, error", [("3", "MIN:MAX"), ("0:2", "1 <= MIN <= MAX"), ("3:2", "1 <= MIN <= MAX"),
                                          ("1:1", "at least 2"), ("1:65", "at most 64")])
def test_bad_autoscale_settings_are_refused(value, error):
    with pytest.raises(ValueError, match=error):
        create_engine_config(autoscale=value)


def test_autoscale_starts_with_min_replicas():
    config = create_engine_config(autoscale="2:4", data_parallel_backend="mp")
    assert config.parallel_config.data_parallel_size == 2 and config.autoscale.max_replicas == 4
    with pytest.raises(ValueError, match="outside autoscale"):
        create_engine_config(autoscale="2:4", data_parallel_size=5)
