"""A raylm driver for the two-host tests, run on the head host by
TwoHosts.run_driver: `python -m tests.multinode.driver '<json spec>'`.

It joins the Ray cluster (by `spec["address"]`, or with no address as a user
on the head machine would), waits for both nodes, builds an LLM with the
spec's layout, generates greedily (optionally losing the worker host
mid-decode), and prints one line `RESULT <json>` with the outputs and where
each rank ran."""

from __future__ import annotations

import json
import os
import sys
import time


def _wait_for_nodes(count: int, timeout: float) -> None:
    import ray

    deadline = time.monotonic() + timeout
    while len([n for n in ray.nodes() if n["Alive"]]) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} live Ray nodes after {timeout} s: {ray.nodes()}")
        time.sleep(0.2)


def replica_per_host(spec: dict, **settings):
    """The LLM the two-host drivers run: joined to the harness's cluster,
    two data-parallel replicas spread one per host, the tiny model in
    float32 (`settings`: the driver's own, added or overriding)."""
    from raylm import LLM
    from raylm.config import ParallelConfig
    from raylm.executor import ray_cluster

    ray_cluster.connect_ray(ParallelConfig(ray_address=spec["address"]), num_cpus_hint=0)
    _wait_for_nodes(2, timeout=60)
    return LLM(
        spec["model"],
        **{
            "dtype": "float32",
            "data_parallel_size": 2,
            "data_parallel_placement": "spread",
            "ray_address": spec["address"],
            "num_threads": 1,
            "kv_cache_memory_bytes": 16 << 20,
            **settings,
        },
    )


def _kill_host(netns: str) -> None:
    """Every process of that namespace host dies at once: its raylet, its
    object store, its workers (a machine lost)."""
    from tests.multinode.harness import kill_netns_processes

    kill_netns_processes(netns)


def _gloo_ifname(worker) -> str | None:
    return os.environ.get("GLOO_SOCKET_IFNAME")


def main(spec: dict) -> dict:
    import ray

    from raylm import LLM, SamplingParams
    from raylm.config import ParallelConfig
    from raylm.executor import ray_cluster

    address = spec.get("address")
    ray_cluster.connect_ray(ParallelConfig(ray_address=address), num_cpus_hint=0)
    _wait_for_nodes(2, timeout=60)
    joined = ray.get_runtime_context().gcs_address

    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    llm = LLM(
        spec["model"],
        dtype=spec.get("dtype", "float32"),
        tensor_parallel_size=spec["tp"],
        pipeline_parallel_size=spec["pp"],
        distributed_executor_backend="ray",
        ray_address=address,
        ray_step_transport=spec.get("transport", "mq"),
        ray_placement_strategy=spec["strategy"],
        ray_placement_timeout=spec.get("placement_timeout", 30.0),
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
        max_restarts=spec.get("max_restarts", 3),
    )
    core = llm.llm_engine.engine_core.engine_core
    try:
        executor = core.executor
        placed = {
            "node_ips": list(executor.node_ips),
            "node_ids": list(executor.node_ids),
            "gloo_ifnames": executor.collective_rpc(_gloo_ifname),
            "broadcast_remote_address": (
                executor.transport.queues.broadcast.export_handle().remote_address
                if executor.config.parallel_config.ray_step_transport == "mq"
                else None
            ),
        }
        if spec.get("bench"):
            return {"placed": placed, "bench": _bench(llm, core, spec["bench"])}
        if spec.get("strike_netns"):
            from tests.engine.test_recovery import generate_with_strike

            outputs = generate_with_strike(llm, spec["prompts"], params, lambda: _kill_host(spec["strike_netns"]))
            token_ids = [list(o.token_ids) for o in outputs]
        else:
            outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
            token_ids = [list(o.outputs[0].token_ids) for o in outs]
        after = core.executor
        return {
            "joined": joined,
            "driver_node_id": ray.get_runtime_context().get_node_id(),
            "driver_node_ip": ray.util.get_node_ip_address(),
            # What a guess from this host's routes would have said instead.
            "guessed_ip": ray._private.services.node_ip_address_from_perspective(None),
            "token_ids": token_ids,
            "placed": placed,
            "recoveries": [event.kind for event in core.recoveries],
            "after": {"node_ips": list(after.node_ips), "node_ids": list(after.node_ids)},
        }
    finally:
        llm.shutdown()


def _bench(llm, core, bench: dict) -> dict:
    """Time one batch (benchmarks/bench_two_hosts.py): the whole run and each step."""
    import random
    import statistics

    from raylm import SamplingParams

    rng = random.Random(0)
    vocab = llm.llm_engine.config.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(16, vocab) for _ in range(bench["input_len"])]}
        for _ in range(bench["num_prompts"])
    ]
    params = SamplingParams(temperature=0, max_tokens=bench["output_len"], ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    step, step_s = core.step, []

    def timed_step():
        t = time.perf_counter()
        out = step()
        step_s.append(time.perf_counter() - t)
        return out

    core.step = timed_step
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "elapsed_s": elapsed,
        "tokens": tokens,
        "steps": len(step_s),
        "median_step_ms": 1e3 * statistics.median(step_s),
    }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
