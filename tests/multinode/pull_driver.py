"""A driver for the two-host prefix pull test, run on the head host by
TwoHosts.run_driver: `python -m tests.multinode.pull_driver '<json spec>'`.

Two data-parallel replicas spread over the two hosts (one each). A first
request is pinned to the worker host's replica (its prompt's blocks stay
cached there); a second, sharing the prompt's prefix, is pinned to the
head's: its prefix is pulled across the hosts' link (the worker's K/V
server, admitting the head's address only). Prints `RESULT <json>`: the
outputs, where the replicas ran, how the pull went (its transport's host
and peer, its outcome), the head replica's prefix-cache hits, and each
replica's KV use at the end."""

from __future__ import annotations

import json
import sys

from tests.multinode.driver import replica_per_host
from tests.multinode.migration_driver import _kv_in_use


def main(spec: dict) -> dict:
    import ray

    from raylm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    with replica_per_host(spec) as llm:
        engine, supervisor = llm.llm_engine, llm.llm_engine.engine_core
        node_ips = {i: c.node_ip for i, c in supervisor.channels.items()}
        head = next(i for i, ip in node_ips.items() if ip == ray.util.get_node_ip_address())
        other = 1 - head
        done, routes = {}, []

        def run(rid: str, prompt: list[int], rank: int) -> None:
            engine.add_request(rid, {"prompt_token_ids": prompt}, params, data_parallel_rank=rank)
            routes.extend(
                {"host": p.network.host, "peer": p.network.peer} if p.network else None
                for p in supervisor.pulls._pulls.values()
            )
            while engine.has_unfinished_requests():
                for out in engine.step():
                    done[out.request_id] = list(out.outputs[0].token_ids)

        run("first", spec["prompts"][0], other)
        hits_before = supervisor.channels[head].stats.prefix_cache_hits if supervisor.channels[head].stats else 0
        run("second", spec["prompts"][1], head)
        return {
            "node_ips": node_ips,
            "head": head,
            "token_ids": [done["first"], done["second"]],
            "routes": routes,
            "pulls": dict(supervisor.pulls.counts),
            "head_prefix_hits": supervisor.channels[head].stats.prefix_cache_hits - hits_before,
            "kv_in_use": _kv_in_use(supervisor),
        }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
