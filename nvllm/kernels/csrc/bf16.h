// Scalar float32 <-> storage conversions shared by the native CPU ops: bfloat16 travels
// as its raw bits (uint16_t), converted as torch converts it (round to nearest even).
#pragma once

#include <cstdint>
#include <cstring>

namespace nvllm_cpu {

inline float to_float(float x) { return x; }

inline float to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T from_float(float v);

template <>
inline float from_float<float>(float v) { return v; }

template <>
inline uint16_t from_float<uint16_t>(float v) {  // round to nearest even (NaN aside)
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// What a float32 value becomes once stored in T (a no-op for float).
template <typename T>
inline float round_to(float v) { return to_float(from_float<T>(v)); }

}  // namespace nvllm_cpu
