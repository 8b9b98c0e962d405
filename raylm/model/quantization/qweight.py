"""QuantizedWeight: one [rows, cols] weight kept in a quantized type, as the
model's weight loaders see it.

It behaves like the other weight sources of raylm/model/layers/linear.py (a
tensor, a lazy safetensors slice): `get_shape()` gives the logical float shape,
`w[a:b]` takes output rows and `w[:, a:b]` input columns, so the same
tensor-parallel loaders split it. Columns split only on block boundaries; a
split inside a block raises ValueError naming the type and the block size.
The data may be a numpy view into a memory-mapped GGUF file: nothing is read
from disk until `materialize()` copies this rank's slice into a tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from raylm.model.quantization.qtypes import QuantType, quant_type


def is_quantized(weight: object) -> bool:
    return isinstance(weight, QuantizedWeight)


class QuantizedWeight:
    def __init__(
        self,
        qtype: QuantType,
        data: np.ndarray | torch.Tensor,
        cols: int,
        scales: torch.Tensor | None = None,
        name: str = "weight",
    ):
        if qtype.name == "INT8":
            if scales is None or tuple(data.shape) != (data.shape[0], cols):
                raise ValueError(f"{name}: int8 weight needs [rows, cols] data and one scale per row")
        elif cols % qtype.block_size:
            raise ValueError(f"{name}: {cols} columns are not whole {qtype.name} blocks of {qtype.block_size}")
        elif data.shape[-1] != qtype.row_bytes(cols):
            raise ValueError(
                f"{name}: {qtype.name} row of {cols} weights needs {qtype.row_bytes(cols)} bytes, "
                f"found {data.shape[-1]}"
            )
        self.qtype, self.data, self.cols, self.scales, self.name = qtype, data, cols, scales, name

    # ---- the weight-source interface of the loaders -------------------------------

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), self.cols)

    def get_shape(self) -> tuple[int, int]:
        return self.shape

    def __getitem__(self, index) -> QuantizedWeight:
        if isinstance(index, slice):
            rows = index
            return self._with(self.data[rows], self.cols, None if self.scales is None else self.scales[rows])
        if (
            isinstance(index, tuple)
            and len(index) == 2
            and index[0] == slice(None)
            and isinstance(index[1], slice)
            and index[1].step in (None, 1)
        ):
            start, stop, _ = index[1].indices(self.cols)
            return self._columns(start, stop)
        raise TypeError(f"{self.name}: a quantized weight is indexed by rows [a:b] or columns [:, a:b] only")

    def _columns(self, start: int, stop: int) -> QuantizedWeight:
        block = self.qtype.block_size
        if start % block or stop % block:
            raise ValueError(
                f"{self.name}: cannot split a {self.qtype.name} weight of {self.cols} columns at column "
                f"{start if start % block else stop}: its blocks hold {block} weights and a tensor-parallel "
                "shard must hold whole blocks (use a tensor_parallel_size that divides the blocks evenly, "
                "or an unquantized/Q8_0 file)"
            )
        size = self.qtype.type_size
        data = self.data[:, start // block * size : stop // block * size]
        return self._with(data, stop - start, self.scales)

    def _with(self, data, cols: int, scales) -> QuantizedWeight:
        return QuantizedWeight(self.qtype, data, cols, scales, self.name)

    def permute_rows(self, order: np.ndarray) -> QuantizedWeight:
        """Rows reordered (whole rows of blocks move, so any type can be)."""
        scales = None if self.scales is None else self.scales[torch.as_tensor(order)]
        return self._with(self.data[order], self.cols, scales)

    # ---- data -----------------------------------------------------------------------

    def materialize(self) -> QuantizedWeight:
        """The same weight with its data copied into contiguous tensors (read from disk now)."""
        data = self.data
        if isinstance(data, np.ndarray):
            data = torch.from_numpy(np.array(data, copy=True))  # out of the read-only memory map
        scales = self.scales.contiguous() if self.scales is not None else None
        return self._with(data.contiguous(), self.cols, scales)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [rows, cols] that these blocks stand for."""
        if self.qtype.name == "INT8":
            return (torch.as_tensor(self.data).float() * self.scales.float()[:, None]).to(dtype)
        from gguf import quants  # the format's own reference decoder

        raw = self.data.numpy() if isinstance(self.data, torch.Tensor) else np.asarray(self.data)
        return torch.from_numpy(quants.dequantize(raw, self.qtype.ggml_type)).to(dtype)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + (0 if self.scales is None else int(self.scales.nbytes))

    @classmethod
    def int8_per_channel(cls, weight: torch.Tensor, name: str = "weight") -> QuantizedWeight:
        """Symmetric int8 with one scale per output row: w ~= q * scale, q in [-127, 127]."""
        w = weight.float()
        scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(quant_type("INT8"), q, w.shape[1], scales, name)

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.name}, {self.qtype.name}, shape={self.shape})"
