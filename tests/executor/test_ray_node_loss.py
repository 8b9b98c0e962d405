"""Losing a node mid-decode on a simulated Ray cluster: the engine rebuilds its
executor on the nodes that remain and every request completes; with no room
left it ends with a clear error (docs/architecture.md, "The failure model")."""

from __future__ import annotations

import pytest

from raylm import LLM, SamplingParams
from raylm.engine.errors import EngineDeadError
from raylm.engine.protocol import RecoveryKind
from raylm.testing.hf_oracle import hf_greedy
from tests.conftest import executor_of, our_live_ray_state, simulated_cluster
from tests.engine.test_recovery import generate_with_strike

pytestmark = pytest.mark.ray

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[(5 * i + j) % 200 + 3 for j in range(2 + 7 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def cluster():
    """A head without CPUs (nothing runs there) and three 1-CPU nodes."""
    with simulated_cluster([1, 1, 1]) as (c, nodes):
        yield c, nodes


def test_losing_the_node_of_a_pipeline_stage(cluster, tiny_model_dir):
    c, nodes = cluster
    model = tiny_model_dir("llama", num_key_value_heads=2)
    reference = [r.token_ids for r in hf_greedy(model, PROMPTS, MAX_TOKENS)]
    llm = LLM(
        model,
        dtype="float32",
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
        ray_placement_strategy="STRICT_SPREAD",
        ray_placement_timeout=3.0,
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
        max_restarts=2,
    )
    executors = [executor_of(llm)]
    try:

        def remove_node_of_rank(rank: int):
            node_id = executor_of(llm).node_ids[rank]
            node = next(n for n in nodes if n.node_id == node_id)
            nodes.remove(node)
            c.remove_node(node)

        # Stage 1's node goes: the two nodes left can hold both stages.
        outputs = generate_with_strike(llm, PROMPTS, GREEDY, lambda: remove_node_of_rank(1))
        assert [o.token_ids for o in outputs] == reference
        core = llm.llm_engine.engine_core.engine_core
        assert [e.kind for e in core.recoveries] == [RecoveryKind.WORKER_DIED]
        new = executor_of(llm)
        executors.append(new)
        assert len(set(new.node_ids)) == 2 and set(new.node_ids) <= {n.node_id for n in nodes}

        # Another node goes: one 1-CPU node cannot hold two spread stages.
        with pytest.raises(EngineDeadError, match="could not place 2 workers"):
            generate_with_strike(llm, PROMPTS, GREEDY, lambda: remove_node_of_rank(0))
        assert core.failures_by_kind.get(RecoveryKind.REBUILD_FAILED, 0) >= 1
    finally:
        llm.shutdown()
    live_actors, live_pgs = our_live_ray_state()
    assert not live_actors, "worker actors left behind"
    assert not live_pgs, "placement groups left behind"
