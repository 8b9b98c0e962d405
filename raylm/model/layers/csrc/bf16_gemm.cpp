// Matmuls on bfloat16 weights packed once at load, for CPU decode:
// y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), x and y bfloat16.
//
// Decode multiplies a few activation rows by every weight of the model, once
// per token, so its speed is the speed at which the weights stream from
// memory. The weight is therefore laid out for a single sequential read:
// tiles of 16 output columns, each tile a run of k-pairs, each k-pair the 16
// columns' two consecutive weights (the "VNNI" order that AVX-512 BF16's
// vdpbf16ps multiplies in one instruction against a broadcast pair of x):
//
//   packed[tile][k / 2][column][k % 2] = W[tile * 16 + column][k]
//
// (zero past N and past K, so K is rounded up to a pair and N to a tile).
// A thread takes a contiguous range of tiles: one stream from memory, read
// once whatever the number of rows, which stay in L1 and are reused against
// each weight register. Rows come in blocks of up to kMaxRows, so a larger
// batch re-reads a tile from L2, not memory.
//
// Four paths, chosen when the build (-march=native) sees the CPU:
// AVX-512 BF16 (one vdpbf16ps per 32 weights), AVX-512F (each pair widened to
// floats and multiplied by two FMAs), AVX2 with FMA (the same in 256-bit
// halves of a tile, the rows' x widened to floats once per call, blocks of at
// most kAvx2MaxRows rows to stay in 16 registers; from kPanelMinRows rows each
// tile widened once into a float panel that blocks of 6 rows multiply) and
// plain loops the compiler vectorises.
// Accumulation is in float; the result is rounded to bfloat16 (to nearest
// even, as torch rounds) after the bias is added, as torch's linear does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "huge_pages.h"
#include "kernels.h"
#include "panel_gemm.h"
#include "tiled_gemm.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// The AVX2 path reads the rows' x as floats, widened once per call.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define RAYLM_BF16_AVX2 1
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kTileCols = 16;
constexpr int64_t kMaxRows = 8;  // activation rows per register block

inline int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

// Weights of one tile for one k-pair: 16 columns x 2 = 32 bf16 (64 bytes).
constexpr int64_t kPairWidth = 2 * kTileCols;

inline uint16_t bf16_bits(float f) {
  return c10::BFloat16(f).x;  // round to nearest even, NaN kept
}

inline float bf16_value(uint16_t bits) {
  uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One block of `rows` activation rows against `tiles` consecutive weight tiles.
// x: rows of (padded) pairs of bf16 read as uint32; tile: first tile's data.
struct Block {
  const uint32_t* x[kMaxRows];  // pair p of row m: x[m][p]
  int64_t pairs;                // K / 2, rounded up
  const uint16_t* tile;         // packed data of the first tile
  int64_t tile_stride;          // uint16 elements per tile = pairs * 32
  const float* bias;            // per column of the first tile, or null
#if RAYLM_BF16_AVX2
  const float* xf[kMaxRows];    // row m as floats: k-pair p at xf[m][2p], xf[m][2p + 1]
#endif
  uint16_t* out[kMaxRows];      // first column of the first tile in each row
  int64_t cols;                 // valid columns from the first tile's first (may end mid-tile)
};

#if defined(__AVX512BF16__)

template <int ROWS, int TILES>
void block_kernel(const Block& b) {
  __m512 acc[ROWS][TILES];
  for (int m = 0; m < ROWS; ++m)
    for (int t = 0; t < TILES; ++t) acc[m][t] = _mm512_setzero_ps();
  const uint16_t* w = b.tile;
  for (int64_t p = 0; p < b.pairs; ++p) {
    __m512bh wv[TILES];
    for (int t = 0; t < TILES; ++t) {
      const uint16_t* src = w + t * b.tile_stride + p * kPairWidth;
      // The next tiles' lines are far apart in memory: ask for them ahead so
      // each tile's stream keeps the memory system busy. Into L2, not L1: a
      // core has more L2 misses in flight than L1 fill buffers, and batch-1
      // streaming measured 10-30% faster so (T0 was slower than no prefetch).
      _mm_prefetch(reinterpret_cast<const char*>(src + 16 * kPairWidth), _MM_HINT_T1);
      wv[t] = (__m512bh)_mm512_loadu_si512(src);
    }
    for (int m = 0; m < ROWS; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(b.x[m][p]));
      for (int t = 0; t < TILES; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], xv, wv[t]);
    }
  }
  for (int t = 0; t < TILES; ++t) {
    const int64_t first = t * kTileCols;
    if (first >= b.cols) break;
    const int64_t n = std::min<int64_t>(kTileCols, b.cols - first);
    const __mmask16 mask = n == kTileCols ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const __m512 bias = b.bias ? _mm512_maskz_loadu_ps(mask, b.bias + first) : _mm512_setzero_ps();
    for (int m = 0; m < ROWS; ++m) {
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][t], bias));
      _mm256_mask_storeu_epi16(b.out[m] + first, mask, (__m256i)y);
    }
  }
}

