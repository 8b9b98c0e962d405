"""A driver for the two-host migration test, run on the head host by
TwoHosts.run_driver: `python -m tests.multinode.migration_driver '<json spec>'`.

Two data-parallel replicas spread over the two hosts (one each); requests
decode on both; once each has a few tokens, every request of the worker
host's replica is migrated to the head's (the K/V crosses the hosts' link)
and one of the head's goes the other way. Prints `RESULT <json>`: the
outputs, where the replicas ran, how each migration moved its K/V, the
migration and recompute counters, and each replica's KV use at the end."""

from __future__ import annotations

import json
import sys
import time

from tests.multinode.driver import replica_per_host


def _kv_in_use(supervisor) -> dict[int, float]:
    """Each core's KV usage, fresh (a ping makes every core report its stats)."""
    supervisor.ping()
    deadline = time.monotonic() + 60
    while supervisor.pings and time.monotonic() < deadline:
        supervisor._housekeeping()
        if supervisor._output.poll(100):
            supervisor._receive(supervisor._output.recv(copy=False))
    return {i: c.stats.kv_cache_usage for i, c in supervisor.channels.items()}


def main(spec: dict) -> dict:
    import ray

    from raylm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    with replica_per_host(spec) as llm:
        engine, supervisor = llm.llm_engine, llm.llm_engine.engine_core
        node_ips = {i: c.node_ip for i, c in supervisor.channels.items()}
        resubmitted = []  # requests recomputed (sent again): none should be
        abandoned = []  # why a migration was given up, if one was
        events = []  # each ended migration as the supervisor measured it (downtime, bytes)
        take_events = supervisor.take_migration_events
        supervisor.take_migration_events = lambda: [events.append(e) or e for e in take_events()]
        end_migration = supervisor.migrations._end_migration
        supervisor.migrations._end_migration = lambda m, ok, why="", **kw: (
            abandoned.append(why) if not ok else None,
            end_migration(m, ok, why, **kw),
        )
        resubmit = supervisor.router.resubmit
        supervisor.router.resubmit = lambda rid: (resubmitted.append(rid), resubmit(rid))
        head = next(i for i, ip in node_ips.items() if ip == ray.util.get_node_ip_address())
        other = 1 - head
        for i, prompt in enumerate(spec["prompts"]):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        done, moved = {}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = list(out.outputs[0].token_ids)
            if not moved and all(len(e.token_ids) >= spec["min_tokens"] for e in supervisor.ledger.values()):
                away = sorted(supervisor.channels[other].in_flight)
                back = sorted(supervisor.channels[head].in_flight)[:1]
                for rid, destination in [(r, head) for r in away] + [(r, other) for r in back]:
                    assert supervisor.migrate(rid, destination), rid
                    migration = supervisor.migrations[supervisor.migrations.by_request[rid]]
                    moved[rid] = {
                        "to": destination,
                        "network": migration.network is not None,
                        "host": migration.network.host if migration.network else None,
                    }
        return {
            "node_ips": node_ips,
            "token_ids": [done[str(i)] for i in range(len(spec["prompts"]))],
            "moved": moved,
            "migration_counts": supervisor.migration_counts,
            "abandoned": abandoned,
            "events": [
                {"ok": e.ok, "downtime_s": e.downtime_s, "seconds": e.seconds, "num_bytes": e.num_bytes} for e in events
            ],
            "recomputed": resubmitted,
            "replica_restarts": supervisor.restart_budget.num_restarts,
            "preemptions": supervisor.aggregate_stats().num_preemptions,
            "kv_in_use": _kv_in_use(supervisor),
        }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
