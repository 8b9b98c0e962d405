// The work split shared by the packed-weight matmuls for decode
// (bf16_gemm.cpp, int8_gemm.cpp), whose weights are tiles of 16 output
// columns: threads take contiguous groups of 4 tiles (the widest a kernel
// call reads), so each streams one range of the packed weight; inside a
// group, activation rows come in blocks of at most `max_rows`, and each block
// runs over the group's tiles a few at a time (`tiles_for(rows)`, at most 4).
// Groups are the items of work_team.h's team, not an OpenMP region: a decode
// matmul is microseconds of work.
#pragma once

#include "work_team.h"

#include <algorithm>
#include <cstdint>

namespace raylm {

constexpr int64_t kTilesPerGroup = 4;

// run(first_row, rows, first_tile, tiles) for every (row block, tile run).
template <typename TilesFor, typename Run>
void for_each_tile_block(int64_t rows, int64_t tiles, int64_t max_rows, TilesFor tiles_for, Run run) {
  const int64_t groups = (tiles + kTilesPerGroup - 1) / kTilesPerGroup;
  for_each_item(groups, [&](int64_t g) {
    const int64_t group_end = std::min(tiles, (g + 1) * kTilesPerGroup);
    for (int64_t m0 = 0; m0 < rows; m0 += max_rows) {
      const int64_t block_rows = std::min(max_rows, rows - m0);
      for (int64_t t = g * kTilesPerGroup; t < group_end;) {
        const int64_t n_tiles = std::min<int64_t>(tiles_for(block_rows), group_end - t);
        run(m0, block_rows, t, n_tiles);
        t += n_tiles;
      }
    }
  });
}

}  // namespace raylm
