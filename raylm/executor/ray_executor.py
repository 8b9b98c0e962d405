"""RayDistributedExecutor: one Ray actor per rank, placed by a placement group,
with the per-step forward on a Ray Compiled Graph or on message queues.

Ray is the control plane here (placement, environment, liveness); the step
itself travels on `parallel_config.ray_step_transport`:

- `cgraph`: InputNode -> every TP rank of PP stage 0 -> (tensor channel: shared
  memory on CPU, NCCL on GPU) -> ... -> last stage, which samples.
- `mq`: every call (steps and collective_rpc alike) is broadcast on a
  MessageQueue (shared memory on the driver's node, ZMQ to other nodes) to a
  loop thread in each actor, which replies on its own response queue: the same
  code as the multiprocess executor (raylm.executor.mq_rpc). PP tensors move
  on torch.distributed. A collective_rpc callable travels through Ray (see
  _register_callable), never on the queue; sockets to other nodes use CURVE.

TP collectives run on torch.distributed inside the actors either way.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from concurrent.futures import Future

# Compiled-graph timeouts are read when ray.dag is first imported, so they are
# set before any import of it. A first step may include slow work (a long
# prefill on a big model), hence a generous get timeout; submit only waits for
# a free slot in the graph's input channel.
os.environ.setdefault("RAY_CGRAPH_get_timeout", "600")
os.environ.setdefault("RAY_CGRAPH_submit_timeout", "120")
os.environ.setdefault("RAY_CGRAPH_teardown_timeout", "10")

from raylm.distributed.rpc_messages import CallableRef  # noqa: E402
from raylm.distributed.shm_broadcast import MessageQueue, unlink_segment  # noqa: E402
from raylm.distributed.tcp_auth import CurveKeys, tcp_auth_enabled  # noqa: E402
from raylm.executor.abstract import Executor  # noqa: E402
from raylm.executor import ray_utils  # noqa: E402
from raylm.executor.errors import WorkerDiedError, WorkerHungError  # noqa: E402
from raylm.executor.mq_rpc import MqRpcClient  # noqa: E402
from raylm.messages import GrammarOutput, SchedulerOutput  # noqa: E402
from raylm.worker.cpu_placement import CpuPlacement, RankPlacement  # noqa: E402

logger = logging.getLogger(__name__)

# How long shutdown waits for the compiled graph to tear down before giving up
# on it (the actors are already killed by then; see shutdown()).
_TEARDOWN_DEADLINE_S = 15.0
# `mq` transport: how long registering a callable on the actors may take
# (without a deadline of the call's own), and how long shutdown lets the
# actors' loops close their queues before killing them. Start-up calls have
# the engine's start timeout (Executor.start_timeout_s).
_MQ_SETUP_TIMEOUT_S = 120.0
_MQ_LOOP_EXIT_TIMEOUT_S = 5.0

__all__ = ["RayDistributedExecutor", "WorkerDiedError"]

# Tokens of callables registered on the actors (see _register_callable).
_CALLABLE_TOKENS = itertools.count()


class _MqResources:
    """What the `mq` transport must release at shutdown; apart from the
    executor so that its weakref.finalize can hold it."""

    def __init__(self) -> None:
        self.broadcast: MessageQueue | None = None
        self.responses: list[MessageQueue] = []
        self.response_segments: list[str] = []
        self.shutting_down = threading.Event()

    def close_broadcast(self) -> None:
        self.shutting_down.set()
        if self.broadcast is not None:
            self.broadcast.close()  # every actor's loop sees it and closes its own queues

    def release(self) -> None:
        for queue in self.responses:
            queue.close()
        # An actor that was killed could not unlink its response segment; it
        # is in that actor's resource tracker, not ours, hence no unregister.
        for name in self.response_segments:
            unlink_segment(name, unregister=False)


class _RefFuture(Future):
    """A Future over a Ray ref, resolved lazily on the caller's thread."""

    def __init__(self, getter):
        super().__init__()
        self._getter = getter
        self._lock = threading.Lock()

    def result(self, timeout=None):
        with self._lock:
            if not self.done():
                try:
                    self.set_result(self._getter(timeout))
                except BaseException as e:
                    self.set_exception(e)
        return super().result()


