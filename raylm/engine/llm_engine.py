"""LLMEngine: the front end (intake, output assembly) around an EngineCore.

A request with n > 1 becomes n engine-core requests (children) that share the
prompt, so prefix caching computes the prompt once; the OutputProcessor folds
their completions back into one RequestOutput.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from raylm.config import EngineConfig
from raylm.engine.engine_core import EngineCore
from raylm.engine.input_processor import InputProcessor
from raylm.engine.output_processor import OutputProcessor
from raylm.engine.protocol import EngineCoreOutputs, EngineCoreRequest
from raylm.engine.supervisor import SyncEngineCoreSupervisor
from raylm.engine.tokenizer import load_tokenizer
from raylm.lora.request import LoRARequest
from raylm.outputs import RequestOutput
from raylm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def check_data_parallel_rank(config: EngineConfig, rank: int | None) -> None:
    if rank is None:
        return
    size = config.parallel_config.data_parallel_size
    if size == 1:
        raise ValueError("data_parallel_rank needs an engine with data_parallel_size > 1")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"data_parallel_rank must be an integer >= 0, got {rank!r}")


class InprocClient:
    """The EngineCore in this process, behind the client interface of the
    supervisor (add_request, abort_requests, get_output, stats, shutdown):
    `get_output` runs one step. A failure of its executor is recovered by
    the core itself; there is no core process to restart."""

    def __init__(self, config: EngineConfig):
        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest, data_parallel_rank: int | None = None) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return EngineCoreOutputs(outputs=self.engine_core.step())

    def stats(self) -> dict:
        return self.engine_core.stats()

    def scale(self, data_parallel_size: int) -> None:
        raise ValueError("scale() needs an engine started with data_parallel_size > 1")

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config.model_config.tokenizer, config.model_config.chat_template)
        self.input_processor = InputProcessor(config.model_config, self.tokenizer, config.lora_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        # The core in this process, or data-parallel replicas (each a core of
        # its own) under the supervisor AsyncLLM uses.
        self.engine_core: InprocClient | SyncEngineCoreSupervisor
        if config.autoscale is not None:
            raise ValueError(
                "autoscale scales a server's replicas with its load (raylm serve, AsyncLLM); an "
                "offline LLM sets data_parallel_size instead"
            )
        if config.parallel_config.data_parallel_size > 1:
            self.engine_core = SyncEngineCoreSupervisor(config)
        else:
            self.engine_core = InprocClient(config)
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def validate(self, prompt: Any, params: SamplingParams, lora_request: LoRARequest | None = None):
        """Check one request without adding it: (processed prompt, finished params)."""
        return self.input_processor.process(prompt, params, lora_request)

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        processed, params = self.validate(prompt, params, lora_request)
        self.add_validated_request(request_id, processed, params, data_parallel_rank)

    def add_validated_request(
        self, request_id: str, processed, params: SamplingParams, data_parallel_rank: int | None = None
    ) -> None:
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        check_data_parallel_rank(self.config, data_parallel_rank)
        children = self.input_processor.core_requests(request_id, processed, params)
        self.output_processor.add_request(
            request_id, processed.prompt, processed.prompt_token_ids, params, [c.request_id for c in children]
        )
        for child in children:
            self.engine_core.add_request(child, data_parallel_rank)

    def scale(self, data_parallel_size: int) -> None:
        """Change the number of data-parallel replicas (see EngineCoreSupervisor.scale)."""
        self.engine_core.scale(data_parallel_size)

    def abort_request(self, request_id: str) -> None:
        self.engine_core.abort_requests(self.output_processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def step(self, stream: bool = False) -> list[RequestOutput]:
        """One engine step. Offline (stream=False) returns finished requests only;
        streaming returns a delta for every request that changed."""
        core_outputs = self.engine_core.get_output().outputs
        changed, to_abort = self.output_processor.process_outputs(core_outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        results = []
        for rid in changed:
            parent = self.output_processor.parents[rid]
            if stream or parent.finished:
                results.append(self.output_processor.make_output(rid, delta=stream))
        return results

    def stats(self) -> dict:
        return self.engine_core.stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
