"""The Llama family (Llama, Mistral, Qwen2, Qwen3) in one implementation built
from tensor-parallel layers, split into pipeline stages by decoder layer.

Tokens are flat ([T], no batch dim). A non-last pipeline stage returns its
intermediate state, one tensor [2, T, hidden] = stack(hidden_states, residual),
which the next stage passes back in as `intermediate`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from contextlib import contextmanager

import torch
from torch import nn

from raylm.distributed.parallel_state import get_pp_group
from raylm.model.arch_config import ArchConfig
from raylm.model.layers.activation import SiluAndMul
from raylm.model.layers.attention import Attention
from raylm.model.layers.embedding import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding
from raylm.model.layers.layernorm import RMSNorm
from raylm.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    WeightSource,
    default_weight_loader,
)
from raylm.model.layers.rotary import RotaryEmbedding
from raylm.model.llama_decode import FusedDecode

logger = logging.getLogger(__name__)

PP_PARTITION_ENV = "RAYLM_PP_LAYER_PARTITION"

# checkpoint projection -> (our merged parameter, shard id)
_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the decoder layers this pipeline stage owns."""
    spec = os.environ.get(PP_PARTITION_ENV)
    if spec:
        try:
            counts = [int(part) for part in spec.split(",")]
        except ValueError:
            raise ValueError(f"{PP_PARTITION_ENV}={spec!r} is not a comma-separated list of integers") from None
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"{PP_PARTITION_ENV}={spec!r} must list {pp_size} positive layer counts "
                f"summing to num_hidden_layers={num_layers}"
            )
    else:
        if num_layers < pp_size:
            raise ValueError(f"cannot split {num_layers} layers over {pp_size} pipeline stages")
        counts = [num_layers // pp_size] * pp_size
        counts[-1] += num_layers % pp_size
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class PPMissingLayer(nn.Module):
    """Placeholder for a part another pipeline stage owns; keeps layer indices
    (and therefore parameter names) equal to the checkpoint's."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer lives on another pipeline stage")


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = arch.head_dim
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            bias=arch.attention_bias,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            arch.num_attention_heads * arch.head_dim, arch.hidden_size, bias=arch.o_proj_bias
        )
        # Shared by all layers, so kept out of the module tree (one cache, not one per layer).
        self._rotary = [rotary]
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            num_tokens = q.shape[0]
            # One row per head: the rows the fused norm kernel takes (and decode_layers.cpp).
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, -1)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, -1)
        q, k = self._rotary[0](positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous()))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        size = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [size, size], bias=arch.mlp_bias)
        self.down_proj = RowParallelLinear(size, arch.hidden_size, bias=arch.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, rotary)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = LlamaMLP(arch)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of the previous block is fused into this block's first norm.
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.start_layer, self.end_layer = pp_layer_range(arch.num_hidden_layers, pp.rank_in_group, pp.world_size)
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        self.embed_tokens = (
            VocabParallelEmbedding(arch.vocab_size, arch.hidden_size) if self.is_first_stage else PPMissingLayer()
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, self.rotary_emb) if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if self.is_last_stage else PPMissingLayer()
        self.hidden_size, self.intermediate_size = arch.hidden_size, arch.intermediate_size
        # Not a module: it holds no weights of its own, only this model's.
        self._fused_decode = [FusedDecode(self)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if self.is_first_stage:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            if intermediate is None:
                raise ValueError("a non-first pipeline stage needs the previous stage's intermediate state")
            hidden_states, residual = intermediate[0], intermediate[1]
        fused = self._fused_decode[0](hidden_states, residual, positions)
        if fused is not None:
            hidden_states, residual = fused
        else:
            for layer in self.layers[self.start_layer : self.end_layer]:
                hidden_states, residual = layer(positions, hidden_states, residual)
        if not self.is_last_stage:
            return torch.stack((hidden_states, residual))
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM. forward(input_ids [T], positions [T], intermediate)
    returns the final hidden states [T, H] on the last pipeline stage and the
    intermediate state [2, T, H] elsewhere; compute_logits maps hidden [N, H] to
    float32 logits [N, vocab_size]."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.arch, self.dtype = arch, dtype
        with _default_dtype(dtype):
            self.model = LlamaModel(arch)
            if not self.model.is_last_stage:
                self.lm_head = PPMissingLayer()
            elif arch.tie_word_embeddings and self.model.is_first_stage:
                self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size)
                self.lm_head.weight = self.model.embed_tokens.weight
                self.lm_head.shares_embedding = True
            else:
                self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size)
        self.logits_processor = LogitsProcessor(arch.vocab_size)

    @property
    def is_last_stage(self) -> bool:
        return self.model.is_last_stage

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.is_last_stage:
            raise RuntimeError("logits are computed on the last pipeline stage only")
        return self.logits_processor(self.lm_head, hidden_states)

    def greedy_decode_steps(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        steps: int,
    ) -> torch.Tensor | None:
        """[steps, rows] tokens of greedy decode steps run in one call, each
        step's tokens the next one's input (FusedDecode.greedy_steps); None
        where they cannot run so: the caller runs them one by one."""
        if not (self.model.is_first_stage and self.is_last_stage):
            return None
        return self.model._fused_decode[0].greedy_steps(
            self.lm_head,
            self.logits_processor.vocab_size,
            tokens,
            positions,
            block_table,
            context_lens,
            block_size,
            steps,
        )

    def make_empty_intermediate(self, num_tokens: int, device: torch.device | str | None = None) -> torch.Tensor:
        """A receive buffer for the previous stage's intermediate state."""
        return torch.empty(2, num_tokens, self.arch.hidden_size, dtype=self.dtype, device=device)

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Copy HF-named checkpoint weights into our (merged, sharded) parameters."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, object]] = set()
        tied_head = self.arch.tie_word_embeddings and self.is_last_stage and not self.model.is_first_stage
        for name, weight in weights:
            target = self._route(name, tied_head)
            if target is None:
                continue
            param_name, shard_id = target
            if param_name not in params:
                raise ValueError(f"checkpoint weight {name!r} has no parameter in {type(self).__name__}")
            param = params[param_name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, weight, shard_id)
            except ValueError as e:
                raise ValueError(f"cannot load {name!r} into {param_name!r}: {e}") from e
            loaded.add((param_name, shard_id))
        self._check_all_loaded(params, loaded)

    def _route(self, name: str, tied_head: bool) -> tuple[str, object] | None:
        """Our (parameter, shard id) for a checkpoint name, or None when this rank skips it."""
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name.startswith("model.embed_tokens."):
            if tied_head:  # this last stage keeps its own copy of the shared matrix
                return "lm_head.weight", None
            return (name, None) if self.model.is_first_stage else None
        if name.startswith("lm_head."):
            # When tied, the head comes from embed_tokens (shared, or copied on a last
            # stage); some tied checkpoints still carry a redundant lm_head.weight.
            if not self.is_last_stage or self.arch.tie_word_embeddings:
                return None
            return name, None
        if name.startswith("model.norm."):
            return (name, None) if self.is_last_stage else None
        match = _LAYER_INDEX.match(name)
        if match is None:
            raise ValueError(f"unknown checkpoint weight {name!r}")
        if not self.model.start_layer <= int(match.group(1)) < self.model.end_layer:
            return None
        for checkpoint_part, (our_part, shard_id) in _STACKED.items():
            if f".{checkpoint_part}." in name:
                return name.replace(f".{checkpoint_part}.", f".{our_part}."), shard_id
        return name, None

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[tuple[str, object]]) -> None:
        expected_shards = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}
        missing = []
        for param_name in params:
            merged = param_name.split(".")[-2]
            shards = expected_shards.get(merged, (None,))
            for shard in shards:
                if (param_name, shard) not in loaded:
                    missing.append(param_name if shard is None else f"{param_name}[{shard}]")
        if missing:
            raise ValueError(f"checkpoint left {len(missing)} parameter(s) unloaded: {', '.join(missing[:10])}")


class MistralForCausalLM(LlamaForCausalLM):
    """Llama without biases; sliding-window configs are rejected by ArchConfig."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v bias (ArchConfig.attention_bias)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with per-head RMSNorm on q and k before rotary (ArchConfig.qk_norm)."""
