// A vectorisable exp for the CPU kernels: both the softmax of paged attention
// and the SiLU of the MLP would otherwise spend most of their time in libm.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace raylm {

// exp(x) as 2^k * polynomial (Cody-Waite reduction, relative error ~2e-7),
// branch-free so that it vectorises. Below -87 the result would be subnormal
// and is given as e^-87 (negligible next to any weight it is summed with);
// past the float range it is infinity, as std::exp gives.
inline float fast_exp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRoundMagic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const float overflow = x > 88.7f ? std::numeric_limits<float>::infinity() : 1.f;
  x = std::min(std::max(x, -87.f), 88.f);
  const float k = (x * kLog2e + kRoundMagic) - kRoundMagic;
  const float y = (x - k * kLn2Hi) - k * kLn2Lo;  // |y| <= ln2 / 2
  float p = 1.f / 720.f;
  p = p * y + 1.f / 120.f;
  p = p * y + 1.f / 24.f;
  p = p * y + 1.f / 6.f;
  p = p * y + 0.5f;
  p = p * y + 1.f;
  p = p * y + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale * overflow;
}

}  // namespace raylm
