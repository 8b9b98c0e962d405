"""Prefill/decode roles (raylm.engine.handoff) without processes: the setting
and its bounds, the roles where an operator reads them (`/health`'s replica
states, `/metrics`, `raylm plan`), and the hand-off and its fallbacks on the
chaos harness's simulated engine (the real supervisor and engine cores on
the content model, tests/chaos), each stream equal to an undisturbed run:
short prompts kept on one replica (`--pd-min-prompt-tokens`), hand-offs
queued for decode room and the admission a full queue holds back
(`--pd-handoff-queue`), aborts mid-hand-off, and the two pools autoscaled
apart (raylm.engine.role_autoscaler). The end-to-end tests on real models
are test_pd_handoff.py (and, on Ray, test_data_parallel.py)."""

from __future__ import annotations

import pytest

from raylm.config import ParallelConfig, create_engine_config, replica_role
from raylm.engine.arg_utils import EngineArgs
from raylm.engine.handoff import OUTCOMES
from raylm.engine.protocol import HandoffStats
from raylm.entrypoints.cli import build_parser
from raylm.testing.chaos.sim import World, chaos_config

# ---- the setting --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"data_parallel_size": 1, "prefill_replicas": 1}, "prefill_replicas needs data_parallel_size >= 2"),
        ({"data_parallel_size": 2, "prefill_replicas": 2}, "prefill_replicas must be from 1 to data_parallel_size - 1"),
        ({"data_parallel_size": 3, "prefill_replicas": -1}, "prefill_replicas must be an integer >= 0"),
        ({"data_parallel_size": 3, "prefill_replicas": 1.5}, "prefill_replicas must be an integer >= 0"),
        (
            {"data_parallel_size": 2, "prefill_replicas": 1, "context_parallel_size": 2},
            "prefill_replicas cannot be combined with context_parallel_size",
        ),
        (
            {"data_parallel_size": 2, "prefill_replicas": 1, "data_parallel_rebalance": True},
            "prefill_replicas cannot be combined with data_parallel_rebalance",
        ),
    ],
)
def test_prefill_replicas_is_bounded_and_the_error_names_it(settings, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**settings)


def test_the_flag_reaches_the_config_and_roles_go_by_index(tiny_model_dir):
    model = tiny_model_dir("llama")
    args = build_parser().parse_args(["generate", "x", "--model", model, "-dp", "3", "--prefill-replicas", "1"])
    pc = EngineArgs.from_cli_args(args).create_engine_config().parallel_config
    assert pc.prefill_replicas == 1
    assert [pc.role_of(i) for i in range(4)] == ["prefill", "decode", "decode", "decode"]
    assert replica_role(0, 0) == "both"
    # LLM(...) takes the same keyword, checked the same way.
    with pytest.raises(ValueError, match="prefill_replicas"):
        create_engine_config(model, data_parallel_size=2, prefill_replicas=3)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"prefill_num_threads": 2}, "prefill_num_threads needs prefill_replicas"),
        ({"data_parallel_size": 2, "decode_num_threads": 2}, "decode_num_threads needs prefill_replicas"),
        ({"data_parallel_size": 2, "prefill_replicas": 1, "decode_num_threads": 0}, "decode_num_threads must be"),
        ({"data_parallel_size": 2, "prefill_replicas": 1, "prefill_num_threads": 1.5}, "prefill_num_threads must"),
    ],
)
def test_per_role_threads_are_checked_and_the_error_names_them(tiny_model_dir, settings, message):
    with pytest.raises(ValueError, match=message):
        create_engine_config(tiny_model_dir("llama"), **settings)


