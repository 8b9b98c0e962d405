"""The `mq` step transport of the Ray executor: every call (steps and
collective_rpc alike) is broadcast on a MessageQueue (shared memory for the
ranks on the driver's node, ZMQ for the others) to a loop thread in each
actor, which replies on its own response queue: the same code as the
multiprocess executor (raylm.executor.mq_rpc), so `mp` and `ray` share it.
PP tensors move on torch.distributed. A collective_rpc callable travels
through Ray (see register_callable), never on the queue; sockets to other
nodes use CURVE."""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable

from raylm.distributed.rpc_messages import CallableRef
from raylm.distributed.shm_broadcast import MessageQueue
from raylm.distributed.shm_ring import unlink_segment
from raylm.distributed.tcp_auth import CurveKeys, tcp_auth_enabled
from raylm.executor.errors import WorkerDiedError, WorkerHungError
from raylm.executor.mq_rpc import MqRpcClient, method_name
from raylm.executor.ray_transport import RankActors, StepTransport
from raylm.messages import GrammarOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# How long registering a callable on the actors may take (without a deadline
# of the call's own), and how long shutdown lets the actors' loops close
# their queues before killing them. Start-up calls have the engine's start
# timeout (Executor.start_timeout_s).
_MQ_SETUP_TIMEOUT_S = 120.0
_MQ_LOOP_EXIT_TIMEOUT_S = 5.0

# Tokens of callables registered on the actors (see register_callable).
_CALLABLE_TOKENS = itertools.count()


class MqQueues:
    """The queues of the `mq` transport, and their release: apart from the
    transport so that the executor's weakref.finalize can hold them."""

    def __init__(self) -> None:
        self.broadcast: MessageQueue | None = None
        self.responses: list[MessageQueue] = []
        self.response_segments: list[str] = []
        self.shutting_down = threading.Event()

    def stop(self, workers: list, wait_for_loops: bool) -> None:
        """Closing the broadcast queue lets each actor's loop shut its worker
        down and unlink its own segment; wait for that unless told not to."""
        self.shutting_down.set()
        if self.broadcast is not None:
            self.broadcast.close()  # every actor's loop sees it and closes its own queues
        if workers and wait_for_loops:
            _wait_for_mq_loops(workers)

    def after_kill(self) -> None:
        pass

    def release(self) -> None:
        for queue in self.responses:
            queue.close()
        # An actor that was killed could not unlink its response segment; it
        # is in that actor's resource tracker, not ours, hence no unregister.
        for name in self.response_segments:
            unlink_segment(name, unregister=False)


