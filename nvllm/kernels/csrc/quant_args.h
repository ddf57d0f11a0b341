// What the grouped-quantized-weight ops (cpu_quant_linear.cpp, cpu_quant_vnni.cpp) check
// and dispatch on alike: the layout of nvllm/worker/layers/quant.py (int8 [N, K] or int4
// [N, K / 2] values, fp16 scales [N, K / 32], mins fp16 or float32 shaped like them) and
// the rows of x per pass as a compile-time count.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace nvllm_cpu {

constexpr int64_t kQuantGroup = 32;

// A scale (fp16) or a min (fp16: GGUF's; or float32: -z * scale of AWQ / GPTQ zero
// points, exact only in float32) as float32: one instruction with F16C (every AVX-512
// CPU has it); c10's bit-twiddling otherwise.
inline float scale_to_float(const c10::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}
inline float scale_to_float(const float v) { return v; }

#if defined(__AVX2__)
// Columns n .. n + cols - 1 of a grouped weight (their values, scales and mins) fetched
// towards L1 ahead of their use: at decode every weight comes from memory once per step,
// and the hardware prefetcher fetches late where a kernel reads W in bursts between long
// runs of arithmetic.
template <int BITS, bool MIN, typename MT>
inline void prefetch_columns(int64_t n, int64_t cols, const uint8_t* qw, int64_t qrow,
                             const c10::Half* s, const MT* m, int64_t G) {
  if (cols <= 0) return;
  const char* q0 = reinterpret_cast<const char*>(qw + n * qrow);
  for (int64_t b = 0; b < cols * qrow; b += 64) _mm_prefetch(q0 + b, _MM_HINT_T0);
  const char* s0 = reinterpret_cast<const char*>(s + n * G);
  for (int64_t b = 0; b < cols * G * 2; b += 64) _mm_prefetch(s0 + b, _MM_HINT_T0);
  if constexpr (MIN) {
    const char* m0 = reinterpret_cast<const char*>(m + n * G);
    for (int64_t b = 0; b < cols * G * static_cast<int64_t>(sizeof(MT)); b += 64)
      _mm_prefetch(m0 + b, _MM_HINT_T0);
  }
}
#endif
constexpr int64_t kQuantMaxRows = 8;  // rows of x per pass over the weight

// qweight, scales and mins hold an [N, K] weight in `bits`.
inline void check_quant_weight(const at::Tensor& qweight, const at::Tensor& scales,
                               const c10::optional<at::Tensor>& mins, int64_t bits, int64_t N,
                               int64_t K) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  TORCH_CHECK(K % kQuantGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(qweight.is_contiguous() && qweight.size(0) == N &&
                  qweight.size(1) == (bits == 8 ? K : K / 2),
              "qweight: contiguous [N, K] (int8) or [N, K / 2] (int4)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.size(0) == N && scales.size(1) == K / kQuantGroup,
              "scales: contiguous fp16 [N, K / 32]");
  if (mins.has_value()) {
    TORCH_CHECK((mins->scalar_type() == at::kHalf || mins->scalar_type() == at::kFloat) &&
                    mins->is_contiguous() && mins->sizes() == scales.sizes(),
                "mins: fp16 or float32, shaped like scales");
  }
}

// The quantized linears' arguments: out [M, N] and x [M, K] contiguous, one dtype,
// float32 or bfloat16; the weight [N, K] in `bits`. Returns {M, K, N}.
struct LinearDims {
  int64_t M, K, N;
};

inline LinearDims check_quant_linear(const at::Tensor& out, const at::Tensor& x,
                                     const at::Tensor& qweight, const at::Tensor& scales,
                                     const c10::optional<at::Tensor>& mins, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous(), "x, out: contiguous 2-D");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "x and out: one dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  const LinearDims d{x.size(0), x.size(1), qweight.size(0)};
  check_quant_weight(qweight, scales, mins, bits, d.N, d.K);
  TORCH_CHECK(out.size(0) == d.M && out.size(1) == d.N, "out: [M, N]");
  return d;
}

// f(mins pointer): const float* for float32 mins, else const c10::Half* (nullptr: none).
template <typename F>
void with_mins(const c10::optional<at::Tensor>& mins, F&& f) {
  if (mins.has_value() && mins->scalar_type() == at::kFloat) {
    f(static_cast<const float*>(mins->data_ptr<float>()));
  } else {
    f(static_cast<const c10::Half*>(mins.has_value() ? mins->data_ptr<c10::Half>() : nullptr));
  }
}

// f(std::integral_constant<int, R>{}) for R = rows (1..8; more: 8).
template <typename F>
void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

#if defined(__AVX2__)
// The sum of a vector's 8 lanes (both ops' AVX2 loops).
inline float hsum8(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}
#endif

}  // namespace nvllm_cpu
