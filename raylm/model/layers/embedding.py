"""Vocabulary-parallel token embedding and LM head, and the logits step that
puts the vocab shards back together for the sampler."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raylm.distributed.parallel_state import get_tp_group
from raylm.model.layers import cpu_gemm
from raylm.model.layers.linear import WeightSource, copy_checked, read_narrow, weight_shape
from raylm.model.layers.quant_linear import QuantizedMatmul
from raylm.model.quantization import is_quantized

# Shards are kept a multiple of 64 rows so every rank's matmul has a friendly shape.
VOCAB_PADDING = 64


def pad_vocab_size(vocab_size: int, tp_size: int) -> int:
    multiple = VOCAB_PADDING * tp_size
    return (vocab_size + multiple - 1) // multiple * multiple


class VocabParallelEmbedding(nn.Module):
    """Rows of the (padded) vocab split across ranks. Each rank embeds the ids in
    its range, writes zeros for the others, and an all-reduce fills in the rest."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.num_embeddings = num_embeddings
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, self.tp_size)
        self.shard_size = self.num_embeddings_padded // self.tp_size
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = self.vocab_start + self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource, shard_id=None) -> None:
        vocab, dim = weight_shape(loaded_weight)
        if vocab != self.num_embeddings:
            raise ValueError(f"checkpoint vocab {vocab} != config vocab_size {self.num_embeddings}")
        # The last shard may hold only padding rows past the real vocab.
        rows = max(0, min(self.vocab_end, vocab) - self.vocab_start)
        param.data[rows:].zero_()
        if rows:
            copy_checked(param.data[:rows], read_narrow(loaded_weight, 0, self.vocab_start, rows), "vocab shard")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * in_shard
        out = F.embedding(local_ids, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return get_tp_group().all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, sharded by vocab rows like the embedding so the two
    can share one weight when the checkpoint ties them."""

    packed_weight: cpu_gemm.PackedWeight | None = None
    # Set by the model when the head is the embedding's matrix (tied weights).
    shares_embedding: bool = False
    # A head that came quantized (a GGUF file's output.weight) stays so.
    quant_matmul: QuantizedMatmul | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("ParallelLMHead is applied through LogitsProcessor, not called directly")

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource, shard_id=None) -> None:
        if not is_quantized(loaded_weight) or self.shares_embedding:
            super().weight_loader(param, loaded_weight, shard_id)
            return
        vocab, _ = weight_shape(loaded_weight)
        if vocab != self.num_embeddings:
            raise ValueError(f"checkpoint vocab {vocab} != config vocab_size {self.num_embeddings}")
        # This rank's vocab rows stay quantized; padding rows past the vocab are float zeros.
        rows = max(0, min(self.vocab_end, vocab) - self.vocab_start)
        param.data[rows:].zero_()
        quantized = {0: loaded_weight[self.vocab_start : self.vocab_start + rows].materialize()} if rows else {}
        self.quant_matmul = QuantizedMatmul.build(param.data, quantized)
        param.data = param.data.new_empty(0)

    def pack_weights(self) -> None:
        if self.quant_matmul is not None:
            return
        self.packed_weight = cpu_gemm.pack_weight(self.weight.data)
        if self.packed_weight is not None and not self.shares_embedding:
            # The packed copies serve every call; a tied matrix stays for the embedding.
            self.weight.data = self.weight.data.new_empty(0)


class LogitsProcessor(nn.Module):
    """hidden [N, H] -> float32 logits [N, vocab_size] on every TP rank, padding trimmed."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, lm_head: ParallelLMHead, hidden_states: torch.Tensor) -> torch.Tensor:
        if lm_head.quant_matmul is not None:
            logits = lm_head.quant_matmul(hidden_states, None)
        else:
            logits = cpu_gemm.linear(hidden_states, lm_head.weight, None, lm_head.packed_weight)
        logits = get_tp_group().all_gather(logits, dim=-1)
        if logits.shape[-1] != self.vocab_size:  # padding rows (a vocab split over TP ranks)
            logits = logits[..., : self.vocab_size]
        return cpu_gemm.as_float32(logits)