def test_each_role_starts_with_its_own_threads_and_the_same_layout(tiny_model_dir):
    args = build_parser().parse_args(
        ["generate", "x", "--model", tiny_model_dir("llama"), "-dp", "3", "--prefill-replicas", "1"]
        + ["--num-threads", "3", "--prefill-num-threads", "2"]
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    prefill, decode = config.for_role("prefill"), config.for_role("decode")
    assert (prefill.num_threads, decode.num_threads, config.for_role("both").num_threads) == (2, 3, 3)
    # Only the threads differ: the K/V transport moves requests between equal layouts.
    assert prefill.parallel_config is config.parallel_config and decode is config


# ---- where roles show ------------------------------------------------------------------------


def test_metrics_export_every_outcome_and_each_replica_role():
    from fastapi import FastAPI

    from raylm.entrypoints.openai.data_parallel_routes import install_data_parallel_routes
    from raylm.entrypoints.openai.metrics import PrometheusStatLogger

    class Engine:
        def replica_states(self):
            return [
                {"replica": i, "state": "serving", "num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
                | {"num_routed": 0, "role": role}
                for i, role in enumerate(("prefill", "decode"))
            ]

    stat_logger = PrometheusStatLogger("m")
    install_data_parallel_routes(FastAPI(), Engine(), None, stat_logger, "m")
    stat_logger.record_handoff(HandoffStats("ok", 0.02))
    stat_logger.record_handoff(HandoffStats("no_room"))
    text = stat_logger.render().decode()
    for outcome in OUTCOMES:
        value = 1.0 if outcome in ("ok", "no_room") else 0.0
        assert f'raylm:pd_handoffs_total{{engine="0",model_name="m",outcome="{outcome}"}} {value}' in text
    assert 'raylm:pd_handoff_seconds_count{engine="0",model_name="m"} 1.0' in text
    assert 'raylm:dp_replica_role{model_name="m",replica="0",role="prefill"} 1.0' in text
    assert 'raylm:dp_replica_role{model_name="m",replica="1",role="decode"} 1.0' in text


def test_plan_shows_each_replicas_role(tiny_model_dir):
    from raylm.entrypoints.plan_report import Plan, format_plan, rank_placement, replica_placement
    from raylm.executor.ray_cluster import NodeState

    pc = create_engine_config(tiny_model_dir("llama"), data_parallel_size=3, prefill_replicas=1).parallel_config
    node = NodeState("a" * 16, "10.0.0.1", {"CPU": 4}, {"CPU": 4}, True)
    replicas = [
        replica_placement(i, node.node_id, node.ip, [rank_placement(0, pc, node.node_id, node.ip, "cpu", 0)], pc)
        for i in range(3)
    ]
    assert [r.role for r in replicas] == ["prefill", "decode", "decode"]
    request = {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 3,
        "data_parallel_placement": "pack",
        "executor_backend": "uni",
        "device": "cpu",
        "replica_bundles": [{"CPU": 1}],
        "prefill_replicas": 1,
    }
    text = format_plan(Plan(True, None, node.node_id, [node], request, replicas))
    assert "Roles (--prefill-replicas 1): replica(s) 0 prefill, 1,2 decode" in text
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])]
    assert [row[:2] for row in rows] == [["0", "prefill"], ["1", "decode"], ["2", "decode"]], text


# ---- the hand-off and its fallbacks, on the simulated engine ----------------------------------


# Every prompt handed off (the threshold is tested on its own below).
PD = dict(prefill_replicas=1, data_parallel_rebalance=False, pd_min_prompt_tokens=0)


@pytest.fixture
def world():
    world = World(chaos_config(**PD))
    yield world
    world.close()


PROMPTS = [[500 + i, 501, 502, 503, 504, 505, 506] for i in range(4)]


def _submit_all(world: World, max_tokens: int = 12) -> None:
    for i, prompt in enumerate(PROMPTS):
        world.submit(f"r{i}", prompt, max_tokens)


def _until_first_tokens(world: World) -> None:
    """Rounds until every request has its first token (and its hand-off started)."""
    for _ in range(20):
        if all(o.tokens for o in world.outcomes.values()):
            return
        for index in list(world.cores):
            world.turn(index)
        world.read()
    raise AssertionError("no first token")


def _finish(world: World) -> dict[str, int]:
    for _ in range(10):  # rounds with the faults armed (drain clears them)
        for index in list(world.cores):
            world.turn(index)
        world.read()
    world.drain()
    world.check()  # every stream equals an undisturbed run; nothing left anywhere
    return dict(world.sup.handoffs.counts)


