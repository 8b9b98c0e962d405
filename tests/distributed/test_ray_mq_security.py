"""The Ray executor's `mq` transport with every rank "on another node" (ZMQ
over TCP both ways): one CURVE keypair per executor, handed to the actors
through Ray; a collective_rpc callable travels through Ray and the queue only
names it; a worker's exception comes back as a typed record."""

from __future__ import annotations

import pytest

from raylm import LLM, SamplingParams
from raylm.distributed.rpc_messages import CallableRef, RpcRequest
from raylm.distributed.tcp_auth import UNAUTHENTICATED_TCP_ENV
from raylm.executor.mq_rpc import WorkerCallError
from raylm.executor.ray_executor import RayDistributedExecutor
from tests.conftest import executor_of, our_live_ray_state
from tests.executor.worker_callables import fail_on_rank_1, rank_times

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def remote_tp2(tiny_model_dir):
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(UNAUTHENTICATED_TCP_ENV, raising=False)
        # The driver "is on a node of its own": both ranks read the broadcast
        # over TCP and answer over TCP.
        mp.setattr(RayDistributedExecutor, "_driver_node_id", lambda self: "a-node-with-no-workers")
        llm = LLM(
            tiny_model_dir("llama", num_key_value_heads=2),
            dtype="float32",
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            ray_step_transport="mq",
            num_threads=1,
            kv_cache_memory_bytes=32 << 20,
        )
    yield llm
    llm.shutdown()
    assert our_live_ray_state() == ([], [])


def test_one_curve_keypair_per_executor_on_every_tcp_socket(remote_tp2):
    mq = executor_of(remote_tp2).transport.queues
    broadcast_keys = mq.broadcast.export_handle().tcp_keys
    assert broadcast_keys is not None and mq.broadcast._curve_server is not None
    assert [r._handle.tcp_keys for r in mq.responses] == [broadcast_keys] * 2
    assert all(r._handle.remote_address for r in mq.responses)


def test_a_callable_travels_through_ray_and_the_queue_only_names_it(remote_tp2, monkeypatch):
    ex = executor_of(remote_tp2)
    sent = []
    enqueue = ex.transport.queues.broadcast.enqueue
    monkeypatch.setattr(
        ex.transport.queues.broadcast, "enqueue", lambda obj, timeout=None: (sent.append(obj), enqueue(obj, timeout))[1]
    )
    assert ex.collective_rpc(rank_times, args=(10,), kwargs={"offset": 1}) == [1, 11]
    assert ex.collective_rpc(rank_times, args=(10,), unique_reply_rank=1) == 10
    assert ex.collective_rpc("check_health") == ex.worker_pids
    requests = [r for r in sent if isinstance(r, RpcRequest)]
    assert len(requests) == 3
    assert [type(r.method) for r in requests] == [CallableRef, CallableRef, str]
    assert requests[0].method.name == "rank_times" and requests[0].method.token != requests[1].method.token


def test_a_worker_exception_comes_back_as_a_typed_record(remote_tp2):
    ex = executor_of(remote_tp2)
    with pytest.raises(WorkerCallError, match="rank 1") as err:
        ex.collective_rpc(fail_on_rank_1)
    remote = err.value.remote
    assert (remote.type_name, remote.message, remote.rank, remote.method) == (
        "ValueError",
        "rank one says no",
        1,
        "fail_on_rank_1",
    )
    assert 'raise ValueError("rank one says no")' in remote.traceback
    out = remote_tp2.generate(
        "still alive", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4
