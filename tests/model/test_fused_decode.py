"""Decode steps through decode_layers.cpp (one call for all decoder layers)
against the same model run module by module: the same kernels in the same
order, so tokens and logprobs agree to the bit, for every architecture."""

from __future__ import annotations

import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.model import llama_decode
from raylm.model.layers import cpu_gemm
from raylm.model.layers.cpu_kernels import get_cpu_kernels
from raylm.testing.tiny_models import SUPPORTED_ARCHS, make_tiny_model
from tests.model.cpu_kernel_utils import needs_compiler

pytestmark = needs_compiler


class _CountingKernels:
    def __init__(self, kernels):
        self._kernels, self.calls, self.max_rows = kernels, 0, 0

    def __getattr__(self, name):
        return getattr(self._kernels, name)

    def decode_layers(self, *args):
        self.calls += 1
        self.max_rows = max(self.max_rows, args[0].shape[0])
        return self._kernels.decode_layers(*args)


def _generate(model, prompts, max_tokens, **engine_args):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in max_tokens]
    engine_args.setdefault("distributed_executor_backend", "uni")
    with LLM(
        str(model), dtype="bfloat16", kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False, **engine_args
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_fused_decode_equals_module_path(arch, tmp_path, monkeypatch):
    kernels = get_cpu_kernels()
    assert kernels is not None, "a C++ compiler is present, so the kernels must build"
    model = make_tiny_model(arch, tmp_path / arch, seed=3, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    # Six requests: where the CPU has bf16 arithmetic the first steps decode
    # more rows than the fused path takes (cpu_gemm.kernel_max_rows: they run
    # module by module), then requests finish and the rest is fused; on AVX2
    # every step is fused.
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (1, 5, 17, 9, 30, 2)]
    max_tokens = [6, 20, 12, 3, 24, 9]

    counting = _CountingKernels(kernels)
    monkeypatch.setattr(llama_decode, "get_cpu_kernels", lambda: counting)
    fused = _generate(model, prompts, max_tokens)
    assert counting.calls > 0, "no decode step went through decode_layers"

    monkeypatch.setattr(llama_decode, "ENABLED", False)
    counting.calls = 0
    modules = _generate(model, prompts, max_tokens)
    assert counting.calls == 0
    assert fused == modules


@pytest.mark.parametrize("bf16_arithmetic", [True, False])
def test_fused_decode_takes_the_rows_the_bf16_kernel_serves(bf16_arithmetic, tmp_path, monkeypatch):
    """4 decode rows where the CPU has bf16 arithmetic (oneDNN above), 64 without
    (raylm's kernel serves them all on its thread team): 12 requests that end
    one after another decode fused from their first step only in the second
    case, from when at most 4 remain in the first, with the module path's
    tokens either way."""
    monkeypatch.setattr(cpu_gemm, "cpu_has_bf16_arithmetic", lambda: bf16_arithmetic)
    model = make_tiny_model("llama", tmp_path / "m", seed=4, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in range(1, 13)]
    counting = _CountingKernels(get_cpu_kernels())
    monkeypatch.setattr(llama_decode, "get_cpu_kernels", lambda: counting)
    max_tokens = list(range(2, 14))
    fused = _generate(model, prompts, max_tokens, num_scheduler_steps=1)
    assert counting.max_rows == (cpu_gemm.DECODE_MAX_ROWS if bf16_arithmetic else 12)
    monkeypatch.setattr(llama_decode, "ENABLED", False)
    assert fused == _generate(model, prompts, max_tokens, num_scheduler_steps=1)


@pytest.mark.slow
def test_fused_decode_on_pipeline_stages(tmp_path, monkeypatch):
    """PP=2 on mp: the second stage enters decode_layers with the first
    stage's residual; both stages' workers read RAYLM_FUSED_DECODE."""
    assert get_cpu_kernels() is not None
    model = make_tiny_model("qwen3", tmp_path / "m", seed=5, dtype=torch.bfloat16, num_hidden_layers=4)
    prompts = [[5, 9, 11], [7] * 12]
    pp = dict(pipeline_parallel_size=2, distributed_executor_backend="mp")
    fused = _generate(model, prompts, [10, 14], **pp)
    monkeypatch.setenv(llama_decode.FUSED_DECODE_ENV, "0")
    modules = _generate(model, prompts, [10, 14], **pp)
    assert fused == modules
    # And one stage, module by module, computes the same.
    assert _generate(model, prompts, [10, 14]) == modules


@pytest.mark.parametrize(
    "context_parallel, lora_mask",
    [(None, None), (object(), None), (None, torch.ones(2, 1, dtype=torch.bool))],
    ids=["plain", "cp", "lora"],
)
def test_fused_decode_declines_a_context_parallel_step(context_parallel, lora_mask, monkeypatch):
    """Under CP a rank holds a shard of each context, whose partial attention
    the fused loop cannot merge over the ranks: such a step runs module by
    module. So does a step with LoRA adapter rows (the fused loop adds no
    adapter delta). (The same step without either goes on to the fused
    path's params.)"""
    from types import SimpleNamespace

    meta = SimpleNamespace(
        prefills=None,
        num_decode_tokens=2,
        decode_context_lens=torch.tensor([3, 4]),
        context_parallel=context_parallel,
        lora_mask=lora_mask,
    )
    monkeypatch.setattr(llama_decode, "get_attention_metadata", lambda: meta)
    monkeypatch.setattr(llama_decode, "get_tp_group", lambda: SimpleNamespace(world_size=1))
    monkeypatch.setattr(llama_decode, "ENABLED", True)
    fused = llama_decode.FusedDecode(model=None)
    reached = []
    monkeypatch.setattr(fused, "_current_params", lambda: reached.append(True))
    hidden = torch.zeros(2, 8, dtype=torch.bfloat16)
    assert fused(hidden, None, torch.tensor([2, 3])) is None
    assert reached == ([] if context_parallel is not None or lora_mask is not None else [True])


def test_fused_decode_refuses_a_kv_slot_outside_the_cache(tmp_path, monkeypatch):
    """The loop writes each token's K/V row to its slot by a plain copy: a slot
    past the cache (or negative) is refused with its number, nothing written."""
    kernels = get_cpu_kernels()
    assert kernels is not None
    captured = []

    class _Capturing(_CountingKernels):
        def decode_layers(self, *args):
            captured.append(args)
            return super().decode_layers(*args)

    monkeypatch.setattr(llama_decode, "get_cpu_kernels", lambda: _Capturing(kernels))
    model = make_tiny_model("llama", tmp_path / "m", seed=3, dtype=torch.bfloat16)
    _generate(model, [[5, 9, 11]], [3])
    assert captured, "no decode step went through decode_layers"
    args = list(captured[-1])
    hidden, residual, _, slot_mapping = args[:4]  # then positions, slot_mapping, ...
    caches = [t for t in args[8] if t.dim() == 5]  # each layer's [2, blocks, block_size, kv_heads, D]
    # Compared as bits: the cache is torch.empty, and a never-written slot may hold NaN patterns.
    before = [c.view(torch.int16).clone() for c in caches]
    slots = caches[0][0].numel() // (caches[0].shape[-2] * caches[0].shape[-1])
    for bad in (slots, -1):
        args[3] = torch.full_like(slot_mapping, bad)
        with pytest.raises(RuntimeError, match=f"KV cache slot {bad} out of range"):
            kernels.decode_layers(hidden.clone(), residual, *args[2:])
    assert all(torch.equal(c.view(torch.int16), b) for c, b in zip(caches, before))
