"""raylm across two real hosts (network namespaces on their own addresses, a
Ray node on each; see harness.py): placement, the step transport and the
collectives cross the hosts' link, and node identity comes from Ray.

The head host has a second network that carries its default route, so a
driver that guessed its address from its routes would pick 10.98.0.1 where
Ray says 10.99.0.1."""

from __future__ import annotations

import pytest

from raylm.testing.hf_oracle import hf_greedy
from tests.multinode.harness import HEAD_IP, OTHER_HEAD_IP, WORKER_IP

MAX_TOKENS = 12
PROMPTS = [[(5 * i + j) % 200 + 3 for j in range(2 + 9 * i)] for i in range(6)]


@pytest.mark.parametrize("transport", ["mq", "cgraph"])
def test_tp2_pp2_across_two_hosts_equals_the_oracle(hosts, tiny_model_dir, transport):
    model = tiny_model_dir("llama", num_hidden_layers=2)
    # No address: the driver joins the cluster the head's `ray start` recorded.
    result = hosts.run_driver(
        {
            "model": model,
            "tp": 2,
            "pp": 2,
            "strategy": "PACK",
            "prompts": PROMPTS,
            "max_tokens": MAX_TOKENS,
            "transport": transport,
        },
        timeout=150,
    )
    assert result["joined"] == hosts.address
    # Node identity is Ray's, not a guess from the driver's routes.
    assert result["driver_node_ip"] == HEAD_IP
    assert result["guessed_ip"] == OTHER_HEAD_IP
    placed = result["placed"]
    # Rank 0 on the driver's host; each TP group on one host; the PP stages apart.
    assert placed["node_ips"] == [HEAD_IP, HEAD_IP, WORKER_IP, WORKER_IP]
    assert len(set(placed["node_ids"])) == 2
    # gloo on the interface that carries each node's Ray IP (found, not configured).
    assert placed["gloo_ifnames"] == [hosts.head.name] * 2 + [hosts.worker.name] * 2
    if transport == "mq":
        # The worker host's ranks read the step over ZMQ at the head's Ray IP.
        assert placed["broadcast_remote_address"].startswith(f"tcp://{HEAD_IP}:")
    reference = [r.token_ids for r in hf_greedy(model, PROMPTS, MAX_TOKENS)]
    assert result["token_ids"] == reference
