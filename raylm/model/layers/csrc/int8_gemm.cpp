// Matmuls on int8 weights (one scale per output row, `--quantization int8`)
// packed once at load, for CPU decode: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k].
//
// The layout follows bf16_gemm.cpp's, for the same reason (decode streams
// every weight once per token): tiles of 16 output columns, each tile a run
// of k-quads, each k-quad four runs of the 16 columns' weights at one k:
//
//   packed[tile][k / 4][k % 4][column] = q[tile * 16 + column][k]
//
// (zero past N and K). A 64-byte line holds 4 k x 16 columns; each 16-byte
// quarter is widened to 16 floats and multiplied by the broadcast activation. Activations
// stay float, so the result is the float matmul on the dequantized weight up
// to summation order: the same as aten's weight-only int8 matmul computes,
// reading half the bytes of bf16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "huge_pages.h"
#include "kernels.h"
#include "tiled_gemm.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kTileCols = 16;
constexpr int64_t kQuad = 4;                         // k values per column in one 64-byte run
constexpr int64_t kQuadBytes = kTileCols * kQuad;    // 64
constexpr int64_t kMaxRows = 8;

inline int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

struct Block {
  const float* x[kMaxRows];  // activation rows, as floats, padded to whole quads
  int64_t quads;
  const int8_t* tile;
  int64_t tile_stride;  // bytes per tile
  const float* scales;  // of the first tile's columns
  const float* bias;    // or null
  float* out[kMaxRows];
  int64_t cols;  // valid columns from the first tile's first
};

#if defined(__AVX512F__)

template <int ROWS, int TILES>
void block_kernel(const Block& b) {
  __m512 acc[ROWS][TILES];
  for (int m = 0; m < ROWS; ++m)
    for (int t = 0; t < TILES; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int64_t qd = 0; qd < b.quads; ++qd) {
    __m512 w[TILES][kQuad];
    for (int t = 0; t < TILES; ++t) {
      const int8_t* src = b.tile + t * b.tile_stride + qd * kQuadBytes;
      _mm_prefetch(reinterpret_cast<const char*>(src + 16 * kQuadBytes), _MM_HINT_T1);
      for (int j = 0; j < kQuad; ++j)
        w[t][j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * j))));
    }
    for (int m = 0; m < ROWS; ++m) {
      const float* xq = b.x[m] + qd * kQuad;
      for (int j = 0; j < kQuad; ++j) {
        const __m512 xv = _mm512_set1_ps(xq[j]);
        for (int t = 0; t < TILES; ++t) acc[m][t] = _mm512_fmadd_ps(xv, w[t][j], acc[m][t]);
      }
    }
  }
  for (int t = 0; t < TILES; ++t) {
    const int64_t first = t * kTileCols;
    if (first >= b.cols) break;
    const int64_t n = std::min<int64_t>(kTileCols, b.cols - first);
    const __mmask16 mask = n == kTileCols ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const __m512 scale = _mm512_maskz_loadu_ps(mask, b.scales + first);
    const __m512 bias = b.bias ? _mm512_maskz_loadu_ps(mask, b.bias + first) : _mm512_setzero_ps();
    for (int m = 0; m < ROWS; ++m)
      _mm512_mask_storeu_ps(b.out[m] + first, mask, _mm512_fmadd_ps(acc[m][t], scale, bias));
  }
}

#else

template <int ROWS, int TILES>
void block_kernel(const Block& b) {
  float acc[ROWS][TILES * kTileCols] = {};
  for (int64_t qd = 0; qd < b.quads; ++qd)
    for (int t = 0; t < TILES; ++t) {
      const int8_t* src = b.tile + t * b.tile_stride + qd * kQuadBytes;
      for (int m = 0; m < ROWS; ++m) {
        const float* xq = b.x[m] + qd * kQuad;
        float* a = acc[m] + t * kTileCols;
        for (int c = 0; c < kTileCols; ++c)
          for (int j = 0; j < kQuad; ++j) a[c] += xq[j] * float(src[j * kTileCols + c]);
      }
    }
  const int64_t n = std::min<int64_t>(TILES * kTileCols, b.cols);
  for (int m = 0; m < ROWS; ++m)
    for (int64_t c = 0; c < n; ++c) b.out[m][c] = acc[m][c] * b.scales[c] + (b.bias ? b.bias[c] : 0.f);
}

#endif

using KernelFn = void (*)(const Block&);