#elif defined(__AVX512F__)

inline __m256i round_to_bf16(__m512 v) {
  // Round to nearest even by integer arithmetic (inputs here are finite sums).
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

template <int ROWS, int TILES>
void block_kernel(const Block& b) {
  __m512 acc[ROWS][TILES];
  for (int m = 0; m < ROWS; ++m)
    for (int t = 0; t < TILES; ++t) acc[m][t] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
  const uint16_t* w = b.tile;
  for (int64_t p = 0; p < b.pairs; ++p) {
    __m512 even[TILES], odd[TILES];
    for (int t = 0; t < TILES; ++t) {
      const uint16_t* src = w + t * b.tile_stride + p * kPairWidth;
      _mm_prefetch(reinterpret_cast<const char*>(src + 16 * kPairWidth), _MM_HINT_T1);
      const __m512i v = _mm512_loadu_si512(src);
      even[t] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      odd[t] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
    for (int m = 0; m < ROWS; ++m) {
      const uint32_t pair = b.x[m][p];
      const __m512 x0 = _mm512_set1_ps(bf16_value(uint16_t(pair & 0xFFFF)));
      const __m512 x1 = _mm512_set1_ps(bf16_value(uint16_t(pair >> 16)));
      for (int t = 0; t < TILES; ++t) {
        acc[m][t] = _mm512_fmadd_ps(x0, even[t], acc[m][t]);
        acc[m][t] = _mm512_fmadd_ps(x1, odd[t], acc[m][t]);
      }
    }
  }
  for (int t = 0; t < TILES; ++t) {
    const int64_t first = t * kTileCols;
    if (first >= b.cols) break;
    const int64_t n = std::min<int64_t>(kTileCols, b.cols - first);
    const __mmask16 mask = n == kTileCols ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const __m512 bias = b.bias ? _mm512_maskz_loadu_ps(mask, b.bias + first) : _mm512_setzero_ps();
    for (int m = 0; m < ROWS; ++m)
      _mm256_mask_storeu_epi16(b.out[m] + first, mask, round_to_bf16(_mm512_add_ps(acc[m][t], bias)));
  }
}

#elif RAYLM_BF16_AVX2

// Rows per block: a block holds ROWS x TILES x 2 accumulators (a tile is two
// 8-column halves), and 16 registers leave room for 8 beside the widened
// weights and the broadcast x.
constexpr int64_t kAvx2MaxRows = 4;

using raylm::panel::store_tile_row;
static_assert(raylm::panel::kCols == kTileCols, "the panel path multiplies this file's tiles");

template <int ROWS, int TILES>
void block_kernel(const Block& b) {
  __m256 acc[ROWS][TILES][2];
  for (int m = 0; m < ROWS; ++m)
    for (int t = 0; t < TILES; ++t) acc[m][t][0] = acc[m][t][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(int(0xFFFF0000u));
  const uint16_t* w = b.tile;
  for (int64_t p = 0; p < b.pairs; ++p) {
    for (int t = 0; t < TILES; ++t) {
      const uint16_t* src = w + t * b.tile_stride + p * kPairWidth;
      _mm_prefetch(reinterpret_cast<const char*>(src + 16 * kPairWidth), _MM_HINT_T1);
      // Each half: 8 columns' (even k, odd k) pairs; the low halves shifted up
      // are the even-k floats, the high halves masked the odd-k ones.
      __m256 even[2], odd[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + h * kTileCols));
        even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      }
      for (int m = 0; m < ROWS; ++m) {
        const __m256 x0 = _mm256_broadcast_ss(b.xf[m] + 2 * p), x1 = _mm256_broadcast_ss(b.xf[m] + 2 * p + 1);
        for (int h = 0; h < 2; ++h) {
          acc[m][t][h] = _mm256_fmadd_ps(x0, even[h], acc[m][t][h]);
          acc[m][t][h] = _mm256_fmadd_ps(x1, odd[h], acc[m][t][h]);
        }
      }
    }
  }
  for (int t = 0; t < TILES; ++t) {
    const int64_t first = t * kTileCols;
    if (first >= b.cols) break;
    const int64_t n = std::min<int64_t>(kTileCols, b.cols - first);
#pragma GCC unroll 8
    for (int m = 0; m < ROWS; ++m) store_tile_row(acc[m][t][0], acc[m][t][1], b.bias ? b.bias + first : nullptr, n, b.out[m] + first);
  }
}

// Many rows (batched decode): from kPanelMinRows rows each tile is widened to
// floats once into a panel that blocks of 6 rows multiply (panel_gemm.h).
// The sums are the same, in the same order: the results are identical to the
// block kernel's.
constexpr int64_t kPanelMinRows = 16;

// One packed tile (`pairs` k-pairs x 16 columns x 2) as floats [2 * pairs][16].
void widen_tile(const uint16_t* tile, int64_t pairs, float* panel) {
  const __m256i high = _mm256_set1_epi32(int(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    float* even = panel + 2 * p * kTileCols;
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + p * kPairWidth + h * kTileCols));
      _mm256_store_ps(even + h * 8, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      _mm256_store_ps(even + kTileCols + h * 8, _mm256_castsi256_ps(_mm256_and_si256(v, high)));
    }
  }
}

