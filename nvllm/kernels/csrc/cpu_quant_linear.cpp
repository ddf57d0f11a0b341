// x W^T for a weight held in groups of 32 (nvllm/worker/layers/quant.py): int8 values, or
// int4 in GGUF's nibble order, each group with an fp16 scale and optionally a min (fp16,
// or float32 for AWQ / GPTQ zero points).
// Each group is dequantized in registers to float32 exactly as the reference does
// (scale * q + min, or scale * (q - 8) for int4 without a min: the products are exact in
// float32) and multiplied into float32 accumulators, one per (row of x, output column):
// so results differ from dequantize-then-matmul only by the order of the float32 sums.
// Built for decode (a few rows of x): every weight byte is read once per 8 rows of x.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

// AVX2 + FMA without AVX-512 (AMD Zen 1-3, most client CPUs): the same per-element
// arithmetic in 8-lane vectors.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define NVLLM_QUANT_AVX2 1
#endif

#include "bf16.h"
#include "quant_args.h"

namespace {

using nvllm_cpu::kQuantGroup;
using nvllm_cpu::kQuantMaxRows;

// One instruction with F16C (every AVX-512 CPU has it); c10's bit-twiddling otherwise.
inline float half_to_float(const c10::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}
// A min is fp16 (GGUF's) or float32 (-z * scale of AWQ / GPTQ zero points, exact only
// in float32).
inline float half_to_float(const float v) { return v; }

#if defined(__AVX512F__)
// One group's 32 values as two vectors of 16 floats (values 0-15, 16-31).
template <int BITS, bool MIN>
inline void dequant_group(const uint8_t* q, float s, float m, __m512& w0, __m512& w1) {
  const __m512 vs = _mm512_set1_ps(s);
  __m512 f0, f1;
  if constexpr (BITS == 8) {
    f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    f1 = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  } else {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(0xF));
    __m512i hi = _mm512_srli_epi32(v, 4);
    if constexpr (!MIN) {
      lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
      hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
    }
    f0 = _mm512_cvtepi32_ps(lo);
    f1 = _mm512_cvtepi32_ps(hi);
  }
  if constexpr (MIN) {
    const __m512 vm = _mm512_set1_ps(m);
    w0 = _mm512_fmadd_ps(f0, vs, vm);
    w1 = _mm512_fmadd_ps(f1, vs, vm);
  } else {
    w0 = _mm512_mul_ps(f0, vs);
    w1 = _mm512_mul_ps(f1, vs);
  }
}

#endif

#if defined(NVLLM_QUANT_AVX2)
// One group's 32 values as four vectors of 8 floats (values 0-7, 8-15, 16-23, 24-31).
template <int BITS, bool MIN>
inline void dequant_group(const uint8_t* q, float s, float m, __m256 (&w)[4]) {
  const __m256 vs = _mm256_set1_ps(s);
  __m256 f[4];
  if constexpr (BITS == 8) {
    for (int k = 0; k < 4; ++k)
      f[k] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k))));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0xF);
    const __m128i lo = _mm_and_si128(b, mask);                     // values 0-15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);  // values 16-31
    __m256i v[4] = {_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
                    _mm256_cvtepu8_epi32(hi), _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))};
    for (int k = 0; k < 4; ++k) {
      if constexpr (!MIN) v[k] = _mm256_sub_epi32(v[k], _mm256_set1_epi32(8));
      f[k] = _mm256_cvtepi32_ps(v[k]);
    }
  }
  if constexpr (MIN) {
    const __m256 vm = _mm256_set1_ps(m);
    for (int k = 0; k < 4; ++k) w[k] = _mm256_fmadd_ps(f[k], vs, vm);
  } else {
    for (int k = 0; k < 4; ++k) w[k] = _mm256_mul_ps(f[k], vs);
  }
}

#endif

// One group's 32 values into w (float32), the arithmetic of dot_column.
template <int BITS, bool MIN>
inline void dequant_to(const uint8_t* q, float s, float m, float* w) {
#if defined(__AVX512F__)
  __m512 w0, w1;
  dequant_group<BITS, MIN>(q, s, m, w0, w1);
  _mm512_storeu_ps(w, w0);
  _mm512_storeu_ps(w + 16, w1);
#elif defined(NVLLM_QUANT_AVX2)
  __m256 v[4];
  dequant_group<BITS, MIN>(q, s, m, v);
  for (int k = 0; k < 4; ++k) _mm256_storeu_ps(w + 8 * k, v[k]);
#else
  for (int j = 0; j < kQuantGroup; ++j) {
    int v;
    if constexpr (BITS == 8) {
      v = static_cast<int8_t>(q[j]);
    } else {
      v = j < 16 ? (q[j] & 0xF) : (q[j - 16] >> 4);
      if constexpr (!MIN) v -= 8;
    }
    w[j] = MIN ? static_cast<float>(v) * s + m : static_cast<float>(v) * s;
  }
#endif
}

