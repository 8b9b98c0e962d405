"""The decoder layers of a decode step in one C++ call (csrc/decode_layers.cpp).

A decode step of a small batch on CPU does little arithmetic per layer, and
running a layer from Python costs ~20 operator dispatches: on the ~7M model
that is most of the step, on the ~111M one a tenth of it. When a step can be
served this way (CPU, bfloat16 weights packed for the decode kernel, one
tensor-parallel rank, every token a decode, at most as many as the bf16
kernel serves (cpu_gemm.kernel_max_rows), or PACKED_MAX_ROWS with quantized
weights),
the layers run in one call of the same kernels, so the result is the same to
the bit; otherwise LlamaModel runs its modules as usual. Layers whose weights
came GGUF-quantized run the same way in csrc/quant_decode.cpp's
quant_decode_layers (each matmul a stack of quantized or bf16 row segments).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from raylm.distributed.parallel_state import get_tp_group
from raylm.model.forward_context import get_attention_metadata
from raylm.model.layers import cpu_gemm, quant_kernels
from raylm.model.layers.cpu_kernels import get_cpu_kernels
from raylm.model.layers.linear import LinearBase

# RAYLM_FUSED_DECODE=0 runs every step module by module (to compare, or to
# rule this path out when chasing a problem). Worker processes read it too.
FUSED_DECODE_ENV = "RAYLM_FUSED_DECODE"
ENABLED = os.environ.get(FUSED_DECODE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _decode_layout(linear: LinearBase) -> torch.Tensor | None:
    packed = linear.packed_weight
    return None if packed is None else packed.decode_layout


def _optional(t: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if t is None else t


_EMPTY = torch.empty(0)


def _quantized_layer_params(layer: nn.Module, cache: torch.Tensor) -> list[torch.Tensor] | None:
    """A LlamaDecoderLayer with quantized weights in quant_decode_layers' order, or None."""
    attn = layer.self_attn
    linears = []
    for linear in _linears(layer):
        if linear.quant_matmul is not None:
            slots = linear.quant_matmul.decode_slots()
        else:
            # A float weight beside quantized ones (e.g. rows that are not whole
            # blocks) as one bf16 segment; only without a bias, which the module
            # path adds inside bf16_linear and quant_decode_layers after it.
            layout = _decode_layout(linear)
            slots = (
                None
                if layout is None or linear.bias is not None
                else [torch.tensor([[-1, _layout_rows(linear)]], dtype=torch.int64), layout, *[_EMPTY] * 2]
            )
        if slots is None:
            return None
        linears.append([*slots, _optional(linear.bias)])
    qkv, o, gate_up, down = linears
    return [
        layer.input_layernorm.weight.data,
        *qkv,
        _optional(None if attn.q_norm is None else attn.q_norm.weight.data),
        _optional(None if attn.k_norm is None else attn.k_norm.weight.data),
        *o,
        layer.post_attention_layernorm.weight.data,
        *gate_up,
        *down,
        cache,
    ]


def _layer_params(layer: nn.Module) -> list[torch.Tensor] | None:
    """A LlamaDecoderLayer's tensors in decode_layers.cpp's order (or, for
    quantized weights, quant_decode_layers'), or None when it cannot run there."""
    attn, mlp = layer.self_attn, layer.mlp
    cache = attn.attn.kv_cache
    if cache is None or cache.dtype != torch.bfloat16 or attn.attn._decode_kernel(torch.bfloat16) is None:
        return None
    if _is_quantized(layer):
        return _quantized_layer_params(layer, cache)
    layouts = [_decode_layout(linear) for linear in _linears(layer)]
    if (
        any(layout is None for layout in layouts)
        or cache is None
        or cache.dtype != torch.bfloat16
        or attn.attn._decode_kernel(torch.bfloat16) is None
    ):
        return None
    qkv, o, gate_up, down = layouts
    return [
        layer.input_layernorm.weight.data,
        qkv,
        _optional(attn.qkv_proj.bias),
        _optional(None if attn.q_norm is None else attn.q_norm.weight.data),
        _optional(None if attn.k_norm is None else attn.k_norm.weight.data),
        o,
        _optional(attn.o_proj.bias),
        layer.post_attention_layernorm.weight.data,
        gate_up,
        _optional(mlp.gate_up_proj.bias),
        down,
        _optional(mlp.down_proj.bias),
        cache,
    ]


