"""The `cgraph` step transport of the Ray executor: each step is one
execution of a Ray Compiled Graph, built at the first step: InputNode ->
every TP rank of PP stage 0 -> (tensor channel: shared memory on CPU, NCCL on
GPU) -> ... -> last stage, which samples. Other calls (collective_rpc, the
health check) are plain Ray actor calls."""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future

# Compiled-graph timeouts are read when ray.dag is first imported, so they are
# set when this module is (the executor imports it before anything imports
# ray.dag). A first step may include slow work (a long prefill on a big
# model), hence a generous get timeout; submit only waits for a free slot in
# the graph's input channel.
os.environ.setdefault("RAY_CGRAPH_get_timeout", "600")
os.environ.setdefault("RAY_CGRAPH_submit_timeout", "120")
os.environ.setdefault("RAY_CGRAPH_teardown_timeout", "10")

from raylm.executor.errors import WorkerDiedError, WorkerHungError
from raylm.executor.mq_rpc import method_name
from raylm.executor.ray_transport import RankActors, RefFuture, StepTransport
from raylm.messages import GrammarOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# How long shutdown waits for the compiled graph to tear down before giving up
# on it (the actors are already killed by then; see after_kill()).
_TEARDOWN_DEADLINE_S = 15.0


class CompiledGraphTransport(StepTransport):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compiled_graph = None
        self._pending_output: SchedulerOutput | None = None
        self._failure: str | None = None
        self._ranks: RankActors | None = None

    def start(self, ranks: RankActors, startup_get, start_timeout_s, driver_node_id, on_failure) -> None:
        # The graph is compiled at the first step, when every rank is ready.
        self._ranks = ranks

    # ---- calls -------------------------------------------------------------------------

    def collective_rpc(self, method, timeout, args, kwargs, non_block, unique_reply_rank):
        import ray

        ranks = self._ranks
        kwargs = kwargs or {}
        targets = list(range(len(ranks.workers)))
        refs = [ranks.workers[r].execute_method.remote(method, *args, **kwargs) for r in targets]

        def gather(wait_timeout):
            limit = timeout if wait_timeout is None else wait_timeout
            if limit is not None:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=limit)
                if len(ready) < len(refs):
                    missing = ", ".join(ranks.describe(r) for r, ref in zip(targets, refs) if ref not in ready)
                    raise WorkerHungError(
                        f"collective_rpc {method_name(method)!r}: {missing} did not answer within {limit} s"
                    )
            results = []
            for rank, ref in zip(targets, refs):
                try:
                    results.append(ray.get(ref))
                except ray.exceptions.RayTaskError as e:
                    raise RuntimeError(
                        f"{method_name(method)!r} failed on rank {rank} (node {ranks.node_ips[rank]}):\n{e}"
                    ) from e
                except ray.exceptions.RayActorError as e:
                    raise WorkerDiedError(f"{ranks.describe(rank)} died during {method_name(method)!r}: {e}") from e
            return results[unique_reply_rank] if unique_reply_rank is not None else results

        if non_block:
            return RefFuture(gather)
        return gather(None)

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool):
        """Phase one: remember the step; the graph runs when sample_tokens
        supplies the grammar output, so one graph execution is one step."""
        if self._pending_output is not None:
            raise RuntimeError("execute_model called twice without sample_tokens in between")
        self._pending_output = scheduler_output
        if non_block:
            done: Future = Future()
            done.set_result(None)
            return done
        return None

    def sample_tokens(self, grammar_output: GrammarOutput | None, non_block: bool):
        import ray

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
            return results[self.output_rank - self._last_stage_first_rank]

        future = RefFuture(get)
        return future if non_block else future.result()

    def check_health(self, timeout: float) -> None:
        import ray

        if self._pending_output is not None:
            return  # a compiled-graph step is being prepared; its own deadline watches it
        ranks = self._ranks
        refs = [w.execute_method.remote("check_health") for w in ranks.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if len(ready) < len(refs):
            missing = ", ".join(ranks.describe(r) for r, ref in enumerate(refs) if ref not in ready)
            raise WorkerHungError(f"health check: {missing} did not answer within {timeout:g} s")

    @property
    def _last_stage_first_rank(self) -> int:
        pc = self.config.parallel_config
        return (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size

    def _compile_graph(self):
        from ray.dag import InputNode, MultiOutputNode

        pc = self.config.parallel_config
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        transport = "nccl" if self.config.device == "cuda" else "shm"
        workers = self._ranks.workers
        with InputNode() as step_input:
            outputs = [step_input] * tp
            for stage in range(pp):
                stage_workers = workers[stage * tp : (stage + 1) * tp]
                outputs = [w.execute_model_graph.bind(outputs[i]) for i, w in enumerate(stage_workers)]
                if stage < pp - 1:
                    outputs = [o.with_tensor_transport(transport=transport) for o in outputs]
            graph = MultiOutputNode(outputs)
        # One in-flight execution per PP stage keeps the pipeline full.
        compiled = graph.experimental_compile(_max_inflight_executions=max(2, pp + 1))
        logger.info("compiled Ray graph: %d stage(s) x %d TP rank(s), tensor transport %s", pp, tp, transport)
        return compiled

    # ---- failure and shutdown ------------------------------------------------------------

    def mark_failed(self, reason: str) -> None:
        self._failure = reason

    def after_kill(self) -> None:
        """Tear the graph down under a deadline, once the actors are killed: a
        graph whose edge carries a tensor may never finish tearing down while
        its readers still spin, but with the actors gone it returns quickly."""
        graph, self.compiled_graph = self.compiled_graph, None
        if graph is not None:
            thread = threading.Thread(
                target=_teardown_quietly, args=(graph,), name="raylm-cgraph-teardown", daemon=True
            )
            thread.start()
            thread.join(_TEARDOWN_DEADLINE_S)


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


def check_cupy_for_nccl_channels() -> None:
    """A compiled graph moves CUDA tensors between pipeline stages over NCCL
    channels, which Ray builds on CuPy: without it the first step would fail
    deep inside Ray; say so at start-up instead, with the fix."""
    try:
        import cupy  # noqa: F401
    except Exception as e:  # ImportError, or a CuPy built for another CUDA failing at import
        import torch

        major = (torch.version.cuda or "").split(".")[0]
        package = f"cupy-cuda{major}x" if major else "cupy-cuda12x (or the cupy-cudaNNx matching your CUDA)"
        raise RuntimeError(
            "ray_step_transport='cgraph' on CUDA sends pipeline-stage tensors over NCCL channels of Ray "
            f"Compiled Graphs, which need CuPy, and it does not import here ({type(e).__name__}: {e}). "
            f"Install it on every node: pip install {package}; or use ray_step_transport='mq' "
            "(--ray-step-transport mq)"
        ) from e
