"""The shared-memory TP collective against gloo and a hand-computed sum: bitwise
equal results on every rank for fp32 and bf16, many shapes and many back-to-back
calls (slot reuse), the gloo fallback for large tensors, agreement on gloo when
one rank opts out, nothing left in /dev/shm, and a killed peer making the others
raise at the deadline instead of hanging."""

from __future__ import annotations

import os
import random
import signal
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from raylm.distributed import parallel_state
from raylm.distributed.shm_collective import DISABLE_ENV, SEGMENT_PREFIX
from tests.child_processes import preloaded_spawn_context

pytestmark = pytest.mark.slow  # process groups of 2 and 4 ranks on two cores

JOIN_TIMEOUT_S = 180
# Long enough for a loaded 2-core machine to bring up every process.
GROUP_TIMEOUT_S = 120
SHAPES = [(1,), (7,), (1, 64), (3, 96), (16, 1024), (2, 3, 5), (513,), (128, 130)]
DTYPES = [torch.float32, torch.bfloat16]


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(SEGMENT_PREFIX)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _input(rank: int, call: int, shape, dtype, integers: bool = False) -> torch.Tensor:
    """Rank `rank`'s input to call `call`: any rank can rebuild any other's."""
    g = torch.Generator().manual_seed(1000 * call + rank)
    if integers:
        # Small integers: every partial sum is exact, so any summation order
        # (gloo's ring included) gives the same bits.
        return torch.randint(-64, 64, shape, generator=g).to(dtype)
    return (torch.randn(shape, generator=g) * (1 + rank)).to(dtype)


def _rank_order_sum(world: int, call: int, shape, dtype) -> torch.Tensor:
    """The hand-computed oracle: fp32 sum in rank order, cast once."""
    total = _input(0, call, shape, dtype).float()
    for r in range(1, world):
        total += _input(r, call, shape, dtype).float()
    return total.to(dtype)


# ---- process harness ---------------------------------------------------------------


