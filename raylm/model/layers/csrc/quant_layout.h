// The tile layout of GGUF-quantized weights for CPU decode, shared by
// quant_pack.cpp (re-laying a file's blocks at load, and back) and
// quant_decode.cpp (the kernels that read it).
//
// Tiles of 16 output columns (zero past N); a tile holds the whole K for its
// columns, block after block, so a thread streams a contiguous range of
// tiles. Within a tile's block, every group of 32 k is 8 "quads" (4
// consecutive k); a 64-byte line holds one quad for the 16 columns, in the
// order vpdpbusd reads it (lane = column, byte = k % 4). 4-bit values share a
// line by nibbles: the low nibble holds quad r, the high nibble quad r + 4.
// Per tile and block (fp16 scales copied from the file as they are):
//   Q8_0  d[16] fp16 | 8 lines of q + 128 (u8)                           = 544 B
//   Q4_0  d[16] fp16 | 4 nibble lines of q (0..15, value q - 8)          = 288 B
//   Q4_K  d[16], dmin[16] fp16 | scales u8 [8 sub-blocks][16] |
//         mins u8 [4 pairs][16 columns][2] | 8 x 4 nibble lines         = 2368 B
//   Q6_K  d[16] fp16 | scales i8 [16 sub-blocks][16] |
//         8 x (4 nibble lines of the low 4 bits, 2 lines of the high 2
//         bits: line h, bits 2s..2s+1 = quad 4h + s)                     = 3360 B
// Sub-block values: Q4_K w = d * sc * q - dmin * m (sub-blocks of 32),
// Q6_K w = d * sc * (q - 32) (sub-blocks of 16).
//
// The layout holds every bit of the file's blocks (quant_unpack gives them
// back), so the packed copy is the only one a layer keeps.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

namespace raylm::quant {

enum QType : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_K = 2, Q6_K = 3 };  // quant_gemm.cpp's codes

constexpr int64_t kCols = 16;  // output columns per tile (one AVX-512 register of int32 lanes)
constexpr int kLine = 64;      // bytes: one quad of 16 columns

// Offsets inside a tile's block.
constexpr int64_t kQ4KScales = 64, kQ4KMins = 192, kQ4KQuants = 320;
constexpr int64_t kQ6KScales = 32, kQ6KGroups = 288, kQ6KGroupBytes = 6 * kLine;

struct Geometry {
  int64_t block;       // weights per file block
  int64_t file_bytes;  // bytes per file block
  int64_t packed;      // bytes per tile per block
  int64_t act_block;   // activations per int8 scale in the decode kernel
};

inline Geometry geometry(int64_t qtype) {
  switch (qtype) {
    case Q8_0: return {32, 34, 32 + 8 * kLine, 32};
    case Q4_0: return {32, 18, 32 + 4 * kLine, 32};
    case Q4_K: return {256, 144, kQ4KQuants + 32 * kLine, 256};
    case Q6_K: return {256, 210, kQ6KGroups + 8 * kQ6KGroupBytes, 256};
  }
  TORCH_CHECK(false, "quantized type code ", qtype, " has no packed layout");
}

}  // namespace raylm::quant
