"""Adapter slots of one linear layer, and the step's LoRA delta for the
whole batch, segmented by adapter.

A layer holds `max_loras` slots; a slot holds one adapter's A and B for each
part of the layer (q, k, v of qkv_proj; gate and up of gate_up_proj; the one
part of o_proj and down_proj), padded to max_lora_rank with zeros, the
scaling folded into B. Stacked over slots and parts:

    A: [S * P * R, in]      B: [S * P * R, out]

so that for the step's rows x [T, in] and its mask [T, S] (row t runs with
slot s), each slot s that some row uses adds

    delta[rows of s] = x[rows of s] A_s^T B_s

two matmuls per adapter in the step, over its own rows only (segmented by
adapter): a row never reads another adapter's numbers, and the cost is one
adapter's LoRA FLOPs a row, however many slots the layer has. A step whose
rows all run one adapter (batch-1 decode) is two plain matmuls.

Under tensor parallelism a slot is sharded as its base layer: a
column-parallel layer keeps A whole and its rows of B (through the layer's
own weight loader, so the q/k/v head split and the KV-head replicas are the
layer's); a row-parallel layer keeps its columns of A and B whole, and its
partial delta joins the partial product before the all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from raylm.model.forward_context import get_attention_metadata

# (module attribute path inside a decoder layer, its parts in order: the
# projection names of PEFT, each with its shard id in the layer's weight loader)
LAYER_PARTS: dict[str, tuple[tuple[str, object], ...]] = {
    "self_attn.qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "self_attn.o_proj": (("o_proj", None),),
    "mlp.gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    "mlp.down_proj": (("down_proj", None),),
}


def lora_segments(mask: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
    """The step's adapters from its row mask [rows, slots]: (slot, the rows
    that run with it; None when every row does), once a step for every layer."""
    used = mask.any(0).nonzero().flatten().tolist()
    if len(used) == 1 and bool(mask[:, used[0]].all()):
        return [(used[0], None)]
    return [(slot, mask[:, slot].nonzero().flatten()) for slot in used]


class LoRALinearSlots:
    """The slots of one linear layer (installed as `layer.lora`)."""

    def __init__(self, layer: nn.Module, parts: tuple[tuple[str, object], ...], num_slots: int, max_rank: int):
        self.layer, self.parts = layer, parts
        self.num_slots, self.max_rank = num_slots, max_rank
        self.row_parallel = layer.tp_dim == 1
        dtype = layer.weight.dtype  # the model's (a packed or quantized weight keeps it, empty)
        rows = num_slots * len(parts) * max_rank
        device = layer.weight.device
        self.a = torch.zeros(rows, layer.input_size_per_partition, dtype=dtype, device=device)
        self.b = torch.zeros(rows, layer.output_size_per_partition, dtype=dtype, device=device)

    def _rows(self, slot: int, part: int) -> slice:
        start = (slot * len(self.parts) + part) * self.max_rank
        return slice(start, start + self.max_rank)

    def clear(self, slot: int) -> None:
        for part in range(len(self.parts)):
            self.a[self._rows(slot, part)] = 0
            self.b[self._rows(slot, part)] = 0

    def set_part(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Put one projection of an adapter (A [r, in], B [out, r], unsharded,
        float32) into `slot`: this rank's shard, B scaled."""
        shard_id = self.parts[part][1]
        if self.row_parallel:
            a = self._through_loader(a, shard_id)  # this rank's input columns of A
        else:
            b = self._through_loader(b, shard_id)  # this rank's output rows of B
        rows = self._rows(slot, part)
        self.a[rows] = 0
        self.b[rows] = 0
        used = slice(rows.start, rows.start + a.shape[0])
        self.a[used] = a.to(self.a.device, self.a.dtype)
        self.b[used] = (b.t() * scaling).to(self.b.device, self.b.dtype)

    def _through_loader(self, full: torch.Tensor, shard_id: object) -> torch.Tensor:
        """This rank's shard of `full`, cut by the base layer's own weight
        loader into a buffer of the shard's shape (row-parallel: A's
        columns; column-parallel: the part's rows of B at their offset)."""
        layer = self.layer
        if self.row_parallel:
            shape = (full.shape[0], layer.input_size_per_partition)
        else:
            shape = (layer.output_size_per_partition, full.shape[1])
        buffer = nn.Parameter(torch.zeros(shape, dtype=torch.float32), requires_grad=False)
        type(layer).weight_loader(layer, buffer, full, shard_id)
        return buffer.data

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        segments = None if meta is None else meta.lora_segments  # set with lora_mask, once a step
        if not segments:
            return y  # every row runs the base model
        # One product per adapter the step uses, over its own rows only: the
        # cost is one adapter's LoRA FLOPs a row, however many slots the layer
        # has or adapters the batch mixes (a row never meets another
        # adapter's numbers).
        a = self.a.view(self.num_slots, -1, self.a.shape[1])
        b = self.b.view(self.num_slots, -1, self.b.shape[1])
        if segments[0][1] is None:  # every row runs one adapter
            slot = segments[0][0]
            return y + (x @ a[slot].t()) @ b[slot]
        delta = torch.zeros_like(y)
        for slot, rows in segments:
            delta.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].t()) @ b[slot])
        return y + delta
