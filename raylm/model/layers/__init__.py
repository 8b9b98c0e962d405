"""Building blocks of the models: parallel linear layers (linear; quant_linear
and quant_kernels for quantized weights; cpu_gemm for bf16 weights packed for
the CPU kernels), vocab-parallel embedding and LM head, paged attention (torch
SDPA or the C++ decode kernel on CPU; gpu_attention on CUDA), context
parallelism's split prefill and exact merge of attention shards (cp_prefill,
attention_merge), rotary embedding, RMSNorm and the gated activation.

The C++ CPU kernels live in csrc/ (paged decode attention, fused elementwise
ops, bf16/int8/GGUF-quantized matmuls, a decode step's layers in one call,
greedy decode). cpu_kernels.py compiles them into one extension module with
torch's JIT builder at first use, once per machine and environment, under
~/.cache/raylm/torch_extensions (or $TORCH_EXTENSIONS_DIR), and loads it;
without a compiler (or with RAYLM_DISABLE_CPU_KERNELS=1) callers keep the
torch path.
"""