class RayDistributedExecutor(Executor):
    uses_ray = True

    def _init_executor(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray_utils.check_ray_version()
        self._shutdown_called = False
        self._failure: str | None = None
        self.compiled_graph = None
        self._rpc: MqRpcClient | None = None
        self._mq = _MqResources() if self.config.parallel_config.ray_step_transport == "mq" else None
        self._pending_output: SchedulerOutput | None = None
        self.workers: list = []
        self._created_pg = None
        self._finalizer = None
        self.node_ids: list[str] = []
        self.node_ips: list[str] = []
        self.worker_pids: list[int] = []
        self.cpu_placements: list[RankPlacement] = []

        cfg = self.config
        pc = cfg.parallel_config
        world = pc.world_size
        device = cfg.device
        if device == "cuda" and pc.ray_step_transport == "cgraph" and pc.pipeline_parallel_size > 1:
            ray_utils.check_cupy_for_nccl_channels()  # before anything is placed
        cpus_per_worker = ray_utils.cpus_per_rank(cfg) if device == "cpu" else 1
        placement = ray_utils.initialize_ray_cluster(pc, device, cpus_per_worker)
        if placement.created_here:
            self._created_pg = placement.placement_group

        # From here on, failures must not leak actors or the placement group.
        self._finalizer = weakref.finalize(self, RayDistributedExecutor._cleanup, [], [self._created_pg], None, self._mq)
        actor_cls = ray.remote(ray_utils.RayWorkerWrapper)
        env = ray_utils.worker_env_vars(device)
        if device == "cpu":
            # OpenMP sizes its pool from this when the actor's process starts.
            env["OMP_NUM_THREADS"] = str(cpus_per_worker)
        try:
            for i, bundle_index in enumerate(placement.bundle_indices):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=placement.placement_group,
                    placement_group_bundle_index=bundle_index,
                    placement_group_capture_child_tasks=True,
                )
                actor = actor_cls.options(
                    num_cpus=0 if device == "cuda" else cpus_per_worker,
                    num_gpus=1 if device == "cuda" else 0,
                    # One thread for the steps (or the compiled graph's loop),
                    # one for the liveness call, one for health checks.
                    max_concurrency=3,
                    scheduling_strategy=strategy,
                    runtime_env={"env_vars": env},
                ).remote(rank=i)
                self.workers.append(actor)
                self._finalizer.detach()
                self._finalizer = weakref.finalize(
                    self, RayDistributedExecutor._cleanup, list(self.workers), [self._created_pg], None, self._mq
                )
            self._assign_ranks()
            if device == "cpu":
                self._place_on_cpus(cpus_per_worker)
            if self._mq is not None:
                self._start_mq()
            self._start_monitor()
            # Bounded: a rank that never joins the rendezvous is named, not waited on forever.
            self.collective_rpc("init_device", timeout=self.start_timeout_s)
            self.collective_rpc("load_model", timeout=self.start_timeout_s)
        except BaseException as e:
            if isinstance(e, TimeoutError):
                self.is_failed = True  # a hung actor will not close its loop: no grace, kill it now
            self.shutdown()
            raise

    # ---- set-up ------------------------------------------------------------------

    def _startup_get(self, refs: list, call: str, describe=None) -> list:
        """ray.get of one start-up call per actor, under the start timeout: an
        actor that does not answer (hung in its constructor or in the call)
        is named with the call, and the caller tears everything down.
        `describe`: index in `refs` -> who (default: that rank)."""
        import ray

        describe = describe or self.describe_rank
        timeout = self.start_timeout_s
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if len(ready) < len(refs):
            ready_set = set(ready)
            missing = ", ".join(describe(i) for i, ref in enumerate(refs) if ref not in ready_set)
            raise WorkerHungError(f"start-up call {call!r}: {missing} did not answer within {timeout:g} s "
                                  "(engine_start_timeout)")
        return ray.get(refs)

    def _assign_ranks(self) -> None:
        import ray

        infos = self._startup_get([w.get_node_info.remote() for w in self.workers], "get_node_info",
                                  lambda i: f"actor {i} (not yet given a rank)")
        ray_utils.check_one_ip_per_node(infos)
        driver_node = ray.get_runtime_context().get_node_id()
        order = ray_utils.sort_workers(infos, driver_node)
        # Actor i becomes rank order.index(i).
        self.workers = [self.workers[i] for i in order]
        infos = [infos[i] for i in order]
        mapping = {old: new for new, old in enumerate(order)}
        self.node_ids = [info[0] for info in infos]
        self.node_ips = [info[1] for info in infos]
        self._startup_get([w.adjust_rank.remote(mapping) for w in self.workers], "adjust_rank")
        self.worker_pids = self._startup_get([w.get_pid.remote() for w in self.workers], "get_pid")

        pc = self.config.parallel_config
        tp = pc.tensor_parallel_size
        for stage in range(pc.pipeline_parallel_size):
            group_nodes = set(self.node_ids[stage * tp : (stage + 1) * tp])
            if len(group_nodes) > 1:
                logger.warning(
                    "TP group of PP stage %d spans %d nodes; tensor parallelism across nodes is slow",
                    stage, len(group_nodes),
                )
        single_node = len(set(self.node_ids)) == 1
        host = "127.0.0.1" if single_node else self.node_ips[0]
        port = self._startup_get([self.workers[0].get_free_port.remote()], "get_free_port")[0]
        init_method = f"tcp://{host}:{port}"
        init_calls, output_rank_calls = [], []
        seen: dict[str, int] = {}
        if self.config.device == "cuda":
            # Ray did not rewrite CUDA_VISIBLE_DEVICES: each actor maps the GPU
            # Ray gave it to its index among the devices its node shows.
            device_indices = self._startup_get([w.get_cuda_device_index.remote() for w in self.workers],
                                               "get_cuda_device_index")
        for rank, (worker, (node_id, _, _)) in enumerate(zip(self.workers, infos)):
            local_rank = seen.get(node_id, 0)
            seen[node_id] = local_rank + 1
            if self.config.device == "cuda":
                local_rank = device_indices[rank]
            init_calls.append(worker.init_worker.remote(self.config, local_rank, init_method))
            output_rank_calls.append(worker.set_output_rank.remote(rank == self._output_rank))
        self._startup_get(init_calls, "init_worker")
        self._startup_get(output_rank_calls, "set_output_rank")

    def _place_on_cpus(self, cpus_per_worker: int) -> None:
        """Each actor pins itself within its node: Ray's CPUs are scheduling
        tokens, not cores, so the ranks sharing a node split the node's cores
        by their order on it (the plan every one of them computes alike)."""
        import ray

        driver_node = self._driver_node_id()
        cfg = self.config
        calls, seen = [], {}
        for worker, node in zip(self.workers, self.node_ids):
            local_rank = seen.get(node, 0)
            seen[node] = local_rank + 1
            calls.append((worker, node, local_rank))
        results = self._startup_get([
            worker.place_on_cpus.remote(local_rank, seen[node], node == driver_node, cpus_per_worker,
                                        cfg.num_threads, cfg.cpu_bind)
            for worker, node, local_rank in calls
        ], "place_on_cpus")
        self.cpu_placements = [placement for placement, _ in results]
        engine_loop = next((loop for (_, loop), node in zip(results, self.node_ids) if node == driver_node), ())
        nodes = len(set(self.node_ids))
        summary = CpuPlacement(tuple(self.cpu_placements), tuple(engine_loop),
                               f"ranks on {nodes} nodes, each pinned within its own" if nodes > 1 else "")
        logger.info("CPU placement: %s", summary.describe())

    def _driver_node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def _start_mq(self) -> None:
        """The `mq` transport: a broadcast queue read over shared memory by the
        ranks on the driver's node and over ZMQ by the others; one response
        queue per rank, created by its actor."""
        import ray

        driver_node = self._driver_node_id()
        local_ranks = [rank for rank, node in enumerate(self.node_ids) if node == driver_node]
        num_remote = len(self.workers) - len(local_ranks)
        host_ip = ray.util.get_node_ip_address() if num_remote else "127.0.0.1"
        # One CURVE keypair for every TCP socket of this executor, handed to
        # the actors through Ray (raylm.distributed.tcp_auth).
        tcp_keys = CurveKeys.generate() if num_remote and tcp_auth_enabled() else None
        mq = self._mq
        mq.broadcast = MessageQueue(
            num_local_readers=len(local_ranks), num_remote_readers=num_remote,
            host_ip=host_ip, local_reader_ranks=local_ranks,
            tcp_keys=tcp_keys, authenticate_tcp=tcp_keys is not None,
        )
        handle = mq.broadcast.export_handle()
        refs = [
            worker.init_mq.remote(handle, rank not in local_ranks, os.getpid() if rank in local_ranks else None, tcp_keys)
            for rank, worker in enumerate(self.workers)
        ]
        for response_handle in self._startup_get(refs, "init_mq"):
            if response_handle.shm_name:
                mq.response_segments.append(response_handle.shm_name)
            mq.responses.append(MessageQueue.create_from_handle(response_handle, 0))
        try:
            mq.broadcast.wait_until_ready(timeout=self.start_timeout_s)
        except TimeoutError:
            raise WorkerHungError(f"start-up: the ranks did not subscribe to the broadcast queue within "
                                  f"{self.start_timeout_s:g} s (engine_start_timeout)") from None
        self._startup_get([worker.start_mq_loop.remote() for worker in self.workers], "start_mq_loop")
        self_ref = weakref.ref(self)

        def on_failure(_reason: str) -> None:
            executor = self_ref()
            if executor is not None:
                executor.is_failed = True

        self._rpc = MqRpcClient(mq.broadcast, mq.responses, mq.shutting_down, on_failure,
                                _rank_describer(self.worker_pids, self.node_ips, self.node_ids))
        logger.info("mq step transport: ranks %s read shared memory, %d over ZMQ at %s", local_ranks, num_remote, host_ip)

    @property
    def shm_segment_names(self) -> list[str]:
        """The /dev/shm segments of the `mq` transport's queues (empty for cgraph)."""
        if self._mq is None:
            return []
        broadcast = self._mq.broadcast
        names = [broadcast.shm_name] if broadcast is not None and broadcast.shm_name else []
        return names + list(self._mq.response_segments)

    def describe_rank(self, rank: int) -> str:
        return _rank_describer(self.worker_pids, self.node_ips, self.node_ids)(rank)

    def _start_monitor(self) -> None:
        self._liveness_refs = [w.wait_until_dead.remote() for w in self.workers]
        self._monitor = threading.Thread(target=self._run_monitor, name="raylm-ray-worker-monitor", daemon=True)
        self._monitor.start()

    def _run_monitor(self) -> None:
        try:
            self._monitor_loop()
        except BaseException as e:
            # Without its monitor nobody would notice a dead worker until a
            # step timed out: fail the executor so the engine rebuilds it.
            if not self._shutdown_called:
                self._set_failure(f"the worker liveness monitor failed: {type(e).__name__}: {e}")

    def _monitor_loop(self) -> None:
        import ray

        refs = list(self._liveness_refs)
        while not self._shutdown_called:
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.5)
            if not ready or self._shutdown_called:
                continue
            rank = self._liveness_refs.index(ready[0])
            try:
                ray.get(ready[0])
                reason = "its liveness call returned"
            except ray.exceptions.RayActorError as e:  # the point of this call
                reason = _actor_death_cause(e)
            except Exception as e:
                reason = f"{type(e).__name__}"
            self._set_failure(f"worker {self.describe_rank(rank)} died: {reason}")
            return

    def _set_failure(self, reason: str) -> None:
        self._failure = reason
        self.is_failed = True
        logger.error("%s", reason)
        if self._rpc is not None:
            self._rpc.mark_failed(reason)  # fails the calls in flight now

    # ---- the contract ------------------------------------------------------------

    def _raise_if_unusable(self) -> None:
        if self._failure is not None:
            raise WorkerDiedError(self._failure)
        if self._rpc is not None and self._rpc.failure is not None:
            self._rpc.raise_if_failed()
        if self._shutdown_called:
            raise RuntimeError("executor is shut down")

    def check_liveness(self) -> None:
        self._raise_if_unusable()

    def check_health(self) -> None:
        import ray

        self._raise_if_unusable()
        timeout = self.config.fault_tolerance.health_check_timeout_s
        if self._rpc is not None:
            if not self._rpc.pending:
                self._rpc.call("check_health", timeout)
            return
        if self._pending_output is not None:
            return  # a compiled-graph step is being prepared; its own deadline watches it
        refs = [w.execute_method.remote("check_health") for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if len(ready) < len(refs):
            missing = ", ".join(self.describe_rank(r) for r, ref in enumerate(refs) if ref not in ready)
            raise WorkerHungError(f"health check: {missing} did not answer within {timeout:g} s")
        self._raise_if_unusable()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, unique_reply_rank=None):
        import ray

        self._raise_if_unusable()
        if self._rpc is not None:
            if not isinstance(method, str):
                method = self._register_callable(method, timeout)
            return self._rpc.call(method, timeout, args, kwargs, non_block, unique_reply_rank)
        kwargs = kwargs or {}
        targets = list(range(len(self.workers)))
        refs = [self.workers[r].execute_method.remote(method, *args, **kwargs) for r in targets]

        def gather(wait_timeout):
            limit = timeout if wait_timeout is None else wait_timeout
            if limit is not None:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=limit)
                if len(ready) < len(refs):
                    missing = ", ".join(self.describe_rank(r) for r, ref in zip(targets, refs) if ref not in ready)
                    raise WorkerHungError(f"collective_rpc {_name(method)!r}: {missing} did not answer within {limit} s")
            results = []
            for rank, ref in zip(targets, refs):
                try:
                    results.append(ray.get(ref))
                except ray.exceptions.RayTaskError as e:
                    raise RuntimeError(
                        f"{_name(method)!r} failed on rank {rank} (node {self.node_ips[rank]}):\n{e}"
                    ) from e
                except ray.exceptions.RayActorError as e:
                    raise WorkerDiedError(f"{self.describe_rank(rank)} died during {_name(method)!r}: {e}") from e
            return results[unique_reply_rank] if unique_reply_rank is not None else results

        if non_block:
            return _RefFuture(gather)
        return gather(None)

    def _register_callable(self, fn, timeout: float | None) -> CallableRef:
        """The `mq` transport: a callable travels to every actor through Ray
        (cloudpickled by Ray, on Ray's channels), and the queue, which may
        cross the network as typed msgpack, carries only its token. Registered
        before the call is queued, so every rank finds it when the call comes."""
        import ray

        ref = CallableRef(next(_CALLABLE_TOKENS), _name(fn))
        limit = timeout if timeout is not None else _MQ_SETUP_TIMEOUT_S
        calls = [worker.register_rpc_callable.remote(ref.token, fn) for worker in self.workers]
        try:
            ray.get(calls, timeout=limit)
        except ray.exceptions.GetTimeoutError:
            raise WorkerHungError(f"collective_rpc {ref.name!r}: the actors did not take the callable within {limit} s") from None
        except ray.exceptions.RayActorError as e:
            raise WorkerDiedError(f"collective_rpc {ref.name!r}: an actor died taking the callable: {e}") from e
        return ref

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False):
        """Phase one: remember the step; the graph runs when sample_tokens
        supplies the grammar output, so one graph execution is one step."""
        if self._rpc is not None:
            return super().execute_model(scheduler_output, non_block)
        self._raise_if_unusable()
        if self._pending_output is not None:
            raise RuntimeError("execute_model called twice without sample_tokens in between")
        self._pending_output = scheduler_output
        if non_block:
            done: Future = Future()
            done.set_result(None)
            return done
        return None

    def sample_tokens(self, grammar_output: GrammarOutput | None, non_block: bool = False):
        import ray

        if self._rpc is not None:
            return super().sample_tokens(grammar_output, non_block)
        self._raise_if_unusable()
        if self._pending_output is None:
            raise RuntimeError("sample_tokens called without a preceding execute_model")
        scheduler_output, self._pending_output = self._pending_output, None
        if self.compiled_graph is None:
            self.compiled_graph = self._compile_graph()
        ref = self.compiled_graph.execute((scheduler_output, grammar_output))

        def get(timeout):
            limit = self.step_timeout_s if timeout is None else timeout
            try:
                results = ray.get(ref, timeout=limit)
            except Exception as e:
                if self._failure is not None:
                    raise WorkerDiedError(self._failure) from e
                if isinstance(e, ray.exceptions.GetTimeoutError):
                    raise WorkerHungError(f"compiled-graph step: no result within {limit:g} s") from e
                raise
            return results[self._output_rank - self._last_stage_first_rank]

        future = _RefFuture(get)
        return future if non_block else future.result()

    @property
    def _last_stage_first_rank(self) -> int:
        pc = self.config.parallel_config
        return (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size

    def _compile_graph(self):
        from ray.dag import InputNode, MultiOutputNode

        pc = self.config.parallel_config
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        transport = "nccl" if self.config.device == "cuda" else "shm"
        with InputNode() as step_input:
            outputs = [step_input] * tp
            for stage in range(pp):
                stage_workers = self.workers[stage * tp : (stage + 1) * tp]
                outputs = [w.execute_model_graph.bind(outputs[i]) for i, w in enumerate(stage_workers)]
                if stage < pp - 1:
                    outputs = [o.with_tensor_transport(transport=transport) for o in outputs]
            graph = MultiOutputNode(outputs)
        # One in-flight execution per PP stage keeps the pipeline full.
        compiled = graph.experimental_compile(_max_inflight_executions=max(2, pp + 1))
        logger.info("compiled Ray graph: %d stage(s) x %d TP rank(s), tensor transport %s", pp, tp, transport)
        return compiled

    def shutdown(self) -> None:
        if self._shutdown_called:
            return
        self._shutdown_called = True
        graph, self.compiled_graph = self.compiled_graph, None
        if self._finalizer is not None:
            self._finalizer.detach()
        # A failed executor's actors get no time to close their loops: some are
        # dead or stopped, and recovery is waiting.
        RayDistributedExecutor._cleanup(self.workers, [self._created_pg], graph, self._mq,
                                        wait_for_loops=not self.is_failed)
        if self._rpc is not None:
            self._rpc.cancel_pending()

    @staticmethod
    def _cleanup(workers: list, placement_groups: list, graph=None, mq: _MqResources | None = None,
                 wait_for_loops: bool = True) -> None:
        """Kill the actors first, then tear the graph down under a deadline: a
        graph whose edge carries a tensor may never finish tearing down while
        its readers still spin, but with the actors gone it returns quickly.

        With the `mq` transport, closing the broadcast queue first lets each
        actor's loop shut its worker down and unlink its own segment."""
        try:
            import ray
        except ImportError:
            ray = None
        if mq is not None:
            mq.close_broadcast()
            if ray is not None and ray.is_initialized() and workers and wait_for_loops:
                _wait_for_mq_loops(workers)
        if ray is None or not ray.is_initialized():
            if mq is not None:
                mq.release()
            return
        for worker in workers:
            try:
                ray.kill(worker)
            except Exception:  # already dead
                pass
        if graph is not None:
            thread = threading.Thread(target=_teardown_quietly, args=(graph,), name="raylm-cgraph-teardown", daemon=True)
            thread.start()
            thread.join(_TEARDOWN_DEADLINE_S)
        from ray.util.placement_group import remove_placement_group

        for pg in placement_groups:
            if pg is not None:
                try:
                    remove_placement_group(pg)
                except Exception as e:  # its bundles stay reserved: say so
                    logger.warning("could not remove placement group %s: %s", pg.id.hex()[:12], e)
        if mq is not None:
            mq.release()


def _wait_for_mq_loops(workers: list) -> None:
    import ray

    refs = [worker.wait_mq_loop_exit.remote(_MQ_LOOP_EXIT_TIMEOUT_S) for worker in workers]
    try:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_MQ_LOOP_EXIT_TIMEOUT_S + 1.0)
    except Exception as e:  # a dead actor: it gets killed next anyway
        logger.debug("waiting for the message-queue loops: %s", e)
        return
    if len(ready) < len(refs):
        logger.warning("%d worker loop(s) did not stop within %.0f s; killing them", len(refs) - len(ready), _MQ_LOOP_EXIT_TIMEOUT_S)



