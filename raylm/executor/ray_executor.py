"""RayDistributedExecutor: one Ray actor per rank, placed by a placement group,
with the per-step forward on a step transport.

Ray is the control plane here: placement (raylm.executor.ray_placement, the
same functions `raylm plan` calls), the actors' environment, and liveness (a
monitor watches one never-returning call per actor). The step itself, and
every collective_rpc, travel on the `StepTransport` that
`parallel_config.ray_step_transport` names (raylm.executor.ray_transport):
`mq`, message queues shared with the multiprocess executor, or `cgraph`, a Ray
Compiled Graph. The executor calls the transport without knowing which.

TP collectives run on torch.distributed inside the actors either way.
"""

from __future__ import annotations

import logging
import threading
import weakref

# First: it sets the compiled-graph timeouts before anything imports ray.dag.
from raylm.executor.ray_cgraph import CompiledGraphTransport, check_cupy_for_nccl_channels

# isort: split
from raylm.executor import ray_placement
from raylm.executor.abstract import Executor
from raylm.executor.errors import WorkerDiedError, WorkerHungError
from raylm.executor.ray_cluster import check_ray_version, kill_actors
from raylm.executor.ray_mq_transport import MqStepTransport
from raylm.executor.ray_transport import RankActors, StepTransport
from raylm.executor.ray_worker import RayWorkerWrapper
from raylm.messages import GrammarOutput, SchedulerOutput
from raylm.worker.cpu_placement import CpuPlacement, RankPlacement

logger = logging.getLogger(__name__)

__all__ = ["RayDistributedExecutor", "WorkerDiedError"]

# The step transports by `parallel_config.ray_step_transport`.
STEP_TRANSPORTS: dict[str, type[StepTransport]] = {"mq": MqStepTransport, "cgraph": CompiledGraphTransport}