// One row: four tiles (four memory streams); more rows: two tiles, so the
// widened weights and the accumulators fit the 32 registers.
inline int64_t preferred_tiles(int64_t rows) { return rows == 1 ? 4 : 2; }

template <int ROWS>
KernelFn kernel_with_tiles(int64_t tiles) {
  return tiles >= 4 ? &block_kernel<ROWS, 4> : tiles == 3 ? &block_kernel<ROWS, 3>
         : tiles == 2 ? &block_kernel<ROWS, 2> : &block_kernel<ROWS, 1>;
}

KernelFn kernel_for(int64_t rows, int64_t tiles) {
  switch (rows) {
    case 1: return kernel_with_tiles<1>(tiles);
    case 2: return kernel_with_tiles<2>(tiles);
    case 3: return kernel_with_tiles<3>(tiles);
    case 4: return kernel_with_tiles<4>(tiles);
    case 5: return kernel_with_tiles<5>(tiles);
    case 6: return kernel_with_tiles<6>(tiles);
    case 7: return kernel_with_tiles<7>(tiles);
    default: return kernel_with_tiles<8>(tiles);
  }
}

}  // namespace

at::Tensor int8_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.device().is_cpu(),
              "int8_pack: expected a [out, in] int8 CPU weight");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t tiles = round_up(n, kTileCols) / kTileCols, quads = round_up(k, kQuad) / kQuad;
  at::Tensor packed = raylm::zeros_on_huge_pages({tiles, quads, kQuad, kTileCols}, w.options());
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int8_t* tile = dst + t * quads * kQuadBytes;
      for (int64_t c = 0; c < kTileCols && t * kTileCols + c < n; ++c) {
        const int8_t* row = src + (t * kTileCols + c) * k;
        for (int64_t kk = 0; kk < k; ++kk) tile[(kk / kQuad) * kQuadBytes + (kk % kQuad) * kTileCols + c] = row[kk];
      }
    }
  });
  return packed;
}

// x [rows, in] float or bfloat16 -> [rows, out] in x's dtype.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       int64_t out_features, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int8_linear: expected [rows, in] float32 or bfloat16 CPU activations");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == kQuad && packed.size(3) == kTileCols,
              "int8_linear: packed weight must come from int8_pack");
  const int64_t rows = x.size(0), in_features = x.size(1);
  TORCH_CHECK(packed.size(0) == round_up(out_features, kTileCols) / kTileCols &&
                  packed.size(1) == round_up(in_features, kQuad) / kQuad,
              "int8_linear: packed weight of shape ", packed.sizes(), " does not hold a [", out_features, ", ",
              in_features, "] weight");
  TORCH_CHECK(scales.numel() == out_features, "int8_linear: one scale per output row");
  const at::Tensor scales_f = scales.to(at::kFloat).contiguous();
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features, "int8_linear: bias must be [out_features]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const int64_t quads = packed.size(1), tiles = packed.size(0), tile_stride = quads * kQuadBytes;
  // Activations as float rows of whole quads (a small copy: few rows).
  const at::Tensor xf = raylm::rows_as_float(x.stride(1) == 1 ? x : x.contiguous(), quads * kQuad);
  at::Tensor out = at::empty({rows, out_features}, x.options().dtype(at::kFloat));
  if (rows == 0 || out_features == 0) return out.to(x.scalar_type());

  const float* xp = xf.data_ptr<float>();
  const int8_t* w = packed.data_ptr<int8_t>();
  float* y = out.data_ptr<float>();
  const float* sp = scales_f.data_ptr<float>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  raylm::for_each_tile_block(rows, tiles, kMaxRows, preferred_tiles, [&](int64_t m0, int64_t block_rows, int64_t t,
                                                                            int64_t n_tiles) {
    Block b;
    b.quads = quads;
    b.tile = w + t * tile_stride;
    b.tile_stride = tile_stride;
    b.scales = sp + t * kTileCols;
    b.bias = bp ? bp + t * kTileCols : nullptr;
    b.cols = out_features - t * kTileCols;
    for (int64_t m = 0; m < block_rows; ++m) {
      b.x[m] = xp + (m0 + m) * quads * kQuad;
      b.out[m] = y + (m0 + m) * out_features + t * kTileCols;
    }
    kernel_for(block_rows, n_tiles)(b);
  });
  return raylm::float_rows_to(out, x.scalar_type());
}
