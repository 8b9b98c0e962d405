"""Rotary position embedding, neox style (rotate halves) as in HF Llama, with
default, linear and llama3 frequency scaling; cos/sin cached once in float32."""

from __future__ import annotations

import math

import torch
from torch import nn

from raylm.model.arch_config import RopeScaling
from raylm.model.layers.cpu_kernels import elementwise_kernels_for


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band in between blended.
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim / 2]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        # Not persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, nh*hd], k [T, nkv*hd] -> rotated q, k (same shapes and dtype)."""
        num_tokens = positions.shape[0]
        kernels = self._kernels_for(positions, q, k)
        if kernels is not None:
            # One pass over q and k instead of eight ops and a concatenation.
            return kernels.rotary_neox(positions, q, k, self.cos_cache, self.sin_cache, self.head_dim)
        cos, sin = self._cos_sin(positions, q.dtype)
        q_heads = q.shape[-1] // self.head_dim
        # q and k rotated in one call: they share positions.
        qk = torch.cat((q.view(num_tokens, -1, self.head_dim), k.view(num_tokens, -1, self.head_dim)), dim=1)
        qk = _rotate(qk, cos, sin)
        return qk[:, :q_heads].reshape(num_tokens, -1), qk[:, q_heads:].reshape(num_tokens, -1)

    def _kernels_for(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """The CPU kernels when they take these operands as they are (contiguous
        rows, int64 positions, the float32 caches; a module cast with .to(dtype)
        keeps the torch ops), else None."""
        if (
            q.stride(-1) != 1
            or k.stride(-1) != 1
            or positions.dtype != torch.int64
            or not positions.is_contiguous()
            or self.cos_cache.dtype != torch.float32
        ):
            return None
        return elementwise_kernels_for(q)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer of one forward rotates by the same positions: look them up once.
        cached = getattr(self, "_last", None)
        if cached is not None and cached[0] is positions and cached[1] == dtype:
            return cached[2], cached[3]
        # HF casts cos/sin to the activation dtype before rotating; do the same.
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        self._last = (positions, dtype, cos, sin)
        return cos, sin