class RayDistributedExecutor(Executor):
    uses_ray = True

    def _init_executor(self) -> None:
        import ray

        check_ray_version()
        self._shutdown_called = False
        self._failure: str | None = None
        self.workers: list = []
        self._created_pg = None
        self._finalizer = None
        self.node_ids: list[str] = []
        self.node_ips: list[str] = []
        self.worker_pids: list[int] = []
        self.cpu_placements: list[RankPlacement] = []

        cfg = self.config
        pc = cfg.parallel_config
        self.transport: StepTransport = STEP_TRANSPORTS[pc.ray_step_transport](
            cfg, step_timeout_s=self.step_timeout_s, output_rank=self._output_rank
        )
        device = cfg.device
        if device == "cuda" and pc.ray_step_transport == "cgraph" and pc.pipeline_parallel_size > 1:
            check_cupy_for_nccl_channels()  # before anything is placed
        request = ray_placement.rank_request(cfg)
        placement = ray_placement.place_ranks(pc, request)
        if placement.created_here:
            self._created_pg = placement.placement_group

        # From here on, failures must not leak actors or the placement group.
        resources = self.transport.resources
        self._finalizer = weakref.finalize(self, RayDistributedExecutor._cleanup, [], [self._created_pg], resources)
        actor_cls = ray.remote(RayWorkerWrapper)
        try:
            for i, bundle_index in enumerate(placement.bundle_indices):
                options = ray_placement.rank_actor_options(
                    placement.placement_group, bundle_index, device, request.cpus_per_worker
                )
                self.workers.append(actor_cls.options(**options).remote(rank=i))
                self._finalizer.detach()
                self._finalizer = weakref.finalize(
                    self, RayDistributedExecutor._cleanup, list(self.workers), [self._created_pg], resources
                )
            self._assign_ranks()
            if device == "cpu":
                self._place_on_cpus(request.cpus_per_worker)
            self._start_transport()
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
            raise WorkerHungError(
                f"start-up call {call!r}: {missing} did not answer within {timeout:g} s (engine_start_timeout)"
            )
        return ray.get(refs)

    def _assign_ranks(self) -> None:
        import ray

        infos = self._startup_get(
            [w.get_node_info.remote() for w in self.workers],
            "get_node_info",
            lambda i: f"actor {i} (not yet given a rank)",
        )
        ray_placement.check_one_ip_per_node(infos)
        driver_node = ray.get_runtime_context().get_node_id()
        order = ray_placement.sort_workers(infos, driver_node)
        # Actor i becomes rank order.index(i).
        self.workers = [self.workers[i] for i in order]
        infos = [infos[i] for i in order]
        mapping = {old: new for new, old in enumerate(order)}
        self.node_ids = [info[0] for info in infos]
        self.node_ips = [info[1] for info in infos]
        self._startup_get([w.adjust_rank.remote(mapping) for w in self.workers], "adjust_rank")
        self.worker_pids = self._startup_get([w.get_pid.remote() for w in self.workers], "get_pid")

        pc = self.config.parallel_config
        # A stage's TP and CP groups are its block of tp x cp consecutive ranks.
        stage_size = pc.tensor_parallel_size * pc.context_parallel_size
        for stage in range(pc.pipeline_parallel_size):
            group_nodes = set(self.node_ids[stage * stage_size : (stage + 1) * stage_size])
            if len(group_nodes) > 1:
                logger.warning(
                    "TP/CP groups of PP stage %d span %d nodes; tensor and context parallelism across nodes is slow",
                    stage,
                    len(group_nodes),
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
            device_indices = self._startup_get(
                [w.get_cuda_device_index.remote() for w in self.workers], "get_cuda_device_index"
            )
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
        driver_node = self._driver_node_id()
        cfg = self.config
        calls, seen = [], {}
        for worker, node in zip(self.workers, self.node_ids):
            local_rank = seen.get(node, 0)
            seen[node] = local_rank + 1
            calls.append((worker, node, local_rank))
        results = self._startup_get(
            [
                worker.place_on_cpus.remote(
                    local_rank, seen[node], node == driver_node, cpus_per_worker, cfg.num_threads, cfg.cpu_bind
                )
                for worker, node, local_rank in calls
            ],
            "place_on_cpus",
        )
        self.cpu_placements = [placement for placement, _ in results]
        engine_loop = next((loop for (_, loop), node in zip(results, self.node_ids) if node == driver_node), ())
        nodes = len(set(self.node_ids))
        summary = CpuPlacement(
            tuple(self.cpu_placements),
            tuple(engine_loop),
            f"ranks on {nodes} nodes, each pinned within its own" if nodes > 1 else "",
        )
        logger.info("CPU placement: %s", summary.describe())

    def _driver_node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def _start_transport(self) -> None:
        self_ref = weakref.ref(self)

        def on_failure(_reason: str) -> None:
            executor = self_ref()
            if executor is not None:
                executor.is_failed = True

        ranks = RankActors(
            self.workers, self.node_ids, self.node_ips, _rank_describer(self.worker_pids, self.node_ips, self.node_ids)
        )
        self.transport.start(ranks, self._startup_get, self.start_timeout_s, self._driver_node_id(), on_failure)

    @property
    def shm_segment_names(self) -> list[str]:
        """The /dev/shm segments of the step transport's queues (none for cgraph)."""
        return self.transport.shm_segment_names

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
        self.transport.mark_failed(reason)  # fails the calls in flight now

    # ---- the contract ------------------------------------------------------------

    def _raise_if_unusable(self) -> None:
        if self._failure is not None:
            raise WorkerDiedError(self._failure)
        self.transport.raise_if_failed()
        if self._shutdown_called:
            raise RuntimeError("executor is shut down")

    def check_liveness(self) -> None:
        self._raise_if_unusable()

    def check_health(self) -> None:
        self._raise_if_unusable()
        self.transport.check_health(self.config.fault_tolerance.health_check_timeout_s)
        self._raise_if_unusable()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, unique_reply_rank=None):
        self._raise_if_unusable()
        return self.transport.collective_rpc(method, timeout, args, kwargs, non_block, unique_reply_rank)

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False):
        self._raise_if_unusable()
        return self.transport.execute_model(scheduler_output, non_block)

    def sample_tokens(self, grammar_output: GrammarOutput | None, non_block: bool = False):
        self._raise_if_unusable()
        return self.transport.sample_tokens(grammar_output, non_block)

    def shutdown(self) -> None:
        if self._shutdown_called:
            return
        self._shutdown_called = True
        if self._finalizer is not None:
            self._finalizer.detach()
        # A failed executor's actors get no time to close their loops: some are
        # dead or stopped, and recovery is waiting.
        RayDistributedExecutor._cleanup(
            self.workers, [self._created_pg], self.transport, wait_for_loops=not self.is_failed
        )

    @staticmethod
    def _cleanup(workers: list, placement_groups: list, transport=None, wait_for_loops: bool = True) -> None:
        """Let the transport stop (mq: close the broadcast queue, so that each
        actor's loop shuts its worker down and unlinks its own segment), kill
        the actors, let the transport finish (cgraph: tear the graph down),
        remove the placement group. `transport`: the StepTransport, or from
        the finalizer what it must release (StepTransport.resources)."""
        try:
            import ray
        except ImportError:
            ray = None
        ray_up = ray is not None and ray.is_initialized()
        if transport is not None:
            transport.stop(workers, wait_for_loops=wait_for_loops and ray_up)
        if not ray_up:
            if transport is not None:
                transport.release()
            return
        kill_actors(workers)
        if transport is not None:
            transport.after_kill()
        from ray.util.placement_group import remove_placement_group

        for pg in placement_groups:
            if pg is not None:
                try:
                    remove_placement_group(pg)
                except Exception as e:  # its bundles stay reserved: say so
                    logger.warning("could not remove placement group %s: %s", pg.id.hex()[:12], e)
        if transport is not None:
            transport.release()


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
