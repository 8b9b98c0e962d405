"""What happens to weights between the checkpoint and the model's loaders when
the model runs quantized.

- `--quantization int8`: every linear-layer weight of a float checkpoint is
  quantized whole (one scale per output row, from the full row, so that every
  tensor-parallel split computes with the same numbers) before it is sharded.
- A quantized GGUF LM head (`output.weight`) stays quantized: the head's
  matmul runs on the quantized kernels like a linear layer's (decode reads it
  every token). Any other quantized tensor that is not a linear layer's weight
  (the token embedding, whose lookup reads one row per token) is dequantized
  to floats, rows as they are read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from raylm.model.quantization.qweight import QuantizedWeight, is_quantized

METHODS = ("int8", "gguf")
# Kept quantized too (ParallelLMHead runs it on the quantized kernels).
QUANTIZED_HEAD = "lm_head.weight"
LINEAR_WEIGHT = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


class DequantizedRows:
    """A quantized tensor read as floats, only the rows indexed."""

    def __init__(self, weight: QuantizedWeight):
        self.weight = weight

    def get_shape(self) -> tuple[int, int]:
        return self.weight.shape

    def __getitem__(self, index) -> torch.Tensor:
        return self.weight[index].dequantize(torch.float32)


def prepare_weights(weights: Iterable[tuple[str, object]], quantization: str | None) -> Iterator[tuple[str, object]]:
    for name, weight in weights:
        linear = bool(LINEAR_WEIGHT.search(name))
        if is_quantized(weight) and not linear and name != QUANTIZED_HEAD:
            weight = DequantizedRows(weight)
        elif quantization == "int8" and linear and not is_quantized(weight):
            full = weight if isinstance(weight, torch.Tensor) else weight[:]
            weight = QuantizedWeight.int8_per_channel(full, name)
        yield name, weight
