"""`LLM`: offline batch generation with vLLM's interface."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from raylm.engine.arg_utils import EngineArgs
from raylm.engine.llm_engine import LLMEngine
from raylm.engine.tokenizer import encode_rendered_chat
from raylm.lora.request import LoRARequest
from raylm.outputs import RequestOutput
from raylm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    """Generate text for a batch of prompts.

    `LLM(model=None)` runs the embedded default model. Engine settings are
    keyword arguments named as in vLLM (tensor_parallel_size,
    distributed_executor_backend, enable_prefix_caching, max_model_len, ...):
    the fields of EngineArgs, which are also the `raylm` command's flags.
    The engine shuts down on `shutdown()`, at the end of a `with` block, or
    when the object is garbage collected or the interpreter exits.
    """

    def __init__(self, model: str | None = None, **engine_args: Any):
        # The settings, their defaults and their checks are EngineArgs'; an
        # unknown name is a TypeError there.
        config = EngineArgs(model=model, **engine_args).create_engine_config()
        self.llm_engine = LLMEngine(config)
        # Runs at gc or interpreter exit too, so workers never outlive the user's script.
        self._finalizer = weakref.finalize(self, self.llm_engine.shutdown)

    def scale(self, data_parallel_size: int) -> None:
        """Change the number of data-parallel replicas: new ones are placed and
        warmed before they serve; removed ones finish their requests first."""
        self.llm_engine.scale(data_parallel_size)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate(prompts)` samples with: SamplingParams' defaults, with
        the model's generation_config.json settings over them (as in vLLM;
        the engine's generation_config="vllm" leaves them out)."""
        return SamplingParams(**self.llm_engine.config.model_config.default_sampling_params)

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: the LoRA adapter to run with (enable_lora), one for
        every prompt or a list of one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts")
        loras = _per_prompt_loras(lora_request, len(prompts))
        engine = self.llm_engine
        # Validate everything before adding anything: a bad prompt raises and
        # leaves the engine exactly as it was.
        validated = [engine.validate(p, sp, lr) for p, sp, lr in zip(prompts, params_list, loras)]
        request_ids = []
        for processed, params in validated:
            rid = engine.next_request_id()
            engine.add_validated_request(rid, processed, params)
            request_ids.append(rid)
        try:
            results = self._run(request_ids, use_tqdm)
        except BaseException:
            for rid in request_ids:
                engine.abort_request(rid)
            raise
        return [results[rid] for rid in request_ids]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, out_tokens = time.perf_counter(), 0
        try:
            while pending:
                for output in engine.step():
                    if output.request_id in pending:
                        pending.discard(output.request_id)
                        results[output.request_id] = output
                        out_tokens += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"output {out_tokens / max(elapsed, 1e-9):.1f} tok/s", refresh=False)
        finally:
            bar.close()
        return results

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            for m in conversation:
                if not isinstance(m, dict) or "role" not in m or "content" not in m:
                    raise ValueError("messages must be dicts with 'role' and 'content'")
            text = self.apply_chat_template(conversation, chat_template, add_generation_prompt)
            ids = encode_rendered_chat(self.get_tokenizer(), text)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(
        self, conversation: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True
    ) -> str:
        tokenizer = self.get_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat_template; pass chat_template=")
        return tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _per_prompt_loras(lora_request, num_prompts: int) -> list[LoRARequest | None]:
    """One adapter (or None) for each prompt, from one or a list of one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != num_prompts:
            raise ValueError(f"lora_request has {len(lora_request)} entries for {num_prompts} prompts")
        return list(lora_request)
    raise ValueError(f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}")
