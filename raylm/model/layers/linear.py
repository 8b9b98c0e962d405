"""Linear layers split over the tensor-parallel group (Megatron style).

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)`
that copies only this rank's slice; `loaded_weight` may be a tensor or a lazy
safetensors slice, so a rank reads from disk only the rows/columns it keeps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raylm.distributed.parallel_state import get_tp_group
from raylm.model.layers import cpu_gemm
from raylm.model.layers.quant_linear import QuantizedMatmul
from raylm.model.quantization import is_quantized

# A torch.Tensor or a safetensors PySafeSlice: both support get-shape and [a:b] indexing.
WeightSource = Any


def weight_shape(loaded_weight: WeightSource) -> tuple[int, ...]:
    if isinstance(loaded_weight, torch.Tensor):
        return tuple(loaded_weight.shape)
    return tuple(loaded_weight.get_shape())


def read_narrow(loaded_weight: WeightSource, dim: int, start: int, size: int) -> torch.Tensor:
    """Read rows (dim 0) or columns (dim 1) [start, start+size) and nothing more."""
    if dim == 0:
        return loaded_weight[start : start + size]
    if dim == 1:
        return loaded_weight[:, start : start + size]
    raise ValueError(f"cannot narrow dim {dim}")


def read_full(loaded_weight: WeightSource) -> torch.Tensor:
    return loaded_weight if isinstance(loaded_weight, torch.Tensor) else loaded_weight[:]


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not fit parameter shape {tuple(dst.shape)}")
    dst.copy_(src)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def default_weight_loader(param: nn.Parameter, loaded_weight: WeightSource, shard_id: Any = None) -> None:
    """For replicated parameters (norms, a row-parallel bias): every rank takes it all."""
    copy_checked(param.data, read_full(loaded_weight), "replicated parameter")


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size, self.tp_dim = tp.rank_in_group, tp.world_size, tp_dim
        # This rank's sizes (the weight may be packed or quantized away later).
        self.input_size_per_partition, self.output_size_per_partition = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # Set by pack_weights() after loading (CPU bf16 only).
        self.packed_weight: cpu_gemm.PackedWeight | None = None
        # Weight rows that came quantized (GGUF blocks, int8), by first row, kept
        # as they are; finish_loading() turns them into quant_matmul.
        self._quantized_rows: dict[int, Any] = {}
        self.quant_matmul: QuantizedMatmul | None = None
        # LoRA adapters' slots (raylm.lora.layers), set with enable_lora:
        # lora(x, y) adds the step's per-row adapter deltas to y. Called
        # before a row-parallel all-reduce, so each rank adds its share.
        self.lora = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource, shard_id: Any = None) -> None:
        raise TypeError(f"{type(self).__name__} has no weight loader")

    def store_rows(self, param: nn.Parameter, offset: int, size: int, src: WeightSource, what: str) -> None:
        """Put `src` in rows [offset, offset + size) of param; a quantized weight stays quantized."""
        if not is_quantized(src):
            copy_checked(param.data.narrow(0, offset, size), src, what)
            return
        if param is not self.weight:
            raise ValueError(f"{what}: only a weight can be quantized, not {src!r}")
        if tuple(src.shape) != (size, param.shape[1]):
            raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not fit ({size}, {param.shape[1]})")
        self._quantized_rows[offset] = src.materialize()

    def finish_loading(self) -> None:
        """After load_weights: quantized rows become the layer's matmul, and the
        float weight (never written, so never resident) is dropped."""
        if self._quantized_rows:
            self.quant_matmul = QuantizedMatmul.build(self.weight.data, self._quantized_rows)
            self._quantized_rows = {}
            self.weight.data = self.weight.data.new_empty(0)

    def pack_weights(self) -> None:
        if self.quant_matmul is None:
            self.packed_weight = cpu_gemm.pack_weight(self.weight.data)
            if self.packed_weight is not None:
                # The packed copies serve every call; the plain matrix would be a third.
                self.weight.data = self.weight.data.new_empty(0)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_matmul is not None:
            y = self.quant_matmul(x, bias)
        else:
            y = cpu_gemm.linear(x, self.weight, bias, self.packed_weight)
        return y if self.lora is None else self.lora(x, y)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's output rows split across ranks; each rank returns its slice
    of the output unless `gather_output`."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False):
        tp_size = get_tp_group().world_size
        super().__init__(input_size, divide(output_size, tp_size, "output size"), bias, tp_dim=0)
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource, shard_id: Any = None) -> None:
        size = param.shape[0]
        shard = read_narrow(loaded_weight, 0, self.tp_rank * size, size)
        self.store_rows(param, 0, size, shard, "column-parallel shard")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return get_tp_group().all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs (gate and up) in one matmul; each rank holds
    its slice of every part, laid side by side."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource, shard_id: Any = None) -> None:
        shard_size = divide(self.output_sizes[shard_id], self.tp_size, "merged output size")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        self.store_rows(
            param,
            offset,
            shard_size,
            read_narrow(loaded_weight, 0, self.tp_rank * shard_size, shard_size),
            f"merged shard {shard_id}",
        )


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, split by heads. With more ranks than KV
    heads, each KV head is replicated on the ranks whose q heads use it."""

    def __init__(
        self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int, bias: bool = False
    ):
        tp_size = get_tp_group().world_size
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp_size, total_num_kv_heads, "num_key_value_heads")
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource, shard_id: Any = None) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
        elif shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            size = kv_size
            start = (self.tp_rank // self.kv_replicas) * kv_size
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        shard = read_narrow(loaded_weight, 0, start, size)
        self.store_rows(param, offset, size, shard, f"{shard_id} shard")


class RowParallelLinear(LinearBase):
    """y = x W^T with W's input columns split across ranks; partial sums are
    all-reduced, and the bias is added once, after the reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp_size = get_tp_group().world_size
        super().__init__(divide(input_size, tp_size, "input size"), output_size, bias, tp_dim=1)
        if bias:
            self.bias.weight_loader = default_weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource, shard_id: Any = None) -> None:
        size = param.shape[1]
        shard = read_narrow(loaded_weight, 1, self.tp_rank * size, size)
        self.store_rows(param, 0, param.shape[0], shard, "row-parallel shard")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        y = get_tp_group().all_reduce(self.matmul(x, None))
        return y + self.bias if self.bias is not None else y
