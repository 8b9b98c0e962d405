"""Hugging Face transformers as the correctness oracle: greedy tokens and logprobs.

Each prompt runs alone (no padding) in an eager-attention model, so results are the reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import pathlib

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.utils import logging as hf_logging

logger = logging.getLogger(__name__)

_loaded_models: dict[tuple, PreTrainedModel] = {}


def one_torch_thread(function):
    """Runs `function` with one torch thread, then gives the caller's count back.

    The oracle's models are tiny: a second thread has nothing to split, and
    on a busy machine (two cores shared with engine processes) its barrier
    waits made a 16-prompt reference take 15 s instead of half a second."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with _torch_threads(1):
            return function(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def _torch_threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclasses.dataclass(frozen=True)
class HFGeneration:
    """Greedy continuation of one prompt: new tokens and the raw log-prob of each."""

    token_ids: list[int]
    logprobs: list[float]


def _folder_fingerprint(folder: pathlib.Path) -> tuple:
    """Names, sizes and mtimes of the weight files, so a rewritten folder is reloaded."""
    files = sorted([*folder.glob("*.safetensors"), folder / "config.json"])
    return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists())


def load_hf_model(model_path: str | pathlib.Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Loads (or reuses) the HF model for `model_path` in `dtype`, in eval mode on CPU."""
    folder = pathlib.Path(model_path).resolve()
    key = (str(folder), dtype, _folder_fingerprint(folder))
    model = _loaded_models.get(key)
    if model is None:
        # Drop stale entries for the same folder so rewritten fixtures don't pile up.
        for old_key in [k for k in _loaded_models if k[:2] == key[:2]]:
            del _loaded_models[old_key]
        was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no "Loading weights" bars in test logs
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
        finally:
            if was_enabled:
                hf_logging.enable_progress_bar()
        model.eval()
        _loaded_models[key] = model
        logger.debug("loaded HF oracle model %s (%s)", folder, dtype)
    return model


@torch.inference_mode()
def hf_greedy(
    model_path: str | pathlib.Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
) -> list[HFGeneration]:
    """Greedy-decodes exactly `max_new_tokens` per prompt, never stopping at EOS.

    A hand-written loop over the KV cache instead of `generate()`, which would apply the
    folder's generation_config (EOS handling, penalties) and change what "greedy" means.
    """
    return greedy_of(load_hf_model(model_path, dtype), prompts, max_new_tokens)


@one_torch_thread
def greedy_of(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list[HFGeneration]:
    """hf_greedy's loop on a model already loaded (a PeftModel, say)."""
    results: list[HFGeneration] = []
    for prompt in prompts:
        if not prompt:
            raise ValueError("prompts must be non-empty token lists")
        input_ids = torch.tensor([prompt], dtype=torch.long)
        # The cache is filled in place by each forward; transformers 5 names the argument `cache`.
        kv_cache = DynamicCache(config=model.config)
        token_ids: list[int] = []
        logprobs: list[float] = []
        for _ in range(max_new_tokens):
            output = model(input_ids=input_ids, cache=kv_cache, use_cache=True)
            step_logprobs = torch.log_softmax(output.logits[0, -1].float(), dim=-1)
            next_token = int(torch.argmax(step_logprobs))
            token_ids.append(next_token)
            logprobs.append(float(step_logprobs[next_token]))
            input_ids = torch.tensor([[next_token]], dtype=torch.long)
        results.append(HFGeneration(token_ids=token_ids, logprobs=logprobs))
    return results


@torch.inference_mode()
@one_torch_thread
def hf_prompt_logprobs(
    model_path: str | pathlib.Path,
    prompt: list[int],
    dtype: torch.dtype = torch.float32,
) -> list[float]:
    """Log-prob of each prompt token given the ones before it (length len(prompt) - 1)."""
    if len(prompt) < 2:
        return []
    model = load_hf_model(model_path, dtype)
    logits = model(input_ids=torch.tensor([prompt], dtype=torch.long)).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(prompt[1:], dtype=torch.long)
    return logprobs.gather(1, targets[:, None]).squeeze(1).tolist()


@torch.inference_mode()
@one_torch_thread
def hf_logit_margins(
    model_path: str | pathlib.Path,
    prompt: list[int],
    dtype: torch.dtype = torch.float32,
) -> list[float]:
    """Top-1 minus top-2 logit at every prompt position: how safe greedy argmax is from rounding."""
    model = load_hf_model(model_path, dtype)
    logits = model(input_ids=torch.tensor([prompt], dtype=torch.long)).logits[0].float()
    top2 = torch.topk(logits, k=2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()
