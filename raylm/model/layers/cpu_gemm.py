"""Matmuls with weights packed once at load for the CPU kernels that read them (bfloat16).

Two layouts, each for the batch sizes it serves best:
- raylm's own (csrc/bf16_gemm.cpp): tiles of 16 output columns in the pair
  order AVX-512 BF16 multiplies, one sequential stream per thread. For a few
  activation rows (decode), where the time is that of reading every weight
  once: measured here 2.5-2.9x oneDNN's time per token at one row.
- oneDNN's (torch.ops.mkldnn): for more rows (prefill, large decode
  batches), where the matmul is compute-bound and oneDNN's blocking wins.
  A plain bf16 `F.linear` would re-lay the weight out for oneDNN on every
  call; packing once saved 1.3-1.6x on the matmuls of a 7M and a 111M model.

Once packed, a layer needs its plain weight no more (`PackedWeight` keeps
whatever its calls read), so the model holds two copies of each matrix, not
three. Elsewhere (CUDA, float32, a torch without oneDNN and no kernels)
layers keep `F.linear` on the plain weight.

A CPU without AVX-512 (AVX2 only: AMD Zen 1-3, Intel before Skylake-SP and
most desktop parts) has no bfloat16 arithmetic, and oneDNN's bf16 matmul
there is an emulation: measured on a 2-core Zen 3, 10-18 GFLOP/s against
float32's 85-110. There raylm's kernel (its AVX2 path) serves up to
EMULATED_BF16_KERNEL_MAX_ROWS rows (90-127 GFLOP/s at 2-64 rows), and larger
matmuls widen the weight to float32 a slice at a time and run float32's
matmul: the same float accumulation, bf16 in and out.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from raylm.model.layers.cpu_kernels import get_cpu_kernels

logger = logging.getLogger(__name__)

# Activation rows up to which raylm's kernel runs rather than oneDNN's.
# Measured with benchmarks/bench_cpu_gemm.py: raylm's kernel streams the
# weights faster at 1-4 rows; from 8 rows on oneDNN's compute is faster.
DECODE_MAX_ROWS = 4
# The same on a CPU without bfloat16 arithmetic, where oneDNN's bf16 matmul is
# slow at every size: raylm's kernel up to here, float32 above (measured on a
# 2-core Zen 3: the kernel 87-92 GFLOP/s at 64 rows, float32 45-55 at 64 rows
# and 83-89 at 128 once the weight is widened, 85-117 from 256; with its
# panel path, 140-170 at 32-64 rows. It also beat float32 in isolation at
# 128-512 rows, but not inside a prefill, where torch's OpenMP ops between
# the matmuls spin against its threads: a 128-token prompt of the ~111M model
# took 202 ms with float32 there, 259 ms with the kernel).
EMULATED_BF16_KERNEL_MAX_ROWS = 64
# Output columns widened to float32 at a time: a slice of at most this many
# elements (16 MiB), so the temporary stays small whatever the layer's size.
_WIDEN_ELEMENTS = 1 << 22


@functools.cache
def cpu_has_bf16_arithmetic() -> bool:
    """Whether this CPU's matmuls run bfloat16 at full speed: AVX-512 (whose
    oneDNN kernels convert in registers), AVX-512 BF16 or AMX. AVX2-only
    CPUs do not."""
    cpu = torch.cpu
    return any(
        getattr(cpu, probe, lambda: False)()
        for probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )


def kernel_max_rows() -> int:
    """Activation rows up to which bf16 matmuls run raylm's kernel on this CPU."""
    return DECODE_MAX_ROWS if cpu_has_bf16_arithmetic() else EMULATED_BF16_KERNEL_MAX_ROWS


