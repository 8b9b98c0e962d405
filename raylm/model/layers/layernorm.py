"""RMSNorm computed in float32 and cast back, as Hugging Face does, with an
optional fused residual add (the residual stream is kept in the model dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raylm.model.layers.cpu_kernels import elementwise_kernels_for
from raylm.model.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel for x * rsqrt(mean(x^2) + eps), in float32.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        kernels = self._kernels_for(x, residual)
        if kernels is not None:
            # One pass per row instead of six ops over the whole batch.
            if residual is None:
                return kernels.rms_norm(x, self.weight, self.eps)
            return kernels.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _kernels_for(self, x: torch.Tensor, residual: torch.Tensor | None):
        """The CPU kernels when they take these operands as they are ([rows,
        width] with contiguous rows, all one dtype), else None."""
        if x.dim() != 2 or x.stride(1) != 1 or self.weight.dtype != x.dtype:
            return None
        if residual is not None and (residual.stride(1) != 1 or residual.dtype != x.dtype):
            return None
        return elementwise_kernels_for(x)