#else

template <int ROWS, int TILES>
void block_kernel(const Block& b) {
  float acc[ROWS][TILES * kTileCols] = {};
  for (int64_t p = 0; p < b.pairs; ++p) {
    for (int m = 0; m < ROWS; ++m) {
      const float x0 = bf16_value(uint16_t(b.x[m][p] & 0xFFFF)), x1 = bf16_value(uint16_t(b.x[m][p] >> 16));
      for (int t = 0; t < TILES; ++t) {
        const uint16_t* src = b.tile + t * b.tile_stride + p * kPairWidth;
        float* a = acc[m] + t * kTileCols;
        for (int c = 0; c < kTileCols; ++c) a[c] += x0 * bf16_value(src[2 * c]) + x1 * bf16_value(src[2 * c + 1]);
      }
    }
  }
  const int64_t n = std::min<int64_t>(TILES * kTileCols, b.cols);
  for (int m = 0; m < ROWS; ++m)
    for (int64_t c = 0; c < n; ++c) b.out[m][c] = bf16_bits(acc[m][c] + (b.bias ? b.bias[c] : 0.f));
}

#endif

using KernelFn = void (*)(const Block&);

// Tiles per call: enough independent accumulators to hide the FMA latency
// (and, at one row, four memory streams), few enough to fit the registers.
#if RAYLM_BF16_AVX2
inline int64_t preferred_tiles(int64_t rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }
constexpr int64_t kBlockRows = kAvx2MaxRows;
#else
inline int64_t preferred_tiles(int64_t rows) { return rows <= 4 ? 4 : 2; }
constexpr int64_t kBlockRows = kMaxRows;
#endif

