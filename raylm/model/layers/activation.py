"""The gated activation of the Llama MLP: silu(gate) * up on the merged
gate_up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raylm.model.layers.cpu_kernels import elementwise_kernels_for


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        kernels = elementwise_kernels_for(gate_up)
        if kernels is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
            # One pass instead of three (silu, the product, and their temporaries).
            return kernels.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
