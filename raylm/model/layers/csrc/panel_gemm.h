// Matmuls of many rows (batched decode) on weights stored narrow (bf16), for
// CPUs with AVX2 and FMA but no bf16 arithmetic: each tile of 16
// output columns is widened once into a float panel, laid out [k][16] in a
// thread's own buffer (L1/L2), and every block of kPanelRows rows multiplies
// it from there with one FMA per accumulator per k (6 rows x 2 halves = 12
// accumulators, two loads and a broadcast beside them). Widening the weight
// again for every few rows, as the few-row kernels do, spends vector
// instructions on shifts, masks or integer dots that compete with the FMAs;
// here the widening is paid once per tile and chunk of rows.
//
// y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), summed in k order in float
// and rounded to bf16 once (to nearest even, as torch rounds). Used by
// bf16_gemm.cpp from 16 rows. (GGUF tiles keep their int8 kernel: on a
// 2-core Zen 3 its integer dots ran 140-180 GFLOP/s at 16-64 rows of the
// ~111M model's Q4_K/Q6_K matmuls, these panels 75-130.)
#pragma once

#if defined(__AVX2__) && defined(__FMA__)

#include "tiled_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

namespace raylm::panel {

constexpr int64_t kCols = 16;  // output columns per tile (two 8-float halves)
constexpr int64_t kRows = 6;   // rows per block: 12 accumulators + 2 weights + 1 broadcast
// Bytes of float rows multiplied by a group's tiles before the next rows: a
// chunk's x stays in L2 while each tile of the group multiplies it (a long
// prefill's rows would otherwise stream from memory once per tile).
constexpr int64_t kChunkBytes = 192 * 1024;

inline __m128i round_to_bf16(__m256 v) {
  // Round to nearest even by integer arithmetic (inputs here are finite sums).
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
}

// One row of a tile's sums (two halves of 8 columns) plus bias, rounded to
// bf16 into the row's first `n` columns (the last tile may end mid-way).
// The sums come by value: an accumulator whose address is taken stays in
// memory through the whole k loop.
inline void store_tile_row(__m256 low, __m256 high, const float* bias, int64_t n, uint16_t* out) {
  alignas(32) uint16_t y[kCols];
  const __m256 acc[2] = {low, high};
  for (int h = 0; h < 2; ++h) {
    const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - h * 8)),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 b = bias ? _mm256_maskload_ps(bias + h * 8, valid) : _mm256_setzero_ps();
    _mm_store_si128(reinterpret_cast<__m128i*>(y + h * 8), round_to_bf16(_mm256_add_ps(acc[h], b)));
  }
  std::memcpy(out, y, n * sizeof(uint16_t));
}

struct Block {
  const float* panel;         // [k][16] floats of the tile
  int64_t k;                  // the panel's (and the rows') length
  const float* xf[kRows];     // the block's rows as floats
  const float* bias;          // per column of the tile, or null
  uint16_t* out[kRows];       // the tile's first column in each row
  int64_t cols;               // valid columns of the tile (at most 16)
};

template <int ROWS>
void block_kernel(const Block& b) {
  __m256 acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const float* xf[ROWS];
  for (int m = 0; m < ROWS; ++m) xf[m] = b.xf[m];
  const float* panel = b.panel;
  const int64_t k_end = b.k;
  for (int64_t k = 0; k < k_end; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + k * kCols), w1 = _mm256_load_ps(panel + k * kCols + 8);
#pragma GCC unroll 8
    for (int m = 0; m < ROWS; ++m) {
      const __m256 x = _mm256_broadcast_ss(xf[m] + k);
      acc[m][0] = _mm256_fmadd_ps(x, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(x, w1, acc[m][1]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < ROWS; ++m) store_tile_row(acc[m][0], acc[m][1], b.bias, b.cols, b.out[m]);
}

using BlockFn = void (*)(const Block&);

inline BlockFn block_kernel_for(int64_t rows) {
  switch (rows) {
    case 1: return &block_kernel<1>;
    case 2: return &block_kernel<2>;
    case 3: return &block_kernel<3>;
    case 4: return &block_kernel<4>;
    case 5: return &block_kernel<5>;
    default: return &block_kernel<6>;
  }
}

// This thread's panel buffer, at least `floats` long and 64-byte aligned
// (the team's threads live as long as the process, and so do their buffers).
inline float* thread_buffer(int64_t floats) {
  thread_local std::unique_ptr<float[]> storage;
  thread_local int64_t capacity = 0;
  if (capacity < floats) {
    storage.reset(new float[floats + 16]);
    capacity = floats;
  }
  const uintptr_t address = reinterpret_cast<uintptr_t>(storage.get());
  return reinterpret_cast<float*>((address + 63) / 64 * 64);
}

// y [rows, out_features] bf16 = x W^T (+ bias) on the work team, tile by
// tile through the panel: widen(t, panel) writes tile t's [k][16] floats
// (zero past the weight's columns). x_floats: rows of `k` floats.
template <typename Widen>
void linear(int64_t rows, int64_t tiles, int64_t k, const Widen& widen, const float* x_floats, const float* bias,
            uint16_t* y, int64_t out_features) {
  const TileItems items(rows, tiles, kRows);
  const int64_t chunk_rows = std::max<int64_t>(1, kChunkBytes / (k * int64_t(sizeof(float))) / kRows) * kRows;
  for_each_item(items.count(), [&](int64_t item) {
    float* panel = thread_buffer(k * kCols);
    const int64_t group = items.group(item), first_row = items.first_row(item);
    const int64_t group_end = std::min(tiles, (group + 1) * kTilesPerGroup);
    const int64_t span_end = std::min(rows, first_row + items.rows_per_span);
    for (int64_t chunk = first_row; chunk < span_end; chunk += chunk_rows) {
      const int64_t chunk_end = std::min(span_end, chunk + chunk_rows);
      for (int64_t t = group * kTilesPerGroup; t < group_end; ++t) {
        widen(t, panel);
        Block b;
        b.panel = panel;
        b.k = k;
        b.bias = bias ? bias + t * kCols : nullptr;
        b.cols = std::min(kCols, out_features - t * kCols);
        for (int64_t m0 = chunk; m0 < chunk_end; m0 += kRows) {
          const int64_t block_rows = std::min(kRows, chunk_end - m0);
          for (int64_t m = 0; m < block_rows; ++m) {
            b.xf[m] = x_floats + (m0 + m) * k;
            b.out[m] = y + (m0 + m) * out_features + t * kCols;
          }
          block_kernel_for(block_rows)(b);
        }
      }
    }
  });
}

}  // namespace raylm::panel

#endif  // AVX2 and FMA