def _teardown_quietly(graph) -> None:
    # The actors are already dead, so Ray logs an error per cancelled task;
    # that is the expected outcome here, not news for the user.
    dag_logger = logging.getLogger("ray.dag.compiled_dag_node")
    level = dag_logger.level
    dag_logger.setLevel(logging.CRITICAL)
    try:
        graph.teardown()
    except Exception as e:
        logger.debug("compiled graph teardown: %s", e)
    finally:
        dag_logger.setLevel(level)


def _rank_describer(pids: list[int], ips: list[str], node_ids: list[str]):
    """rank -> "rank 1 (pid 4242, node 10.0.0.2 1a2b3c4d5e6f)"; closes over the
    lists, not the executor, so whoever holds it does not keep the executor alive."""

    def describe(rank: int) -> str:
        pid = pids[rank] if rank < len(pids) else "?"
        where = f"{ips[rank]} {node_ids[rank][:12]}" if rank < len(ips) else "?"
        return f"rank {rank} (pid {pid}, node {where})"

    return describe


def _actor_death_cause(error) -> str:
    """The first line of Ray's account of an actor's death (killed, node lost, OOM...)."""
    text = str(error).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and "The actor is dead" not in line:
            return line[:300]
    return type(error).__name__


def _name(method) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", repr(method))
