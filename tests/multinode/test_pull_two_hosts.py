"""A prompt's cached prefix pulled across two real hosts (network
namespaces, a Ray node on each; harness.py): the holder's rank offers its
blocks on its K/V server at its host's address, admitting the destination
host's only (raylm.kv_transfer.peer_filter), and the destination, on the
other host, connects from that address, reads them, and computes only the
rest of its prompt. Outputs equal Hugging Face's greedy run (float32)."""

from __future__ import annotations

from raylm.testing.hf_oracle import hf_greedy
from tests.multinode.harness import HEAD_IP, WORKER_IP

BLOCK = 16
PREFIX = [(11 * j) % 250 + 3 for j in range(80)]  # 5 blocks
PROMPTS = [PREFIX + [5, 6], PREFIX + [9, 10, 11]]
MAX_TOKENS = 8


def test_a_prefix_is_pulled_across_hosts_and_outputs_equal_hugging_face(hosts, tiny_model_dir):
    model = tiny_model_dir("llama", num_key_value_heads=2)
    result = hosts.run_driver(
        {"model": model, "address": hosts.address, "prompts": PROMPTS, "max_tokens": MAX_TOKENS},
        timeout=240,
        module="tests.multinode.pull_driver",
    )
    ips = {int(i): ip for i, ip in result["node_ips"].items()}
    assert sorted(ips.values()) == [HEAD_IP, WORKER_IP]
    head = result["head"]
    # Over the network, from the worker host's replica to the head's address.
    assert result["routes"] == [{"host": ips[1 - head], "peer": ips[head]}], result["routes"]
    assert result["pulls"] == {"started": 1, "ok": 1}, result["pulls"]
    assert result["head_prefix_hits"] == len(PREFIX) // BLOCK * BLOCK
    assert result["kv_in_use"] == {"0": 0.0, "1": 0.0}
    assert result["token_ids"] == [r.token_ids for r in hf_greedy(model, PROMPTS, MAX_TOKENS)]