def test_requests_prefill_on_the_prefill_replica_and_decode_on_the_other(world):
    _submit_all(world)
    world.submit("one", [600, 601, 602], 1)  # its first token is its last
    _until_first_tokens(world)
    assert {e.channel for e in world.sup.ledger.values()} == {0}  # routed to the prefill replica
    assert all(m.reason == "pd_handoff" and m.stage == 0 for m in world.sup.migrations.values())
    counts = _finish(world)
    assert counts == {"ok": len(PROMPTS), "finished_on_prefill": 1}, counts
    assert world.cores[1].core.scheduler.kv_cache_manager.pool.cached  # the decode replica held their K/V


def test_a_failed_transfer_leaves_the_request_on_the_prefill_replica(world):
    world.cores[1].core.transfer_faults.append("final")  # its next import fails
    _submit_all(world)
    counts = _finish(world)
    assert counts["failed"] == 1 and counts["ok"] == len(PROMPTS) - 1, counts


def test_with_no_decode_replica_the_prefill_replica_decodes(world):
    world.kill(1)
    world.read()  # the death is seen: replica 1 is being replaced
    _submit_all(world)
    _until_first_tokens(world)
    counts = _finish(world)
    assert counts["no_decode"] == len(PROMPTS), counts


def test_with_no_prefill_replica_the_decode_replica_prefills(world):
    world.kill(0)
    world.read()
    _submit_all(world)
    counts = _finish(world)
    assert counts["prefill_on_decode"] == len(PROMPTS), counts


def test_a_decode_replica_killed_mid_hand_off_costs_no_request(world):
    _submit_all(world)
    _until_first_tokens(world)
    # The hand-offs' final stages are on their way: the destination dies.
    world.kill(1)
    counts = _finish(world)
    assert counts["destination_gone"] >= 1, counts


def test_imports_failing_because_their_prefill_replica_died_leave_the_decode_replica_able(world):
    """Hand-offs handed over, then their source dies: the destination's reads
    of the final stages fail (over the network they would wait for the dead
    source). Those failures are the source's, not the decode replica's K/V
    path: it stays a destination (kv_routes marks a core unable after three)."""
    _submit_all(world)
    for _ in range(10):
        world.turn(0)
        world.read()
        handoffs = list(world.sup.migrations.values())
        if handoffs and all(m.handed_over for m in handoffs):
            break
    assert len(handoffs) == len(PROMPTS) and all(m.handed_over for m in handoffs)
    world.kill(0)
    world.read()  # replica 0 leaves; the hand-offs handed over go on at replica 1
    world.cores[1].core.transfer_faults.extend(["final"] * len(PROMPTS))
    world.turn(1)
    world.read()
    assert not world.sup.kv_routes.cannot_move_kv(world.sup.channels[1])
    counts = _finish(world)
    assert counts["source_gone"] == len(PROMPTS), counts


def test_a_decode_replica_restarting_drains_to_the_other_decode_replica():
    """Replicas 1 and 2 decode: the requests of 1, restarted, move to 2,
    not to the prefill replica (which would only hand them back)."""
    world = World(chaos_config(**PD, data_parallel_size=3))
    try:
        _submit_all(world, max_tokens=30)
        _until_first_tokens(world)
        for _ in range(6):  # the hand-offs end
            for index in list(world.cores):
                world.turn(index)
            world.read()
        on_1 = set(world.sup.channels[1].in_flight)
        assert on_1 and not world.sup.migrations
        assert world.sup.begin_restart(1) == len(on_1)
        assert {m.destination for m in world.sup.migrations.values()} == {2}
        _finish(world)
    finally:
        world.close()


# ---- conditional disaggregation: short prompts stay on one replica ---------------------------