template <int ROWS>
constexpr KernelFn kernel_with_tiles(int64_t tiles) {
  return tiles >= 4 ? &block_kernel<ROWS, 4> : tiles == 3 ? &block_kernel<ROWS, 3>
         : tiles == 2 ? &block_kernel<ROWS, 2> : &block_kernel<ROWS, 1>;
}

// The kernel for `rows` rows (1..kMaxRows) and `tiles` tiles (1..4).
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

void check_packed(const at::Tensor& packed, int64_t out_features, int64_t in_features) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == kTileCols && packed.size(3) == 2,
              "bf16_linear: packed weight must come from bf16_pack");
  TORCH_CHECK(packed.size(0) == round_up(out_features, kTileCols) / kTileCols &&
                  packed.size(1) == round_up(in_features, 2) / 2,
              "bf16_linear: packed weight of shape ", packed.sizes(), " does not hold a [", out_features, ", ",
              in_features, "] weight");
}

}  // namespace

at::Tensor bf16_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "bf16_pack: expected a [out, in] bfloat16 CPU weight");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t tiles = round_up(n, kTileCols) / kTileCols, pairs = round_up(k, 2) / 2;
  at::Tensor packed = raylm::zeros_on_huge_pages({tiles, pairs, kTileCols, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      uint16_t* tile = dst + t * pairs * kPairWidth;
      for (int64_t c = 0; c < kTileCols && t * kTileCols + c < n; ++c) {
        const uint16_t* row = src + (t * kTileCols + c) * k;
        for (int64_t kk = 0; kk < k; ++kk) tile[(kk / 2) * kPairWidth + c * 2 + (kk % 2)] = row[kk];
      }
    }
  });
  return packed;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "bf16_linear: expected [rows, in] bfloat16 CPU activations");
  const int64_t rows = x.size(0), in_features = x.size(1);
  check_packed(packed, out_features, in_features);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, "bf16_linear: bias must be [out_features]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  // Rows as whole pairs: a copy only when the width is odd or rows are strided.
  at::Tensor xp = x;
  if (in_features % 2 || x.stride(1) != 1 || x.stride(0) != in_features) {
    xp = at::zeros({rows, round_up(in_features, 2)}, x.options());
    xp.narrow(1, 0, in_features).copy_(x);
  }
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return out;

  const int64_t pairs = packed.size(1), tiles = packed.size(0), tile_stride = pairs * kPairWidth;
  const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(xp.data_ptr<at::BFloat16>());
  const int64_t x_row_pairs = xp.size(1) / 2;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* y = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* bias_p = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;

#if RAYLM_BF16_AVX2
  const at::Tensor xf = raylm::rows_as_float(xp, xp.size(1));
  const float* x_floats = xf.data_ptr<float>();
  if (rows >= kPanelMinRows) {
    const int64_t tile_stride = pairs * kPairWidth;
    raylm::panel::linear(rows, tiles, 2 * pairs,
                         [&](int64_t t, float* panel) { widen_tile(w + t * tile_stride, pairs, panel); },
                         x_floats, bias_p, y, out_features);
    return out;
  }
#endif
  raylm::for_each_tile_block(rows, tiles, kBlockRows, preferred_tiles, [&](int64_t m0, int64_t block_rows, int64_t t,
                                                                            int64_t n_tiles) {
    Block b;
    b.pairs = pairs;
    b.tile = w + t * tile_stride;
    b.tile_stride = tile_stride;
    b.bias = bias_p ? bias_p + t * kTileCols : nullptr;
    b.cols = out_features - t * kTileCols;
    for (int64_t m = 0; m < block_rows; ++m) {
      b.x[m] = x_pairs + (m0 + m) * x_row_pairs;
#if RAYLM_BF16_AVX2
      b.xf[m] = x_floats + (m0 + m) * 2 * x_row_pairs;
#endif
      b.out[m] = y + (m0 + m) * out_features + t * kTileCols;
    }
    kernel_for(block_rows, n_tiles)(b);
  });
  return out;
}

at::Tensor widen_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "widen_rows: expected [rows, cols] CPU rows");
  return raylm::rows_as_float(x, x.size(1));
}