class MqStepTransport(StepTransport):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.queues = MqQueues()
        self.rpc: MqRpcClient | None = None
        self._workers: list = []

    def start(
        self,
        ranks: RankActors,
        startup_get: Callable[[list, str], list],
        start_timeout_s: float,
        driver_node_id: str,
        on_failure: Callable[[str], None],
    ) -> None:
        """A broadcast queue read over shared memory by the ranks on the
        driver's node and over ZMQ by the others; one response queue per
        rank, created by its actor."""
        import ray

        self._workers = ranks.workers
        local_ranks = [rank for rank, node in enumerate(ranks.node_ids) if node == driver_node_id]
        num_remote = len(ranks.workers) - len(local_ranks)
        host_ip = ray.util.get_node_ip_address() if num_remote else "127.0.0.1"
        # One CURVE keypair for every TCP socket of this executor, handed to
        # the actors through Ray (raylm.distributed.tcp_auth).
        tcp_keys = CurveKeys.generate() if num_remote and tcp_auth_enabled() else None
        mq = self.queues
        mq.broadcast = MessageQueue(
            num_local_readers=len(local_ranks),
            num_remote_readers=num_remote,
            host_ip=host_ip,
            local_reader_ranks=local_ranks,
            tcp_keys=tcp_keys,
            authenticate_tcp=tcp_keys is not None,
        )
        handle = mq.broadcast.export_handle()
        refs = [
            worker.init_mq.remote(
                handle, rank not in local_ranks, os.getpid() if rank in local_ranks else None, tcp_keys
            )
            for rank, worker in enumerate(ranks.workers)
        ]
        for response_handle in startup_get(refs, "init_mq"):
            if response_handle.shm_name:
                mq.response_segments.append(response_handle.shm_name)
            mq.responses.append(MessageQueue.create_from_handle(response_handle, 0))
        try:
            mq.broadcast.wait_until_ready(timeout=start_timeout_s)
        except TimeoutError:
            raise WorkerHungError(
                f"start-up: the ranks did not subscribe to the broadcast queue within "
                f"{start_timeout_s:g} s (engine_start_timeout)"
            ) from None
        startup_get([worker.start_mq_loop.remote() for worker in ranks.workers], "start_mq_loop")
        self.rpc = MqRpcClient(mq.broadcast, mq.responses, mq.shutting_down, on_failure, ranks.describe)
        logger.info(
            "mq step transport: ranks %s read shared memory, %d over ZMQ at %s", local_ranks, num_remote, host_ip
        )

    # ---- calls -------------------------------------------------------------------------

    def collective_rpc(self, method, timeout, args, kwargs, non_block, unique_reply_rank):
        if not isinstance(method, str):
            method = self.register_callable(method, timeout)
        return self.rpc.call(method, timeout, args, kwargs, non_block, unique_reply_rank)

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool):
        return self.collective_rpc(
            "execute_model", self.step_timeout_s, (scheduler_output,), None, non_block, self.output_rank
        )

    def sample_tokens(self, grammar_output: GrammarOutput | None, non_block: bool):
        return self.collective_rpc(
            "sample_tokens", self.step_timeout_s, (grammar_output,), None, non_block, self.output_rank
        )

    def check_health(self, timeout: float) -> None:
        if not self.rpc.pending:
            self.rpc.call("check_health", timeout)

    def register_callable(self, fn, timeout: float | None) -> CallableRef:
        """A callable travels to every actor through Ray (cloudpickled by Ray,
        on Ray's channels), and the queue, which may cross the network as
        typed msgpack, carries only its token. Registered before the call is
        queued, so every rank finds it when the call comes."""
        import ray

        ref = CallableRef(next(_CALLABLE_TOKENS), method_name(fn))
        limit = timeout if timeout is not None else _MQ_SETUP_TIMEOUT_S
        calls = [worker.register_rpc_callable.remote(ref.token, fn) for worker in self._workers]
        try:
            ray.get(calls, timeout=limit)
        except ray.exceptions.GetTimeoutError:
            raise WorkerHungError(
                f"collective_rpc {ref.name!r}: the actors did not take the callable within {limit} s"
            ) from None
        except ray.exceptions.RayActorError as e:
            raise WorkerDiedError(f"collective_rpc {ref.name!r}: an actor died taking the callable: {e}") from e
        return ref

    # ---- failure and shutdown ------------------------------------------------------------

    def mark_failed(self, reason: str) -> None:
        if self.rpc is not None:
            self.rpc.mark_failed(reason)  # fails the calls in flight now

    def raise_if_failed(self) -> None:
        if self.rpc is not None and self.rpc.failure is not None:
            self.rpc.raise_if_failed()

    @property
    def shm_segment_names(self) -> list[str]:
        broadcast = self.queues.broadcast
        names = [broadcast.shm_name] if broadcast is not None and broadcast.shm_name else []
        return names + list(self.queues.response_segments)

    @property
    def resources(self) -> MqQueues:
        return self.queues

    def stop(self, workers: list, wait_for_loops: bool) -> None:
        self.queues.stop(workers, wait_for_loops)

    def release(self) -> None:
        self.queues.release()
        if self.rpc is not None:
            self.rpc.cancel_pending()


def _wait_for_mq_loops(workers: list) -> None:
    import ray

    refs = [worker.wait_mq_loop_exit.remote(_MQ_LOOP_EXIT_TIMEOUT_S) for worker in workers]
    try:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_MQ_LOOP_EXIT_TIMEOUT_S + 1.0)
    except Exception as e:  # a dead actor: it gets killed next anyway
        logger.debug("waiting for the message-queue loops: %s", e)
        return
    if len(ready) < len(refs):
        logger.warning(
            "%d worker loop(s) did not stop within %.0f s; killing them",
            len(refs) - len(ready),
            _MQ_LOOP_EXIT_TIMEOUT_S,
        )
