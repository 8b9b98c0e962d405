"""Live migration across two real hosts (network namespaces, a Ray node on
each; harness.py): one data-parallel replica per host, requests moved
mid-decode both ways. Their K/V crosses the hosts' link as sealed frames over TCP
(raylm.kv_transfer.network), not shared memory, and every output equals
Hugging Face's greedy run (float32): nothing recomputed, no block left.
The same move made as a prefill/decode hand-off (issue 50) crosses the hosts too."""

from __future__ import annotations

from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import STRAGGLER_TOKEN, straggling
from tests.multinode.harness import HEAD_IP, WORKER_IP

MAX_TOKENS = 200
# Each prompt holds the straggler token, so that every step takes 20 ms more:
# on a fast machine the tiny model decoded 200 tokens before a migration of
# ~0.1 s ended, and the move was given up ("the request ended").
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(5 + 9 * i)] + [STRAGGLER_TOKEN] for i in range(4)]


def test_requests_migrated_between_hosts_mid_decode_equal_hugging_face(hosts, tiny_model_dir, monkeypatch):
    straggling(monkeypatch)  # read by the replicas' engines (RAYLM_* reaches Ray actors)
    model = tiny_model_dir("llama", num_key_value_heads=2)
    result = hosts.run_driver(
        {"model": model, "address": hosts.address, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "min_tokens": 2},
        timeout=240,
        module="tests.multinode.migration_driver",
    )
    assert sorted(result["node_ips"].values()) == [HEAD_IP, WORKER_IP]
    moved = result["moved"]
    # Both directions, each over the network from the source's host.
    assert {m["to"] for m in moved.values()} == {0, 1}, moved
    assert all(m["network"] and m["host"] == result["node_ips"][str(1 - m["to"])] for m in moved.values()), moved
    assert result["abandoned"] == []
    assert result["migration_counts"] == {"migrated": len(moved), "abandoned": 0}
    print("migrations across hosts:", result["events"])  # shown with -s: the pause per move
    # Each move's pause was measured (the source's last token to the destination's first).
    assert len(result["events"]) == len(moved) and all(e["ok"] and e["num_bytes"] > 0 for e in result["events"])
    assert result["recomputed"] == [] and result["replica_restarts"] == 0 and result["preemptions"] == 0
    assert result["kv_in_use"] == {"0": 0.0, "1": 0.0}
    assert result["token_ids"] == [r.token_ids for r in hf_greedy(model, PROMPTS, MAX_TOKENS)]


def test_prefill_on_one_host_decode_on_the_other_equals_hugging_face(hosts, tiny_model_dir, monkeypatch):
    """P/D across hosts (issue 50): replica 0 prefills, replica 1 decodes, one
    per host; every request's prompt K/V is handed to the other host over the
    network after its first token, none is recomputed, and the outputs equal
    Hugging Face's. In this module: a hand-off is a migration's final stage,
    and the module's cluster is shared."""
    straggling(monkeypatch)  # each step 20 ms more: the requests are still decoding when their hand-offs end
    model = tiny_model_dir("llama", num_key_value_heads=2)
    prompts = PROMPTS[:3]
    result = hosts.run_driver(
        {"model": model, "address": hosts.address, "prompts": prompts, "max_tokens": 24},
        timeout=240,
        module="tests.multinode.pd_driver",
    )
    ips = result["node_ips"]
    assert sorted(ips.values()) == [HEAD_IP, WORKER_IP]
    assert result["roles"] == {"0": "prefill", "1": "decode"}
    # Every request moved once, prefill -> decode, over the network from the prefill replica's host.
    assert result["moves"] == [{"source": 0, "destination": 1, "reason": "pd_handoff", "host": ips["0"]}] * len(
        prompts
    ), result["moves"]
    assert result["handoffs"] == {"ok": len(prompts)}, result["handoffs"]
    assert result["recomputed"] == []
    assert result["kv_in_use"] == {"0": 0.0, "1": 0.0}
    assert result["token_ids"] == [r.token_ids for r in hf_greedy(model, prompts, 24)]