#if defined(__AVX512F__)
// out[r, n] for R rows of x (float32, [R, K] at stride K) and one output column n.
template <int BITS, bool MIN, int R, typename MT>
inline void dot_column(const float* x, int64_t K, const uint8_t* q, const c10::Half* s,
                       const MT* m, float* acc_out) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t G = K / kQuantGroup;
  constexpr int64_t gbytes = BITS == 8 ? kQuantGroup : kQuantGroup / 2;
  for (int64_t g = 0; g < G; ++g) {
    __m512 w0, w1;
    dequant_group<BITS, MIN>(q + g * gbytes, half_to_float(s[g]),
                             MIN ? half_to_float(m[g]) : 0.f, w0, w1);
    const float* xg = x + g * kQuantGroup;
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg + r * K), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + r * K + 16), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) acc_out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}
#elif defined(NVLLM_QUANT_AVX2)
// The AVX2 form: two accumulators per row of x (values 0-7 and 16-23 into one, 8-15 and
// 24-31 into the other), so up to five rows stay in the 16 vector registers.
template <int BITS, bool MIN, int R, typename MT>
inline void dot_column(const float* x, int64_t K, const uint8_t* q, const c10::Half* s,
                       const MT* m, float* acc_out) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t G = K / kQuantGroup;
  constexpr int64_t gbytes = BITS == 8 ? kQuantGroup : kQuantGroup / 2;
  // Scales and mins converted 8 groups at a time, then broadcast from memory (one load
  // each rather than a conversion and a shuffle per group).
  alignas(32) float sf[8], mf[8] = {};
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const int gn = static_cast<int>(G - g0 < 8 ? G - g0 : 8);
    if (gn == 8) {
      _mm256_store_ps(sf, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g0))));
      if constexpr (MIN) {
        if constexpr (std::is_same_v<MT, float>) {
          _mm256_store_ps(mf, _mm256_loadu_ps(m + g0));
        } else {
          _mm256_store_ps(mf, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g0))));
        }
      }
    } else {
      for (int i = 0; i < gn; ++i) {
        sf[i] = half_to_float(s[g0 + i]);
        if constexpr (MIN) mf[i] = half_to_float(m[g0 + i]);
      }
    }
    for (int i = 0; i < gn; ++i) {
      const int64_t g = g0 + i;
      __m256 w[4];
      dequant_group<BITS, MIN>(q + g * gbytes, sf[i], mf[i], w);
      const float* xg = x + g * kQuantGroup;
      for (int r = 0; r < R; ++r) {
        const float* xr = xg + r * K;
        acc[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r][1]);
        acc[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    acc_out[r] = nvllm_cpu::hsum8(_mm256_add_ps(acc[r][0], acc[r][1]));
}
#else
// Portable: the same arithmetic, one group dequantized into a float buffer at a time.
template <int BITS, bool MIN, int R, typename MT>
inline void dot_column(const float* x, int64_t K, const uint8_t* q, const c10::Half* s,
                       const MT* m, float* acc_out) {
  float acc[R][kQuantGroup] = {};
  const int64_t G = K / kQuantGroup;
  constexpr int64_t gbytes = BITS == 8 ? kQuantGroup : kQuantGroup / 2;
  float w[kQuantGroup];
  for (int64_t g = 0; g < G; ++g) {
    dequant_to<BITS, MIN>(q + g * gbytes, half_to_float(s[g]), MIN ? half_to_float(m[g]) : 0.f,
                          w);
    const float* xg = x + g * kQuantGroup;
    for (int r = 0; r < R; ++r) {
#pragma omp simd
      for (int j = 0; j < kQuantGroup; ++j) acc[r][j] += w[j] * xg[r * K + j];
    }
  }
  for (int r = 0; r < R; ++r) {
    float t = 0.f;
    for (int j = 0; j < kQuantGroup; ++j) t += acc[r][j];
    acc_out[r] = t;
  }
}
#endif

// Rows [N, K] of the weight dequantized into out (float32, or bfloat16 rounded to nearest
// even as torch rounds): what the reference computes, in one pass.
template <int BITS, bool MIN, typename T, typename MT>
void dequant_rows(T* out, int64_t K, int64_t N, const uint8_t* qw, const c10::Half* scales,
                  const MT* mins) {
  const int64_t G = K / kQuantGroup;
  const int64_t qrow = BITS == 8 ? K : K / 2;
  constexpr int64_t gbytes = BITS == 8 ? kQuantGroup : kQuantGroup / 2;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float w[kQuantGroup];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t g = 0; g < G; ++g) {
        T* o = out + n * K + g * kQuantGroup;
        const float sc = half_to_float(scales[n * G + g]);
        const float mn = MIN ? half_to_float(mins[n * G + g]) : 0.f;
        if constexpr (std::is_same_v<T, float>) {
          dequant_to<BITS, MIN>(qw + n * qrow + g * gbytes, sc, mn, o);
        } else {
          dequant_to<BITS, MIN>(qw + n * qrow + g * gbytes, sc, mn, w);
          for (int j = 0; j < kQuantGroup; ++j) o[j] = nvllm_cpu::from_float<T>(w[j]);
        }
      }
    }
  });
}