def _layout_rows(linear: LinearBase) -> int:
    return linear.packed_weight.out_features


def _linears(layer: nn.Module) -> tuple[LinearBase, ...]:
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)


def _is_quantized(layer: nn.Module) -> bool:
    return any(linear.quant_matmul is not None for linear in _linears(layer))


class FusedDecode:
    """Runs a LlamaModel's own layers for a decode step, when the step allows."""

    def __init__(self, model: nn.Module):
        self._model = model
        self._layers: list[nn.Module] | None = None  # this stage's decoder layers
        self._params: list[torch.Tensor] | None = None
        self._quantized = False  # whether _params are quant_decode_layers'
        self._caches: list[torch.Tensor | None] = []  # the KV caches _params were built with
        self._shape_args: tuple | None = None  # the kernel's other arguments, see _model_shape_args

    def _current_params(self) -> list[torch.Tensor] | None:
        if self._layers is None:
            self._layers = list(self._model.layers)[self._model.start_layer : self._model.end_layer]
            # The layers' Attention modules, looked up once (each hop through
            # nn.Module.__getattr__ costs, and this runs every step).
            self._attns = [layer.self_attn.attn for layer in self._layers]
        # Checked every step (cheaply: a plain attribute per layer), since the
        # runner binds the caches after the model is built.
        caches = [attn.kv_cache for attn in self._attns]
        if len(caches) == len(self._caches) and all(c is old for c, old in zip(caches, self._caches)):
            return self._params
        self._caches = caches
        per_layer = [_layer_params(layer) for layer in self._layers]
        kinds = {_is_quantized(layer) for layer in self._layers}  # one kernel serves all layers, or none
        self._params = (
            None if any(p is None for p in per_layer) or len(kinds) != 1 else [t for p in per_layer for t in p]
        )
        self._quantized = kinds == {True}
        self._shape_args = self._model_shape_args()
        return self._params

    def _model_shape_args(self) -> tuple | None:
        """The kernel's arguments after the layers' tensors (rotary tables, head
        counts, sizes, eps, scale): the same every step, so looked up with the
        params rather than through a dozen module attributes per step. None
        when the rotary tables are not float32 (the kernel reads them so)."""
        first = self._layers[0]
        attn, rotary = first.self_attn, self._model.rotary_emb
        if rotary.cos_cache.dtype != torch.float32:
            return None
        sizes = (
            (self._model.hidden_size,) if self._quantized else (self._model.hidden_size, self._model.intermediate_size)
        )
        return (
            rotary.cos_cache,
            rotary.sin_cache,
            self._params,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            *sizes,
            first.input_layernorm.eps,
            attn.attn.scale,
        )

    def __call__(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after the stage's layers, or None: run the modules."""
        meta = get_attention_metadata()
        num_tokens = hidden.shape[0]
        if (
            meta is None
            or meta.prefills
            or meta.num_decode_tokens != num_tokens
            or meta.decode_context_lens is None
            # Under CP a rank holds a shard of each context: its partial
            # attention must be merged over the ranks, which the fused loop does not.
            or meta.context_parallel is not None
            # The fused layers apply no LoRA delta: such steps run the modules.
            or meta.lora_mask is not None
            or hidden.dtype != torch.bfloat16
            or not hidden.is_cpu
            or positions.dtype != torch.int64
        ):
            return None
        kernels = self._kernels_for(num_tokens)
        if kernels is None:
            return None
        run = kernels.quant_decode_layers if self._quantized else kernels.decode_layers
        return run(
            hidden.contiguous(),
            _EMPTY if residual is None else residual.contiguous(),
            positions.contiguous(),
            meta.slot_mapping,
            meta.decode_block_table,
            meta.decode_context_lens,
            *self._shape_args,
        )

    def _kernels_for(self, num_tokens: int):
        """The kernel module when a decode step of `num_tokens` tokens runs here
        (self._params and self._shape_args then set), else None."""
        if not ENABLED or not 0 < num_tokens <= quant_kernels.PACKED_MAX_ROWS or get_tp_group().world_size != 1:
            return None
        params = self._current_params()
        kernels = get_cpu_kernels()
        if params is None or kernels is None or self._shape_args is None:
            return None
        # The bf16 decode kernel takes the rows it serves best
        # (cpu_gemm.kernel_max_rows: 4 where the CPU has bf16 arithmetic,
        # past which oneDNN's GEMM on OpenMP serves the module path better; 64
        # on AVX2). The quantized one serves every row count its packed tiles
        # do. Both run on the work team: run module by module, each norm and
        # attention between two of its matmuls would open an OpenMP region
        # while the team spins (16 rows of the ~111M Q4_K_M model: a step of
        # 20-24 ms, against 23-26 ms module by module; 64 rows of the ~111M
        # bf16 model on AVX2: 190-195 ms module by module, 134 ms here).
        if not self._quantized and num_tokens > cpu_gemm.kernel_max_rows():
            return None
        if self._quantized and not hasattr(kernels, "quant_decode_layers"):
            return None
        return kernels

    def greedy_steps(
        self,
        lm_head: nn.Module,
        vocab_size: int,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        steps: int,
    ) -> torch.Tensor | None:
        """[steps, rows] tokens of `steps` greedy decode steps in one call
        (csrc/greedy_decode.cpp), each step's tokens the next one's input:
        `tokens` are the first step's input, `positions` and `context_lens`
        its own, and `block_table` holds every position of the steps. The
        same kernels as the steps run one by one from Python, so the same
        tokens. None where the model cannot run them so (the caller then
        runs the steps one by one)."""
        model = self._model
        kernels = self._kernels_for(tokens.numel())
        if kernels is None or not hasattr(kernels, "greedy_decode_steps") or not model.is_first_stage:
            return None
        embedding, norm = model.embed_tokens.weight, model.norm
        if embedding.device.type != "cpu" or embedding.dtype != torch.bfloat16 or norm.weight.dtype != torch.bfloat16:
            return None
        head = _lm_head_slots(lm_head, tokens.numel())
        if head is None:
            return None
        shape_args = list(self._shape_args)
        if self._quantized:
            shape_args.insert(7, 0)  # after hidden_size: the intermediate size, which quantized layers do not read
        return kernels.greedy_decode_steps(
            tokens,
            positions,
            block_table,
            context_lens,
            block_size,
            steps,
            embedding.data,
            norm.weight.data,
            norm.eps,
            head,
            vocab_size,
            self._quantized,
            *shape_args,
        )


def _lm_head_slots(lm_head: nn.Module, rows: int) -> list[torch.Tensor] | None:
    """The LM head as csrc's segmented_linear reads it, when its module path
    (LogitsProcessor) runs the same kernel for `rows` rows; else None."""
    if getattr(lm_head, "quant_matmul", None) is not None:
        slots = lm_head.quant_matmul.decode_slots() if rows <= quant_kernels.PACKED_MAX_ROWS else None
    else:
        packed = getattr(lm_head, "packed_weight", None)
        layout = None if packed is None else packed.decode_layout
        slots = (
            None
            if layout is None or rows > cpu_gemm.kernel_max_rows()
            else [torch.tensor([[-1, packed.out_features]], dtype=torch.int64), layout, _EMPTY, _EMPTY]
        )
    return None if slots is None else [*slots, _EMPTY]  # no bias
