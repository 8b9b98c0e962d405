"""The chaos harness on two hosts (network namespaces, a Ray node on each:
harness.py): seeded schedules of kills, freezes, migrations across the
hosts' link, replica restarts, aborts and network partitions (short ones,
inside every deadline, and long ones, past the step deadline) against one
data-parallel replica per host (chaos_driver.py). Every stream must end with
Hugging Face's greedy float32 output (or, aborted, a prefix of it), the
engine must live, and no replica, actor or placement group may be left.

RAYLM_CHAOS_PARTITION_SEEDS (comma-separated) sets the seeds (the soak: more)."""

from __future__ import annotations

import os

import pytest

from raylm.testing.chaos.schedule import Replay
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import STRAGGLER_TOKEN, straggling

SEEDS = [int(s) for s in os.environ.get("RAYLM_CHAOS_PARTITION_SEEDS", "1,2").split(",")]
MAX_TOKENS = 200
# The straggler token makes each step last 50 ms more: the streams (~10 s)
# outlast the schedule and a long partition however fast the machine.
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(4 + 5 * i)] + [STRAGGLER_TOKEN] for i in range(6)]


@pytest.mark.timeout(900)
def test_seeded_schedules_with_partitions_across_two_hosts(hosts, tiny_model_dir, monkeypatch):
    straggling(monkeypatch, ms=50)
    model = tiny_model_dir("llama", num_key_value_heads=2)
    reference = {f"s{i}": r.token_ids for i, r in enumerate(hf_greedy(model, PROMPTS, MAX_TOKENS))}
    result = hosts.run_driver(
        {
            "model": model,
            "address": hosts.address,
            "prompts": PROMPTS,
            "max_tokens": MAX_TOKENS,
            "seeds": SEEDS,
            "netns": [hosts.head.name, hosts.worker.name],
        },
        timeout=240 * len(SEEDS),
        module="tests.multinode.chaos_driver",
    )
    failed = []
    for r in result["replays"]:
        replay = Replay(
            tokens=r["tokens"],
            finished=set(r["finished"]),
            aborted=set(r["aborted"]),
            errors=r["errors"],
            done=r["done"],
        )
        broken = replay.failures(reference)
        if r["dead_error"] is not None:
            broken.append(f"the engine died: {r['dead_error']}")
        broken += [f"left behind: {what}" for what in r["left"]]
        print(
            f"seed {r['seed']} ({r['seconds']:.0f} s, {r['partitions']} partitions, {r['restarts']} restarts, "
            f"migrations {r['migrations']}, serving {r['serving']}, steps {r['steps']}): "
            f"{'ok' if not broken else 'FAILED'}; " + "; ".join(r["done"])
        )
        if broken:
            failed.append((r["seed"], broken))
    print(f"chaos on two hosts: {len(failed)} of {len(result['replays'])} schedules failed")
    if failed:
        print(
            "the driver's log:\n"
            + "\n".join(line for line in hosts.last_stderr.splitlines() if "fault injection armed" not in line)[-12000:]
        )
    assert not failed, failed
    # The operation only two hosts have ran (seeds 1 and 2: a long partition, and a short one).
    assert sum(r["partitions"] for r in result["replays"]) > 0
