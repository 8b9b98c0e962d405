"""The C++ paged decode-attention kernel against the torch path of Attention._decode,
alone and within whole steps (fresh prefills, later chunks with context, decodes,
mixes); then greedy generation with the kernel against the torch path and
Hugging Face, with chunked prefill and prefix-cache hits."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from raylm import LLM, SamplingParams
from raylm.model.forward_context import AttentionMetadata
from raylm.model.layers.attention import Attention
from raylm.model.layers.cpu_kernels import DISABLE_ENV, get_paged_decode_kernel
from raylm.testing import make_tiny_model
from raylm.testing.hf_oracle import hf_greedy
from tests.model.cpu_kernel_utils import needs_compiler
from tests.model.paged_steps import CASES, attend, random_step

pytestmark = needs_compiler

CONTEXT_LENS = [1, 15, 16, 17, 200]


@pytest.fixture(scope="module")
def kernel():
    fn = get_paged_decode_kernel()
    assert fn is not None, "a C++ compiler is present, so the kernel must build"
    return fn


def _random_case(num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """A cache with scattered blocks, one request per context length, padded tables."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(CONTEXT_LENS) // block_size) + 2  # wider than any request needs
    num_blocks = len(CONTEXT_LENS) * max_blocks + 3
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    # Blocks of different requests interleave in the cache, as after a while of serving.
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.empty(len(CONTEXT_LENS), max_blocks, dtype=torch.int64)
    used = 0
    for i, ctx in enumerate(CONTEXT_LENS):
        need = -(-ctx // block_size)
        table[i, :need] = order[used : used + need]
        table[i, need:] = table[i, 0]  # padding repeats the first block, as the runner does
        used += need
    ctx = torch.tensor(CONTEXT_LENS, dtype=torch.int64)
    mask = (torch.arange(max_blocks * block_size)[None, :] < ctx[:, None])[:, None, None, :]
    q = torch.randn(len(CONTEXT_LENS), num_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(CONTEXT_LENS), dtype=torch.int64),
        num_decode_tokens=len(CONTEXT_LENS),
        decode_block_table=table,
        decode_mask=mask,
        decode_context_lens=ctx,
    )
    return q, cache, meta


def _torch_path(q, cache, meta, num_heads, num_kv_heads, head_dim, monkeypatch) -> torch.Tensor:
    attn = Attention(num_heads, num_kv_heads, head_dim, scale=1 / math.sqrt(head_dim))
    attn.kv_cache = cache
    with monkeypatch.context() as m:
        m.setenv(DISABLE_ENV, "1")
        return attn._decode(q, meta)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
def test_kernel_matches_torch_fp32(kernel, num_kv_heads, head_dim, block_size, monkeypatch):
    num_heads = 8
    q, cache, meta = _random_case(num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed=head_dim)
    ref = _torch_path(q, cache, meta, num_heads, num_kv_heads, head_dim, monkeypatch)
    out = kernel(q, cache, meta.decode_block_table, meta.decode_context_lens, 1 / math.sqrt(head_dim))
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32])
# 40: a head of five 8-float slices, which the AVX2 path's V sums take partly one at a time.
@pytest.mark.parametrize("head_dim", [32, 40, 128])
@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
def test_kernel_matches_float_reference_bf16(kernel, num_kv_heads, head_dim, block_size, monkeypatch):
    num_heads = 8
    q, cache, meta = _random_case(num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, seed=7)
    # The kernel computes in float from the same bf16 values; only the output rounding differs.
    ref = _torch_path(q.float(), cache.float(), meta, num_heads, num_kv_heads, head_dim, monkeypatch)
    out = kernel(q, cache, meta.decode_block_table, meta.decode_context_lens, 1 / math.sqrt(head_dim))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (6, 2), (10, 2)])
def test_kernel_bf16_gqa_groups(kernel, num_heads, num_kv_heads, monkeypatch):
    # Groups of 2, 3 and 5 query heads per kv head: the bf16 paths share each K
    # and V row among the heads of a group (AVX-512: up to four at a time; AVX2:
    # groups of 1, 2, 4 or 8), so odd group sizes take the remainder paths.
    head_dim, block_size = 64, 16
    q, cache, meta = _random_case(num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, seed=11)
    ref = _torch_path(q.float(), cache.float(), meta, num_heads, num_kv_heads, head_dim, monkeypatch)
    out = kernel(q, cache, meta.decode_block_table, meta.decode_context_lens, 1 / math.sqrt(head_dim))
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=8e-3)


def test_attention_decode_uses_kernel(kernel, monkeypatch):
    """Attention._decode takes the kernel path on CPU and agrees with its own fallback."""
    q, cache, meta = _random_case(8, 2, 64, 16, torch.float32, seed=1)
    ref = _torch_path(q, cache, meta, 8, 2, 64, monkeypatch)
    attn = Attention(8, 2, 64, scale=0.125)
    attn.kv_cache = cache
    calls = []
    monkeypatch.setattr(
        "raylm.model.layers.attention.get_paged_decode_kernel",
        lambda: lambda *args: calls.append(1) or kernel(*args),
    )
    out = attn._decode(q, meta)
    assert calls, "the CPU kernel was not used"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 32), (4, 4, 64), (6, 2, 16)])
