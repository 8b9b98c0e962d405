"""Context parallelism in data-parallel replicas (issue 26): `-dp 2 -cp 2`.
Each replica is a CP group of its own (world tp x pp x cp per replica), its
ranks placed like TP's: Ray actors in the replica's placement group, on one
node. Greedy outputs equal Hugging Face's on both replicas for prompts longer
than one rank's KV cache holds; a scale-in lets the leaving replica's
requests finish there (live migration does not move a sharded cache, and
declines); no actor or placement group is left."""

from __future__ import annotations

import pytest

from raylm import LLM
from raylm.config import create_engine_config
from raylm.executor.ray_placement import replica_bundles
from tests.conftest import our_live_ray_state
from tests.engine.test_context_parallel import GREEDY, _engine_kwargs, model, reference  # noqa: F401 (model, reference: fixtures)

SETTINGS = dict(data_parallel_size=2, context_parallel_size=2, distributed_executor_backend="ray")


def test_a_replica_reserves_a_bundle_per_rank_of_its_cp_group(model):  # noqa: F811
    """Two rank bundles beside the engine actor's, in one placement group per replica (STRICT_PACK)."""
    config = create_engine_config(model, num_threads=1, **SETTINGS)
    assert config.parallel_config.world_size == 2 and config.cache_config.num_kv_shards == 2
    bundles, _, rank_bundles = replica_bundles(config)
    assert bundles == [{"CPU": 0.01}, {"CPU": 1.0}, {"CPU": 1.0}] and rank_bundles == [1, 2]


def test_rebalancing_between_cp_replicas_is_refused(model):  # noqa: F811
    with pytest.raises(ValueError, match="context_parallel_size 2 cannot be combined yet with: data_parallel_rebal"):
        create_engine_config(model, data_parallel_rebalance=True, **SETTINGS)


def test_dp2_x_cp2_equals_hf_and_scales_in_without_migrating(ray_session, model, reference):  # noqa: F811
    prompts, ref = reference
    keys = ["long", "short", "one", "shared"]
    with LLM(model, **_engine_kwargs(model), **SETTINGS) as llm:
        engine, supervisor = llm.llm_engine, llm.llm_engine.engine_core
        # Every prompt on each replica: the long ones need both ranks' caches there.
        for replica in (0, 1):
            for k in keys:
                engine.add_request(
                    f"{k}-{replica}", {"prompt_token_ids": prompts[k]}, GREEDY, data_parallel_rank=replica
                )
        done, scaled = {}, False
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out.outputs[0].token_ids
            if not scaled and any(len(e.token_ids) >= 2 for r, e in supervisor.ledger.items() if r.endswith("-1")):
                llm.scale(1)  # replica 1 drains with its requests mid-decode
                scaled = True
        assert scaled
        assert done == {f"{k}-{replica}": ref[k] for k in keys for replica in (0, 1)}
        for _ in range(3):
            engine.step()  # lets the drained replica leave
        assert [r["state"] for r in supervisor.replica_states()] == ["serving"]
        assert supervisor.migration_counts == {"migrated": 0, "abandoned": 0}
    live_actors, live_pgs = our_live_ray_state()
    assert not live_actors, f"actors left: {[a['ActorClassName'] for a in live_actors]}"
    assert not live_pgs, "placement groups left"
