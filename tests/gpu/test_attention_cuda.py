"""The batched paged attention on CUDA tensors (FlashInfer when present, else
SDPA) against the per-sequence CPU path on the same random paged caches."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_gpu_attention_path import CASES, _attend, _random_step


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_batched_path_equals_cpu_path(case, dtype, tol, monkeypatch):
    monkeypatch.setenv("RAYLM_DISABLE_CPU_KERNELS", "1")
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    batch, cache, gen = _random_step(CASES[case], num_kv_heads, head_dim, torch.float32, seed=11)
    t = batch.input_ids.shape[0]
    q, k, v = (torch.randn(t, n * head_dim, generator=gen) for n in (num_heads, num_kv_heads, num_kv_heads))
    ref, _ = _attend(False, batch, cache, q, k, v, num_heads, num_kv_heads, head_dim)
    cuda_batch = _to_cuda(batch)
    out, _ = _attend(
        None,
        cuda_batch,
        cache.to("cuda", dtype),
        *(x.to("cuda", dtype) for x in (q, k, v)),
        num_heads,
        num_kv_heads,
        head_dim,
    )
    torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol)


def _to_cuda(batch):
    import dataclasses

    meta = batch.attn_metadata
    moved = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    for name, value in moved.items():
        if isinstance(value, torch.Tensor):
            moved[name] = value.cuda()
    moved["prefills"] = [
        dataclasses.replace(p, ctx_slots=None if p.ctx_slots is None else p.ctx_slots.cuda()) for p in meta.prefills
    ]
    return dataclasses.replace(batch, attn_metadata=type(meta)(**moved))