def test_whole_step_with_kernel_matches_torch(kernel, case, num_heads, num_kv_heads, head_dim, monkeypatch):
    """One forward of a whole step: the decodes through the kernel (one call),
    the prefills beside them, equal to the torch path throughout."""
    batch, cache, gen = random_step(CASES[case], num_kv_heads, head_dim, torch.float32, seed=len(case) + head_dim)
    t = batch.input_ids.shape[0]
    q = torch.randn(t, num_heads * head_dim, generator=gen)
    k = torch.randn(t, num_kv_heads * head_dim, generator=gen)
    v = torch.randn(t, num_kv_heads * head_dim, generator=gen)
    calls = []
    with monkeypatch.context() as m:
        m.setattr(
            "raylm.model.layers.attention.get_paged_decode_kernel",
            lambda: lambda *args: calls.append(1) or kernel(*args),
        )
        out, out_cache = attend(False, batch, cache, q, k, v, num_heads, num_kv_heads, head_dim)
    assert len(calls) == (1 if batch.attn_metadata.num_decode_tokens else 0)
    with monkeypatch.context() as m:
        m.setenv(DISABLE_ENV, "1")
        ref, ref_cache = attend(False, batch, cache, q, k, v, num_heads, num_kv_heads, head_dim)
    assert torch.equal(out_cache, ref_cache)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_whole_step_bf16_close_to_fp32(kernel, monkeypatch):
    batch, cache, gen = random_step(CASES["mixed"], 2, 64, torch.float32, seed=5)
    t = batch.input_ids.shape[0]
    q, k, v = (torch.randn(t, n * 64, generator=gen) for n in (8, 2, 2))
    with monkeypatch.context() as m:
        m.setenv(DISABLE_ENV, "1")
        ref, _ = attend(False, batch, cache, q, k, v, 8, 2, 64)
    out, _ = attend(False, batch, cache.bfloat16(), q.bfloat16(), k.bfloat16(), v.bfloat16(), 8, 2, 64)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_never_reads_past_a_context(kernel, dtype, monkeypatch):
    """The runner leaves fresh blocks unzeroed for kernel layers: NaN past each
    context's end, in the rest of its last block, must not reach the output."""
    q, cache, meta = _random_case(8, 2, 32, 16, dtype, seed=4)
    clean = cache.clone()
    for i, ctx in enumerate(CONTEXT_LENS):
        table = meta.decode_block_table[i]
        last = table[(ctx - 1) // 16]
        cache[:, last, (ctx - 1) % 16 + 1 :] = float("nan")
        clean[:, last, (ctx - 1) % 16 + 1 :] = 0
    out = kernel(q, cache, meta.decode_block_table, meta.decode_context_lens, 32**-0.5)
    assert torch.isfinite(out).all()
    ref = _torch_path(q.float(), clean.float(), meta, 8, 2, 32, monkeypatch)
    torch.testing.assert_close(out.float(), ref, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=8e-3)

    attn = Attention(8, 2, 32, scale=32**-0.5)
    attn.kv_cache = cache
    assert not attn.reads_unwritten_slots()
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert attn.reads_unwritten_slots(), "the torch path reads padding: its fresh blocks must be zeroed"


def test_kernel_rejects_out_of_range_blocks(kernel):
    q, cache, meta = _random_case(8, 2, 32, 16, torch.float32, seed=2)
    table = meta.decode_block_table.clone()
    table[0, 0] = cache.shape[1]
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(q, cache, table, meta.decode_context_lens, 0.1)


def test_disable_env_forces_fallback(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert get_paged_decode_kernel() is None


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    # GQA (4 query heads per kv head), head_dim 32.
    return make_tiny_model(
        "llama", tmp_path_factory.mktemp("gqa") / "m", seed=11, num_attention_heads=8, num_key_value_heads=2
    )


def _greedy(model, prompts, max_tokens, **engine_args):
    """Greedy outputs, generated twice in one engine: the second pass finds
    every prompt's full blocks in the prefix cache and prefills only the rest."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(model), dtype="float32", kv_cache_memory_bytes=64 << 20, **engine_args) as llm:
        passes = [
            [
                o.outputs[0].token_ids
                for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            ]
            for _ in range(2)
        ]
        hits = llm.llm_engine.stats()["prefix_cache_hits"]
    assert passes[0] == passes[1]
    assert hits > 0, "the second pass found nothing in the prefix cache"
    return passes[0]


@pytest.mark.parametrize("budget", [None, 40])
def test_generation_with_kernel_matches_fallback_and_hf(kernel, gqa_model, budget, monkeypatch):
    """budget 40: prompts are prefilled in chunks, most steps mix decodes,
    fresh prefills and later chunks with context."""
    gen = torch.Generator().manual_seed(0)
    # Lengths around the block size, so contexts cross block boundaries while decoding.
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (1, 5, 15, 16, 17, 40, 90)]
    max_tokens = 24
    with_kernel = _greedy(gqa_model, prompts, max_tokens, max_num_batched_tokens=budget)
    monkeypatch.setenv(DISABLE_ENV, "1")
    without_kernel = _greedy(gqa_model, prompts, max_tokens, max_num_batched_tokens=budget)
    assert with_kernel == without_kernel
    assert with_kernel == [r.token_ids for r in hf_greedy(gqa_model, prompts, max_tokens)]


def test_kernels_are_ready_once_the_engine_has_started(gqa_model):
    """A fresh process: the CPU kernels are built or loaded while LLM(...)
    starts, so a server's first request never waits for the compiler."""
    script = textwrap.dedent(
        f"""
        import raylm.model.layers.cpu_kernels as ck
        from raylm import LLM
        with LLM({str(gqa_model)!r}, dtype="float32", kv_cache_memory_bytes=16 << 20):
            print("READY", ck._attempted, ck._module is not None)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=True)
    assert "READY True True" in out.stdout, out.stdout + out.stderr
