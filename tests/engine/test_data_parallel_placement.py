"""Where data-parallel replicas land on a simulated multi-node Ray cluster:
packed onto as few nodes as possible, or spread one per node."""

from __future__ import annotations

import pytest

from raylm import LLM, SamplingParams
from raylm.executor.ray_placement import choose_nodes
from tests.conftest import our_live_ray_state, simulated_cluster

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_choose_nodes_pack_fills_a_node_first_and_spread_takes_turns():
    nodes = [("a", 4.0), ("b", 4.0), ("c", 1.0)]
    assert choose_nodes(4, 2.0, "pack", nodes) == ["a", "a", "b", "b"]
    assert choose_nodes(3, 1.0, "spread", nodes) == ["a", "b", "c"]
    assert choose_nodes(4, 1.0, "spread", nodes) == ["a", "b", "c", "a"]
    assert choose_nodes(2, 8.0, "pack", nodes) == [None, None]  # no room: Ray decides, and says so


@pytest.fixture(scope="module")
def cluster():
    """A head without CPUs and two 2-CPU nodes."""
    with simulated_cluster([2, 2]) as (c, nodes):
        yield c, nodes


@pytest.mark.ray
@pytest.mark.parametrize("placement, distinct_nodes", [("pack", 1), ("spread", 2)])
def test_replicas_are_packed_or_spread(cluster, tiny_model_dir, placement, distinct_nodes):
    model = tiny_model_dir("llama", num_key_value_heads=2)
    with LLM(
        model,
        dtype="float32",
        data_parallel_size=2,
        data_parallel_placement=placement,
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
    ) as llm:
        manager = llm.llm_engine.engine_core.launcher.manager
        nodes = {handle.node_id for handle in manager.replicas.values()}
        assert len(nodes) == distinct_nodes
        assert nodes <= {n.node_id for n in cluster[1]}
        outs = llm.generate(["ROMEO:", "JULIET:"], GREEDY, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    live_actors, live_pgs = our_live_ray_state()
    assert not live_actors and not live_pgs