def _entry(target, rank: int, world: int, port: int, out_dir: str, args: tuple, env: dict) -> None:
    torch.set_num_threads(1)
    os.environ.update(env)
    try:
        parallel_state.init_distributed_environment(
            world, rank, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=GROUP_TIMEOUT_S
        )
        parallel_state.initialize_model_parallel(tp_size=world)
        result = target(rank, world, out_dir, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        parallel_state.destroy_model_parallel()


def _spawn(target, world: int, out_dir: str, args: tuple = (), on_started=None, rank_env=None) -> list:
    """Run `target(rank, world, out_dir, *args)` in `world` spawned gloo ranks (rank
    r with the extra environment rank_env[r]); the list of their return values,
    or exit codes for ranks that returned none. Every process is gone after."""
    context = preloaded_spawn_context()
    port = _free_port()
    rank_env = rank_env or {}
    procs = [
        context.Process(target=_entry, args=(target, r, world, port, out_dir, args, rank_env.get(r, {})), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        if on_started is not None:
            on_started(procs)
        for p in procs:
            p.join(JOIN_TIMEOUT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    assert not any(p.is_alive() for p in procs)
    errors = [open(os.path.join(out_dir, f)).read() for f in sorted(os.listdir(out_dir)) if f.endswith(".err")]
    assert not errors, "\n".join(errors)
    results = []
    for r, p in enumerate(procs):
        path = os.path.join(out_dir, f"rank{r}.pt")
        results.append(torch.load(path) if os.path.exists(path) else p.exitcode)
    return results


@pytest.fixture
def out_dir(tmp_path):
    before = _segments()
    yield str(tmp_path)
    assert _segments() == before, "a shared-memory collective segment was left in /dev/shm"


# ---- equality with gloo and the oracle -------------------------------------------


def _compare_with_gloo(rank: int, world: int, out_dir: str, rounds: int) -> list:
    tp = parallel_state.get_tp_group()
    assert tp.shm is not None, "ranks on one node must get the shared-memory collective"
    # The creator (rank 0) unlinked its segment once every rank had mapped it.
    if rank == 0:
        assert not {n for n in _segments() if n.startswith(f"{SEGMENT_PREFIX}{os.getpid()}_")}
    mismatches, digests = [], []
    call = 0
    for _ in range(rounds):
        for shape in SHAPES:
            for dtype in DTYPES:
                call += 1
                for integers in (False, True):
                    x = _input(rank, call, shape, dtype, integers)
                    ours = tp.all_reduce(x.clone())
                    theirs = x.clone()
                    dist.all_reduce(theirs, group=tp.group)
                    if not integers and not torch.equal(ours, _rank_order_sum(world, call, shape, dtype)):
                        mismatches.append(("all_reduce vs rank-order sum", shape, dtype))
                    # gloo reduces in an order of its own: two operands commute,
                    # and exact sums are order-free; otherwise only close.
                    order_free = world == 2 or integers
                    if order_free and not torch.equal(ours, theirs):
                        mismatches.append(("all_reduce vs gloo", shape, dtype, integers))
                    atol = 1e-4 if dtype == torch.float32 else 0.5  # a few ulps of the partial sums
                    if not order_free and not torch.allclose(ours.float(), theirs.float(), rtol=1e-2, atol=atol):
                        mismatches.append(("all_reduce far from gloo", shape, dtype))
                    digests.append(ours)
                for dim in range(-1, len(shape)):
                    gathered = tp.all_gather(x, dim=dim)
                    parts = [torch.empty_like(x) for _ in range(world)]
                    dist.all_gather(parts, x, group=tp.group)
                    if not torch.equal(gathered, torch.cat(parts, dim=dim)):
                        mismatches.append(("all_gather", shape, dtype, dim))
            # A rank that falls behind now and then: the others run ahead into
            # the next call and must not overwrite what it still reads.
            if rank == call % world:
                time.sleep(0.002)
    return [mismatches, torch.cat([d.float().flatten() for d in digests])]


@pytest.mark.parametrize("world", [2, 4])
def test_results_equal_gloo_and_the_rank_order_sum_bitwise(world, out_dir):
    results = _spawn(_compare_with_gloo, world, out_dir, (3,))
    for mismatches, _ in results:
        assert mismatches == []
    # Every rank holds exactly the same bits.
    for _, digest in results[1:]:
        assert torch.equal(digest, results[0][1])


def _many_back_to_back_calls(rank: int, world: int, out_dir: str, calls: int) -> list:
    tp = parallel_state.get_tp_group()
    rng = random.Random(rank)
    wrong = []
    for call in range(1, calls + 1):
        # Shapes change every call, so a stale slot would show as wrong values.
        shape = (1 + call % 5, 64 + 32 * (call % 3))
        x = _input(rank, call, shape, torch.float32)
        if not torch.equal(tp.all_reduce(x.clone()), _rank_order_sum(world, call, shape, torch.float32)):
            wrong.append(("all_reduce", call))
        gathered = tp.all_gather(x, dim=0)
        expected = torch.cat([_input(r, call, shape, torch.float32) for r in range(world)], dim=0)
        if not torch.equal(gathered, expected):
            wrong.append(("all_gather", call))
        if rng.random() < 0.05:
            time.sleep(rng.random() * 1e-3)
    return wrong


@pytest.mark.parametrize("world", [2, 4])
def test_many_back_to_back_calls_never_read_a_reused_slot(world, out_dir):
    assert _spawn(_many_back_to_back_calls, world, out_dir, (1500,)) == [[]] * world


def _large_tensors_fall_back_to_gloo(rank: int, world: int, out_dir: str) -> list:
    tp = parallel_state.get_tp_group()
    big_shape = (tp.shm.slot_bytes // 4 + 1,)  # one fp32 element past a slot
    small_shape = (4, 8)
    wrong = []
    for call, shape in enumerate([small_shape, big_shape, small_shape, big_shape, small_shape], start=1):
        x = _input(rank, call, shape, torch.float32)
        if tp.shm.can_carry(x) != (shape == small_shape):
            wrong.append(("path", shape))
        if not torch.equal(tp.all_reduce(x.clone()), _rank_order_sum(world, call, shape, torch.float32)):
            wrong.append(("all_reduce", shape))
        expected = torch.cat([_input(r, call, shape, torch.float32) for r in range(world)])
        if not torch.equal(tp.all_gather(x, dim=0), expected):
            wrong.append(("all_gather", shape))
    return wrong


def test_tensors_larger_than_a_slot_go_through_gloo(out_dir):
    assert _spawn(_large_tensors_fall_back_to_gloo, 2, out_dir) == [[], []]


def _which_path(rank: int, world: int, out_dir: str) -> list:
    tp = parallel_state.get_tp_group()
    x = _input(rank, 1, (5, 6), torch.float32)
    return [tp.shm is None, torch.equal(tp.all_reduce(x.clone()), _rank_order_sum(world, 1, (5, 6), torch.float32))]


def test_one_rank_opting_out_puts_the_whole_group_on_gloo(out_dir):
    # Both ranks must take the same path, or each would wait for the other
    # on a different transport.
    assert _spawn(_which_path, 2, out_dir, rank_env={1: {DISABLE_ENV: "1"}}) == [[True, True]] * 2


# ---- a peer that dies --------------------------------------------------------------

DEADLINE_S = 3.0
WORLD_WITH_VICTIM = 3
VICTIM = 1


def _survive_a_killed_peer(rank: int, world: int, out_dir: str) -> list:
    tp = parallel_state.get_tp_group()
    for call in range(1, 6):
        tp.all_reduce(_input(rank, call, (8, 8), torch.float32))
    if rank == VICTIM:
        # Publishes call 6 and waits for the others, which hold back until it
        # has been killed: it dies in the middle of this collective.
        tp.all_reduce(_input(rank, 6, (8, 8), torch.float32))
        raise AssertionError("the victim should have been killed inside the collective")
    if rank == 0:
        # The victim's counter says it is inside call 6 (a peek at internals).
        while tp.shm._counters[VICTIM] < 6:
            time.sleep(0.001)
        open(os.path.join(out_dir, "victim_inside"), "w").close()
    while not os.path.exists(os.path.join(out_dir, "victim_killed")):
        time.sleep(0.01)
    # Short from here on: the group's own timeout allows for a slow start.
    tp.shm.timeout_s = DEADLINE_S
    errors = []
    for call in range(6, 9):
        try:
            tp.all_reduce(_input(rank, call, (8, 8), torch.float32))
        except TimeoutError as e:
            errors.append(("timeout", call, str(e)))
            break
    try:
        tp.all_gather(torch.ones(3))
    except RuntimeError as e:
        errors.append(("later", str(e)))
    return errors


def test_killed_peer_makes_the_others_raise_at_the_deadline(out_dir):
    def kill_victim(procs):
        marker = os.path.join(out_dir, "victim_inside")
        give_up = time.monotonic() + JOIN_TIMEOUT_S
        while not os.path.exists(marker) and time.monotonic() < give_up:
            time.sleep(0.01)
        os.kill(procs[VICTIM].pid, signal.SIGKILL)
        procs[VICTIM].join(10)
        open(os.path.join(out_dir, "victim_killed"), "w").close()

    results = _spawn(_survive_a_killed_peer, WORLD_WITH_VICTIM, out_dir, on_started=kill_victim)
    assert results[VICTIM] == -signal.SIGKILL
    for rank in (0, 2):
        timeout, later = results[rank]
        assert timeout[0] == "timeout" and f"rank(s) [{VICTIM}]" in timeout[2], timeout
        # The victim had published its call 6, so the survivors finish call 6
        # and time out on call 7, the first one it never reached.
        assert timeout[1] == 7
        assert later[0] == "later" and "unusable" in later[1]


# ---- in the engine -----------------------------------------------------------------


def test_tp2_engine_with_the_collective_disabled_uses_gloo_and_matches_hf(tiny_model_dir, monkeypatch):
    """The engine on the default, shared memory, is
    tests/executor/test_multiproc_executor.py::test_tp2_matches_hf (same
    model, prompts and check)."""
    from raylm import LLM, SamplingParams
    from raylm.testing.hf_oracle import hf_greedy
    from tests.conftest import executor_of

    before = _segments()
    monkeypatch.setenv(DISABLE_ENV, "1")  # mp workers inherit the environment
    model = tiny_model_dir("llama", num_key_value_heads=2)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 70)), [3]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def transport(worker):
        from raylm.distributed import parallel_state

        return "gloo" if parallel_state.get_tp_group().shm is None else "shm"

    with LLM(
        model,
        dtype="float32",
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        num_threads=1,
        kv_cache_memory_bytes=16 << 20,
    ) as llm:
        transports = executor_of(llm).collective_rpc(transport, timeout=60)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert transports == ["gloo"] * 2
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in hf_greedy(model, prompts, 12)]
    assert _segments() == before