def test_the_threshold_defaults_to_at_most_a_quarter_of_the_context(tiny_model_dir):
    from raylm.engine.handoff import PD_MIN_PROMPT_TOKENS, min_prompt_tokens

    # The embedded default model (512 positions): 128, so its longer prompts still hand off.
    assert min_prompt_tokens(create_engine_config(None, data_parallel_size=2, prefill_replicas=1)) == 128
    assert min_prompt_tokens(chaos_config(**PD | {"pd_min_prompt_tokens": None})) == 64 // 4
    long_context = create_engine_config(tiny_model_dir("llama"), data_parallel_size=2, prefill_replicas=1)
    assert min_prompt_tokens(long_context) == min(PD_MIN_PROMPT_TOKENS, long_context.model_config.max_model_len // 4)
    args = build_parser().parse_args(
        ["generate", "x", "-dp", "2", "--prefill-replicas", "1", "--pd-min-prompt-tokens", "5"]
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert min_prompt_tokens(config) == 5 and config.parallel_config.pd_handoff_queue == 8
    for name, value in (("pd_min_prompt_tokens", -1), ("pd_handoff_queue", -1), ("pd_handoff_queue", True)):
        with pytest.raises(ValueError, match=f"{name} must be an integer >= 0"):
            ParallelConfig(data_parallel_size=2, prefill_replicas=1, **{name: value})


def test_a_short_prompt_is_prefilled_and_decoded_on_a_decode_replica():
    world = World(chaos_config(**PD | {"pd_min_prompt_tokens": 8}))
    try:
        world.submit("short", [500, 501, 502], 12)
        world.submit("long", [600 + j for j in range(13)], 12)
        assert world.sup.ledger["short"].channel == 1 and world.sup.ledger["long"].channel == 0
        _until_first_tokens(world)
        assert [m.request_id for m in world.sup.migrations.values()] == ["long"]  # the short one never moves
        counts = _finish(world)
        assert counts == {"short_prompt": 1, "ok": 1}, counts
    finally:
        world.close()


# ---- finished prefills waiting for decode room --------------------------------------------


def _fill_decode_replica(world: World) -> None:
    """A long request pinned to decode replica 1, holding 13 to 16 of its 16
    blocks (block_size 4) to its end: a hand-off's 4 do not fit."""
    world.submit("filler", [900 + j for j in range(48)], 14, rank=1)
    for _ in range(4):
        world.turn(1)
        world.read()
    kv = world.cores[1].core.scheduler.kv_cache_manager
    assert kv.pool.num_free_blocks < 4, kv.pool.num_free_blocks


def test_a_hand_off_finding_no_room_waits_in_the_queue_and_moves_once_there_is():
    world = World(chaos_config(**PD | {"pd_handoff_queue": 1}), num_blocks=16)
    try:
        _fill_decode_replica(world)
        world.submit("a", [600 + j for j in range(13)], 20)
        _until_first_tokens(world)
        for _ in range(3):  # the hand-off's final stage is refused: no room
            world.turn(0)
            world.turn(1)
            world.read()
        assert "a" in world.sup.handoffs.queue and world.sup.handoffs.counts["queued"] == 1
        assert world.sup.replica_states()[0]["pd_handoffs_queued"] == 1
        # The queue (of one) is full: prefill replica 0 takes no new prompt,
        # which waits in the ledger (counted held) until the queue drains.
        world.submit("b", [700 + j for j in range(6)], 8)
        assert world.sup.ledger["b"].channel == -1 and world.sup.handoffs.counts["held"] == 1
        counts = _finish(world)  # the filler ends, "a" moves (or decodes where it is), "b" is admitted
        assert counts["queued"] >= 1 and counts["held"] == 1, counts
        # Once the filler ended, "a" moved on a retry; then "b" was admitted and moved too.
        assert counts["ok"] == 2 and "no_room" not in counts, counts
    finally:
        world.close()


def test_a_client_abort_mid_hand_off_frees_both_ends_blocks(world):
    """Aborted while its final stage is on its way (the source paused it, the
    destination took its blocks): every block of both replicas is free
    again, and the prefix cache holds only what its hash names."""
    world.submit("a", [600 + j for j in range(13)], 20)
    for _ in range(10):
        world.turn(0)
        world.read()
        handoffs = list(world.sup.migrations.values())
        if handoffs and handoffs[0].handed_over:
            break
    assert handoffs and handoffs[0].handed_over
    world.turn(1)  # the destination imports (its blocks taken)
    world.abort("a")
    counts = _finish(world)  # check(): each core's free blocks are all its blocks
    assert set(counts) <= {"ok", "ended"}, counts
    for index in (0, 1):
        kv = world.cores[index].core.scheduler.kv_cache_manager
        assert kv.pool.num_free_blocks == kv.num_blocks


# ---- the prefill and decode pools scale independently (--autoscale) ---------------------


def _states(prefill: list[dict], decode: list[dict]) -> list[dict]:
    base = {"state": "serving", "in_flight": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
    roles = [("prefill", s) for s in prefill] + [("decode", s) for s in decode]
    return [base | {"replica": i, "role": role} | s for i, (role, s) in enumerate(roles)]


def test_each_pool_scales_with_its_own_load():
    from raylm.config import AutoscaleConfig
    from raylm.engine.role_autoscaler import RoleAutoscalePolicy, scale_steps

    config = AutoscaleConfig(2, 5, target_ongoing_requests=2, upscale_delay_s=1, downscale_delay_s=5)

    def decide(states, seconds):
        policy = RoleAutoscalePolicy(config)
        assert policy.decide(states, 0.0) is None  # (each direction waits for its delay)
        return policy.decide(states, seconds)

    # Prompts queue on the prefill replica, the decode replica idles: the prefill pool grows alone.
    grown = decide(_states([{"in_flight": 3, "num_waiting": 2}], [{"in_flight": 1}]), 1.0)
    assert (grown.num_replicas, grown.prefill_replicas, grown.direction) == (3, 2, "up"), grown
    # New requests held back (every prefill replica's hand-off queue full) are the prefill pool's
    # load though no replica counts them: it grows; without them it would not.
    held = _states([{"in_flight": 1, "pd_held": 2}], [{"in_flight": 1}])
    grown = decide(held, 1.0)
    assert (grown.num_replicas, grown.prefill_replicas, grown.direction) == (3, 2, "up"), grown
    assert held[0]["in_flight"] == 1, "the states given are not changed"
    assert decide(_states([{"in_flight": 1}], [{"in_flight": 1}]), 1.0) is None
    # Streams pile up on the decode replica: the decode pool grows alone.
    grown = decide(_states([{"in_flight": 1}], [{"in_flight": 7}]), 1.0)
    assert (grown.num_replicas, grown.prefill_replicas) == (5, 1), grown
    # Two idle prefill replicas, two busy decode ones: the prefill pool shrinks, the decode pool stays.
    shrunk = decide(_states([{}, {}], [{"in_flight": 2}, {"in_flight": 2}]), 5.0)
    assert (shrunk.num_replicas, shrunk.prefill_replicas, shrunk.direction) == (3, 1, "down"), shrunk
    # At MAX the decode pool gives way; never below one replica of each role.
    capped = decide(_states([{"in_flight": 9, "num_waiting": 1}], [{"in_flight": 9, "num_waiting": 1}] * 3), 1.0)
    assert (capped.num_replicas, capped.prefill_replicas) == (5, 2), capped
    assert decide(_states([{}], [{}]), 5.0) is None  # MIN 2: nothing to shed
    # A larger prefill pool is set after the scale, a smaller one before it.
    assert scale_steps(1, 2) == ("scale", "roles") and scale_steps(2, 1) == ("roles", "scale")
    # --autoscale 2:2 (what two Serve configs of max_replicas 1 add up to): both pools held at one.
    config = AutoscaleConfig(2, 2, upscale_delay_s=1)
    assert decide(_states([{"in_flight": 9, "num_waiting": 1}], [{"in_flight": 9}]), 1.0) is None


def test_each_pool_stays_within_its_own_bounds():
    from raylm.config import AutoscaleConfig
    from raylm.engine.role_autoscaler import RoleAutoscalePolicy

    def decide(config, states):
        policy = RoleAutoscalePolicy(config)
        assert policy.decide(states, 0.0) is None
        return policy.decide(states, 5.0)

    tuning = dict(target_ongoing_requests=2, upscale_delay_s=1, downscale_delay_s=5)
    # Prompts pile up: the prefill pool grows to its own MAX (2), not to what its load asks.
    config = AutoscaleConfig(2, 6, **tuning, prefill_range=(1, 2), decode_range=(1, 4))
    grown = decide(config, _states([{"in_flight": 20, "num_waiting": 5}], [{"in_flight": 1}]))
    assert (grown.num_replicas, grown.prefill_replicas) == (3, 2), grown
    # Idle decode replicas shrink to the decode pool's MIN (2), not to one.
    config = AutoscaleConfig(2, 6, **tuning, decode_range=(2, 4))
    shrunk = decide(config, _states([{"in_flight": 1}], [{}, {}, {}]))
    assert (shrunk.num_replicas, shrunk.prefill_replicas) == (3, 1), shrunk


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"autoscale_prefill": "1:2"}, "autoscale_prefill needs autoscale"),
        ({"autoscale": "2:4", "autoscale_decode": "1:2"}, "autoscale_decode needs prefill_replicas"),
        ({"autoscale": "2:4", "prefill_replicas": 1, "autoscale_prefill": "2:3"}, "prefill pool starts with 1"),
        ({"autoscale": "2:4", "prefill_replicas": 1, "autoscale_prefill": "1:4"}, "autoscale_prefill: need 1 <="),
        ({"autoscale": "2:4", "prefill_replicas": 1, "autoscale_decode": "x"}, "autoscale_decode must be MIN:MAX"),
    ],
)
def test_pool_bounds_are_checked_and_the_error_names_them(tiny_model_dir, settings, message):
    with pytest.raises(ValueError, match=message):
        create_engine_config(tiny_model_dir("llama"), data_parallel_size=2, **settings)


