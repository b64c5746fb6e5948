// exp_generic: e^x for x <= 0 in plain C++ that vectorises; the attention kernels' softmax and the fused
// SiLU (fused_ops.cpp) share it.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

// e^x for x <= 0 in plain arithmetic the compiler vectorises (std::exp is a library call it cannot): exp16's
// range reduction and degree-7 series (attention_tile_avx512.h), rounding by the 1.5 * 2^23 trick, 2^k built
// from its exponent bits; below -87 (2^k would leave fp32's normal range) the result is 0.
static inline float exp_generic(float x) {
  const float y = std::max(x, -87.f);
  const float k = (y * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest, as the AVX-512 path
  float r = y - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.f / 5040;  // Horner: 1 + r + r^2/2! + ... + r^7/7!
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = p * r + c;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, sizeof(float));
  return x < -87.f ? 0.f : p * two_k;
}

}  // namespace
