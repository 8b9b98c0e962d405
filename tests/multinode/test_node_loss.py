"""Losing a host mid-decode on the two-host cluster (harness.py): every
process of the worker host dies at once (raylet, object store, ranks); the
engine rebuilds its executor on the head and every request completes with
the uninterrupted run's output (docs/architecture.md, "The failure model")."""

from __future__ import annotations

from raylm.engine.protocol import RecoveryKind
from raylm.testing.hf_oracle import hf_greedy
from tests.multinode.harness import HEAD_IP, WORKER_IP

MAX_TOKENS = 12
PROMPTS = [[(5 * i + j) % 200 + 3 for j in range(2 + 9 * i)] for i in range(6)]


def test_losing_the_worker_host_mid_decode_is_recovered_on_the_head(fresh_hosts, tiny_model_dir):
    model = tiny_model_dir("llama", num_hidden_layers=2)
    # PP=2 spread over the hosts; after the loss both stages fit on the head's 2 CPUs.
    result = fresh_hosts.run_driver(
        {
            "model": model,
            "tp": 1,
            "pp": 2,
            "strategy": "SPREAD",
            "prompts": PROMPTS,
            "max_tokens": MAX_TOKENS,
            "address": fresh_hosts.address,
            "strike_netns": fresh_hosts.worker.name,
            "placement_timeout": 10.0,
        },
        timeout=170,
    )
    assert result["placed"]["node_ips"] == [HEAD_IP, WORKER_IP]
    assert result["recoveries"] == [RecoveryKind.WORKER_DIED]
    assert result["after"]["node_ips"] == [HEAD_IP, HEAD_IP]
    reference = [r.token_ids for r in hf_greedy(model, PROMPTS, MAX_TOKENS)]
    assert result["token_ids"] == reference