template <int BITS, bool MIN, int R, typename T, typename MT>
void rows_pass(T* out, const float* x, int64_t K, int64_t N, const uint8_t* qw,
               const c10::Half* scales, const MT* mins) {
  const int64_t G = K / kQuantGroup;
  const int64_t qrow = BITS == 8 ? K : K / 2;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float acc[R];
    for (int64_t n = begin; n < end; ++n) {
      dot_column<BITS, MIN, R, MT>(x, K, qw + n * qrow, scales + n * G,
                               MIN ? mins + n * G : nullptr, acc);
      for (int r = 0; r < R; ++r) out[r * N + n] = nvllm_cpu::from_float<T>(acc[r]);
    }
  });
}

template <int BITS, bool MIN, typename T, typename MT>
void dispatch_rows(T* out, const float* x, int64_t M, int64_t K, int64_t N,
                   const uint8_t* qw, const c10::Half* s, const MT* m) {
  for (int64_t r0 = 0; r0 < M; r0 += kQuantMaxRows) {
    T* o = out + r0 * N;
    const float* xr = x + r0 * K;
    nvllm_cpu::with_rows(std::min(kQuantMaxRows, M - r0), [&](auto R) {
      rows_pass<BITS, MIN, decltype(R)::value, T, MT>(o, xr, K, N, qw, s, m);
    });
  }
}

template <typename T, typename MT>
void run(T* out, const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* qw,
         const c10::Half* s, const MT* m, int64_t bits) {
  if (bits == 8) {
    if (m) dispatch_rows<8, true, T, MT>(out, x, M, K, N, qw, s, m);
    else dispatch_rows<8, false, T, MT>(out, x, M, K, N, qw, s, m);
  } else {
    if (m) dispatch_rows<4, true, T, MT>(out, x, M, K, N, qw, s, m);
    else dispatch_rows<4, false, T, MT>(out, x, M, K, N, qw, s, m);
  }
}

// out [M, N] and x [M, K] (contiguous, float32 or bfloat16, one dtype); qweight int8
// [N, K] (bits 8) or uint8 [N, K / 2] (bits 4); scales and mins fp16 [N, K / 32].
void quant_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& qweight,
                  const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                  int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous(), "x, out: contiguous 2-D");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "x and out: one dtype");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  nvllm_cpu::check_quant_weight(qweight, scales, mins, bits, N, K);
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out: [M, N]");
  const auto* qw = static_cast<const uint8_t*>(qweight.data_ptr());
  const auto* s = scales.data_ptr<c10::Half>();
  auto go = [&](auto* m) {
    if (x.scalar_type() == at::kFloat) {
      run(out.data_ptr<float>(), x.data_ptr<float>(), M, K, N, qw, s, m, bits);
    } else {
      TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
      std::vector<float> xf(M * K);
      const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
      for (int64_t i = 0; i < M * K; ++i) xf[i] = nvllm_cpu::to_float(xb[i]);
      run(reinterpret_cast<uint16_t*>(out.data_ptr()), xf.data(), M, K, N, qw, s, m, bits);
    }
  };
  nvllm_cpu::with_mins(mins, go);
}

// out [N, K] (float32 or bfloat16, contiguous): the weight's values.
void quant_dequantize(at::Tensor out, const at::Tensor& qweight, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& mins, int64_t bits) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), "out: contiguous [N, K]");
  const int64_t N = out.size(0), K = out.size(1);
  nvllm_cpu::check_quant_weight(qweight, scales, mins, bits, N, K);
  const auto* qw = static_cast<const uint8_t*>(qweight.data_ptr());
  const auto* s = scales.data_ptr<c10::Half>();
  auto go = [&](auto* o, auto* m) {
    using T = std::remove_pointer_t<decltype(o)>;
    using MT = std::remove_const_t<std::remove_pointer_t<decltype(m)>>;
    if (bits == 8) {
      if (m) dequant_rows<8, true, T, MT>(o, K, N, qw, s, m);
      else dequant_rows<8, false, T, MT>(o, K, N, qw, s, m);
    } else {
      if (m) dequant_rows<4, true, T, MT>(o, K, N, qw, s, m);
      else dequant_rows<4, false, T, MT>(o, K, N, qw, s, m);
    }
  };
  auto with_out = [&](auto* m) {
    if (out.scalar_type() == at::kFloat) {
      go(out.data_ptr<float>(), m);
    } else {
      TORCH_CHECK(out.scalar_type() == at::kBFloat16, "out must be float32 or bfloat16");
      go(reinterpret_cast<uint16_t*>(out.data_ptr()), m);
    }
  };
  nvllm_cpu::with_mins(mins, with_out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nvllm_cpu, m) {
  m.def("quant_linear(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, Tensor? mins, "
        "int bits) -> ()");
  m.def("quant_dequantize(Tensor(a!) out, Tensor qweight, Tensor scales, Tensor? mins, "
        "int bits) -> ()");
}

TORCH_LIBRARY_IMPL(nvllm_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
