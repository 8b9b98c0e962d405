"""CUDA tests: they skip cleanly without a GPU, and run on CUDA (not the CPU the
rest of the suite is pinned to). The oracle here is Hugging Face on the same GPU."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _on_cuda(monkeypatch):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("RAYLM_DEVICE", "cuda")
    yield
    torch.cuda.synchronize()


@dataclass
class HFStep:
    token_id: int
    logprob: float
    # Log-prob gap between this step's best and second-best token: how close
    # the step is to a tie that rounding may break either way.
    margin: float


_hf_models: dict = {}


def _hf_model(model_dir: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    key = (model_dir, dtype)
    if key not in _hf_models:
        _hf_models.clear()  # one at a time: GPU memory
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
        _hf_models[key] = model.to("cuda", dtype).eval()
    return _hf_models[key]


@torch.inference_mode()
def hf_greedy_cuda(
    model_dir: str, prompts: list[list[int]], max_new_tokens: int, dtype: torch.dtype
) -> list[list[HFStep]]:
    """Greedy continuation per prompt on CUDA, recomputing the whole sequence
    each step (no cache argument, whose name differs between transformers
    versions)."""
    model = _hf_model(model_dir, dtype)
    results = []
    for prompt in prompts:
        ids = list(prompt)
        steps = []
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids], device="cuda")).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            top2 = torch.topk(logprobs, 2)
            token = int(top2.indices[0])
            steps.append(HFStep(token, float(top2.values[0]), float(top2.values[0] - top2.values[1])))
            ids.append(token)
        results.append(steps)
    return results
