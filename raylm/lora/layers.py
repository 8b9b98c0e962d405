"""Adapter slots of one linear layer, and the step's LoRA delta for the
whole batch in one gathered call.

A layer holds `max_loras` slots; a slot holds one adapter's A and B for each
part of the layer (q, k, v of qkv_proj; gate and up of gate_up_proj; the one
part of o_proj and down_proj), padded to max_lora_rank with zeros, the
scaling folded into B. Stacked over slots and parts:

    A: [S * P * R, in]      B: [S * P * R, out]

so that for the step's rows x [T, in] and its mask [T, S] (row t runs with
slot s):

    delta = where(mask, x A^T, 0) B

is two matmuls whatever the mix of adapters: each row's rank-R product with
its own slot's A, the other slots' columns zeroed (torch.where, not a
product: a row never reads another adapter's numbers), then B. The cost is
S times a single adapter's LoRA FLOPs, small beside the layer's own for
small ranks and slot counts; no per-row weights are gathered.

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
        mask = None if meta is None else meta.lora_mask
        if mask is None:
            return y
        rows = x.shape[0]
        xa = (x @ self.a.t()).view(rows, self.num_slots, -1)
        xa = torch.where(mask[:, :, None], xa, torch.zeros((), dtype=xa.dtype))
        return y + xa.view(rows, -1) @ self.b