def as_float32(y: torch.Tensor) -> torch.Tensor:
    """y as float32. The bf16 output of raylm's kernel (2-D, at most
    kernel_max_rows() rows) is widened on the kernels' work team, where its
    matmul ran: a .float() there is an OpenMP region, whose thread then spins
    on a core that the team's next matmul wants (the LM head's logits of a
    64-row decode step of the ~7M model on 2 cores: ~10% of the CPU)."""
    if (
        y.dtype == torch.bfloat16
        and y.is_cpu
        and y.dim() == 2
        and 0 < y.shape[0] <= kernel_max_rows()
        and y.stride(1) == 1
    ):
        kernels = get_cpu_kernels()
        if kernels is not None:
            return kernels.widen_rows(y)
    return y.float()


def linear_in_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear of bf16 x and weight, computed in float32 and rounded to bf16:
    for CPUs without bf16 arithmetic. The weight is widened a slice of output
    columns at a time."""
    rows, cols = x.shape[:-1], weight.shape[0]
    flat = x.reshape(-1, x.shape[-1]).float()
    out = torch.empty(flat.shape[0], cols, dtype=x.dtype)
    step = max(1, _WIDEN_ELEMENTS // max(1, weight.shape[1]))
    for start in range(0, cols, step):
        end = min(cols, start + step)
        part_bias = None if bias is None else bias[start:end].float()
        out[:, start:end] = F.linear(flat, weight[start:end].float(), part_bias)
    return out.reshape(*rows, cols)


def _onednn_supported(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _pack_onednn(weight: torch.Tensor, expected_rows: int = 64) -> torch.Tensor | None:
    """The oneDNN-packed copy of a [out, in] weight, or None when unsupported."""
    if not _onednn_supported(weight):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), expected_rows)
        # Check once that the packed path computes the same thing.
        probe = torch.randn(2, weight.shape[1], dtype=weight.dtype)
        if not torch.equal(
            torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], ""), F.linear(probe, weight)
        ):
            return None
        return packed
    except RuntimeError as e:  # an op this torch build lacks
        logger.debug("oneDNN weight packing unavailable: %s", e)
        return None


class PackedWeight:
    """One [out, in] bf16 CPU weight in the layouts its matmuls read.

    `large` serves any number of rows (oneDNN's packing, or the plain weight
    where oneDNN is missing or the CPU has no bf16 arithmetic); `small`, when
    the kernels are built, serves up to DECODE_MAX_ROWS rows
    (EMULATED_BF16_KERNEL_MAX_ROWS without bf16 arithmetic).
    """

    def __init__(self, weight: torch.Tensor):
        self.out_features = weight.shape[0]
        native = cpu_has_bf16_arithmetic()
        self._widen = weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and not native
        self._small_max_rows = kernel_max_rows()
        self._onednn = None if self._widen else _pack_onednn(weight)
        self._plain = weight if self._onednn is None else None
        # raylm's decode layout, where its kernels are built.
        kernels = get_cpu_kernels() if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 else None
        self._kernels = kernels
        self._small = None if kernels is None else kernels.bf16_pack(weight)

    @property
    def decode_layout(self) -> torch.Tensor | None:
        """The weight in bf16_linear's layout, for callers of the kernel (decode_layers)."""
        return self._small

    @property
    def useful(self) -> bool:
        """Whether it does better than F.linear on the plain weight."""
        return self._onednn is not None or self._small is not None or self._widen

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (
            self._small is not None
            and x.dim() == 2
            and x.shape[0] <= self._small_max_rows
            and x.dtype == torch.bfloat16
        ):
            return self._kernels.bf16_linear(x, self._small, self.out_features, bias)
        if self._onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._onednn, bias, "none", [], "")
        if self._widen and x.dtype == torch.bfloat16:
            return linear_in_float32(x, self._plain, bias)
        return F.linear(x, self._plain, bias)


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """The packed form of a [out, in] weight, or None where packing does not help."""
    packed = PackedWeight(weight)
    return packed if packed.useful else None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
) -> torch.Tensor:
    if packed is not None:
        return packed(x, bias)
    return F.linear(x, weight, bias)
