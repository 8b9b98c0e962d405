"""A driver for the two-host prefill/decode test, run on the head host by
TwoHosts.run_driver: `python -m tests.multinode.pd_driver '<json spec>'`.

Two data-parallel replicas spread over the two hosts (one each), replica 0
prefilling and replica 1 decoding (`prefill_replicas=1`, every prompt long
enough to hand off). Each request is prefilled on one host and handed to the
other after its first token, its K/V crossing the hosts' link. Prints
`RESULT <json>`: the outputs, where the replicas ran, how each hand-off's
K/V moved (network or not, from which host), the hand-off counts by
outcome, the requests recomputed (none should be), and each replica's KV
use at the end."""

from __future__ import annotations

import json
import sys

from tests.multinode.driver import replica_per_host
from tests.multinode.migration_driver import _kv_in_use


def main(spec: dict) -> dict:
    from raylm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    with replica_per_host(spec, prefill_replicas=1, pd_min_prompt_tokens=1) as llm:
        engine, supervisor = llm.llm_engine, llm.llm_engine.engine_core
        node_ips = {i: c.node_ip for i, c in supervisor.channels.items()}
        moves = []  # each hand-off's K/V route, as the supervisor chose it
        migrations = supervisor.migrations
        migrate = migrations.migrate

        def recording_migrate(request_id, *args, **kwargs):
            started = migrate(request_id, *args, **kwargs)
            if started:
                m = migrations[migrations.by_request[request_id]]
                host = m.network.host if m.network else None
                moves.append({"source": m.source, "destination": m.destination, "reason": m.reason, "host": host})
            return started

        migrations.migrate = recording_migrate
        resubmitted = []
        resubmit = supervisor.router.resubmit
        supervisor.router.resubmit = lambda rid: (resubmitted.append(rid), resubmit(rid))
        for i, prompt in enumerate(spec["prompts"]):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = list(out.outputs[0].token_ids)
        return {
            "node_ips": node_ips,
            "roles": {i: supervisor.handoffs.role_of(i) for i in supervisor.channels},
            "token_ids": [done[str(i)] for i in range(len(spec["prompts"]))],
            "moves": moves,
            "handoffs": {k: v for k, v in supervisor.handoffs.counts.items() if v},
            "recomputed": resubmitted,
            "kv_in_use": _kv_in_use(supervisor),
        }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
