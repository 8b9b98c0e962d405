// The work split shared by the packed-weight matmuls for decode
// (bf16_gemm.cpp, int8_gemm.cpp), whose weights are tiles of 16 output
// columns: threads take contiguous groups of 4 tiles (the widest a kernel
// call reads), so each streams one range of the packed weight; inside a
// group, activation rows come in blocks of at most `max_rows`, and each block
// runs over the group's tiles a few at a time (`tiles_for(rows)`, at most 4).
// Groups (split into spans of rows when they are too few) are the items of
// work_team.h's team, not an OpenMP region: a decode matmul is microseconds
// of work.
#pragma once

#include "work_team.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace raylm {

// Conversions of a matmul's activations, run on the team rather than with
// torch's .to(): above 32k elements that is an OpenMP region, and its worker
// then spins on a core for a while, against the team's worker in the matmul
// that follows (64-row bf16 matmuls with K >= 640 ran 1.2-1.8x slower on two
// threads than on one, on 2 cores, until the widening of their x moved here).

// x [rows, in] (float or bf16, unit column stride) as float rows `width` >= in
// apart, zero past `in`.
inline at::Tensor rows_as_float(const at::Tensor& x, int64_t width) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && width >= x.size(1), "rows_as_float: bad operands");
  const int64_t rows = x.size(0), in = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows, width}, x.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  const at::ScalarType type = x.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16, "rows_as_float: dtype ", type);
  const void* src = x.data_ptr();
  for_each_range(rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = dst + r * width;
      if (type == at::kBFloat16) {
        const uint16_t* bits = static_cast<const uint16_t*>(src) + r * stride;
        for (int64_t i = 0; i < in; ++i) {
          const uint32_t widened = uint32_t(bits[i]) << 16;
          std::memcpy(row + i, &widened, sizeof(float));
        }
      } else {
        std::memcpy(row, static_cast<const float*>(src) + r * stride, in * sizeof(float));
      }
      std::fill(row + in, row + width, 0.f);
    }
  });
  return out;
}

// y [rows, cols] float (contiguous) rounded to bf16 as torch rounds (to
// nearest even), or y itself when `type` is float.
inline at::Tensor float_rows_to(const at::Tensor& y, at::ScalarType type) {
  if (type == at::kFloat) return y;
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == at::kFloat && type == at::kBFloat16,
              "float_rows_to: bad operands");
  at::Tensor out = at::empty(y.sizes(), y.options().dtype(type));
  const int64_t cols = y.size(-1), rows = cols == 0 ? 0 : y.numel() / cols;
  const float* src = y.data_ptr<float>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  for_each_range(rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * cols; i < end * cols; ++i) dst[i] = c10::BFloat16(src[i]);
  });
  return out;
}

constexpr int64_t kTilesPerGroup = 4;
// Items per thread to aim for: a few, so that a thread that starts late (or
// is descheduled) leaves its share to the others instead of holding the call.
constexpr int64_t kItemsPerThread = 4;

// The items of a matmul: each a group of tiles and a span of rows. Rows are
// split only when the groups alone are too few to share among the threads
// (a narrow weight, such as a 256-column projection, against a batch).
struct TileItems {
  int64_t groups;
  int64_t row_spans;
  int64_t rows_per_span;  // a multiple of the row block

  TileItems(int64_t rows, int64_t tiles, int64_t max_rows) {
    groups = (tiles + kTilesPerGroup - 1) / kTilesPerGroup;
    const int64_t row_blocks = (rows + max_rows - 1) / max_rows;
    const int64_t wanted = kItemsPerThread * std::max(1, at::get_num_threads());
    const int64_t spans = std::clamp<int64_t>((wanted + groups - 1) / groups, 1, std::max<int64_t>(row_blocks, 1));
    rows_per_span = (row_blocks + spans - 1) / spans * max_rows;
    row_spans = (rows + rows_per_span - 1) / std::max<int64_t>(rows_per_span, 1);
  }
  int64_t count() const { return groups * row_spans; }
  int64_t group(int64_t item) const { return item / row_spans; }
  int64_t first_row(int64_t item) const { return item % row_spans * rows_per_span; }
};

// run(first_row, rows, first_tile, tiles) for every (row block, tile run).
template <typename TilesFor, typename Run>
void for_each_tile_block(int64_t rows, int64_t tiles, int64_t max_rows, TilesFor tiles_for, Run run) {
  const TileItems items(rows, tiles, max_rows);
  for_each_item(items.count(), [&](int64_t item) {
    const int64_t g = items.group(item);
    const int64_t group_end = std::min(tiles, (g + 1) * kTilesPerGroup);
    const int64_t span_end = std::min(rows, items.first_row(item) + items.rows_per_span);
    for (int64_t m0 = items.first_row(item); m0 < span_end; m0 += max_rows) {
      const int64_t block_rows = std::min(max_rows, span_end - m0);
      for (int64_t t = g * kTilesPerGroup; t < group_end;) {
        const int64_t n_tiles = std::min<int64_t>(tiles_for(block_rows), group_end - t);
        run(m0, block_rows, t, n_tiles);
        t += n_tiles;
      }
    }
  });
}

}  // namespace raylm