def test_a_prefill_pool_scaled_out_and_in_on_the_simulated_engine():
    """The decisions applied as AsyncLLM.scale_roles does, on the real
    supervisor: 1+1 -> 2+1 (a replica added, the boundary moved: replica 1
    turns prefill and hands off what it decoded) -> 1+1 (replica 1 turns
    decode, then the highest leaves), with requests running throughout."""
    world = World(chaos_config(**PD))
    try:
        _submit_all(world, max_tokens=30)
        _until_first_tokens(world)
        world.apply_roles(3, 2)
        assert world.sup.handoffs.prefill_replicas == 1  # not before the new replica serves
        assert world.finish_scale()
        world.read()
        assert [(s["role"], s["state"]) for s in world.sup.replica_states()] == [
            ("prefill", "serving"),
            ("prefill", "serving"),
            ("decode", "serving"),
        ]
        for i, prompt in enumerate(PROMPTS):
            world.submit(f"second{i}", [p + 50 for p in prompt], 12)
        routed = {world.sup.ledger[f"second{i}"].channel for i in range(len(PROMPTS))}
        assert routed <= {0, 1}, routed  # the prefill pool (by load: replica 0 may still be busier)
        for _ in range(4):
            for index in list(world.cores):
                world.turn(index)
            world.read()
        world.apply_roles(2, 1)  # the prefill pool shrinks: replica 1 decodes again, replica 2 drains
        assert world.sup.handoffs.prefill_replicas == 1
        counts = _finish(world)  # every stream equal to an undisturbed run, nothing left
        assert counts["ok"] >= len(PROMPTS), counts
        assert [s["role"] for s in world.sup.replica_states()] == ["prefill", "decode"]
    finally:
        world.close()


def test_aborting_a_queued_hand_off_and_a_held_request_leaves_nothing():
    """A finished prefill waiting for decode room and a request held back
    by the full queue, both aborted by their clients: the queue is empty, the
    prefill replica admits again, every block of both replicas is free."""
    world = World(chaos_config(**PD | {"pd_handoff_queue": 1}), num_blocks=16)
    try:
        _fill_decode_replica(world)
        world.submit("a", [600 + j for j in range(13)], 20)
        _until_first_tokens(world)
        for _ in range(3):
            world.turn(0)
            world.turn(1)
            world.read()
        world.submit("b", [700 + j for j in range(6)], 8)
        assert "a" in world.sup.handoffs.queue and world.sup.ledger["b"].channel == -1
        world.abort("a")
        world.abort("b")
        assert not world.sup.handoffs.queue and world.sup.handoffs.queued_on(0) == 0
        world.submit("c", [710 + j for j in range(6)], 4)
        assert world.sup.ledger["c"].channel == 0  # admitted at once
        _finish(world)  # check(): nothing kept, every block free
    finally:
        world.close()
