// x W^T for a weight held in groups of 32 (nvllm/worker/layers/quant.py): int8 values, or
// int4 in GGUF's nibble order, each group with an fp16 scale and optionally a min (fp16,
// or float32 for AWQ / GPTQ zero points).
// Each group is dequantized in registers to float32 exactly as the reference does
// (scale * q + min, or scale * (q - 8) for int4 without a min: the products are exact in
// float32) and multiplied into float32 accumulators, one per (row of x, output column):
// so results differ from dequantize-then-matmul only by the order of the float32 sums.
// Built for decode and short prompt chunks: with AVX2, up to 4 rows of x each group's
// integers are multiplied in registers and its sum split as scale * (q . x) + min * sum(x)
// (dot_columns); from 5 rows a few columns of W are dequantized into a float32 buffer once
// and multiplied by every row (rows_buffered). Elsewhere every weight byte is read once
// per 8 rows of x.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
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
#if defined(NVLLM_QUANT_AVX2)
using nvllm_cpu::prefetch_columns;
#endif

using nvllm_cpu::scale_to_float;

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
// One group's 32 integers (int8, or int4 as 0..15) as four vectors of 8 floats (values
// 0-7, 8-15, 16-23, 24-31). An int4 group's bytes 0-7 hold values 0-7 (low nibbles) and
// 16-23 (high ones), so each 8 bytes are widened to int32 lanes once and split with a
// mask and a shift.
template <int BITS>
inline void group_values(const uint8_t* q, __m256 (&f)[4]) {
  __m256i v[4];
  if constexpr (BITS == 8) {
    for (int k = 0; k < 4; ++k)
      v[k] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k)));
  } else {
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i b =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
    const __m256i nib = _mm256_set1_epi32(0xF);
    v[0] = _mm256_and_si256(a, nib);
    v[1] = _mm256_and_si256(b, nib);
    v[2] = _mm256_srli_epi32(a, 4);
    v[3] = _mm256_srli_epi32(b, 4);
  }
  for (int k = 0; k < 4; ++k) f[k] = _mm256_cvtepi32_ps(v[k]);
}

// The group's values. vm is the min, or -8 * scale for int4 without one: fma(q, s, -8 s)
// is (q - 8) * s exactly, as every product of a small integer and an fp16 scale is in
// float32.
template <int BITS, bool MIN>
inline void dequant_group(const uint8_t* q, __m256 vs, __m256 vm, __m256 (&w)[4]) {
  __m256 f[4];
  group_values<BITS>(q, f);
  for (int k = 0; k < 4; ++k)
    w[k] = (MIN || BITS == 4) ? _mm256_fmadd_ps(f[k], vs, vm) : _mm256_mul_ps(f[k], vs);
}

template <int BITS, bool MIN>
inline void dequant_group(const uint8_t* q, float s, float m, __m256 (&w)[4]) {
  dequant_group<BITS, MIN>(q, _mm256_set1_ps(s),
                           _mm256_set1_ps(MIN ? m : (BITS == 4 ? -8.f * s : 0.f)), w);
}

// Groups g0.. (up to 8) of one row: scales into sf, and into mf what dequant_group adds
// (the min, or -8 * scale for int4 without one). Eight fp16 values convert in one
// instruction; a short tail one by one.
template <int BITS, bool MIN, typename MT>
inline void group_params(const c10::Half* s, const MT* m, int64_t g0, int64_t G, float* sf,
                         float* mf) {
  const int gn = static_cast<int>(G - g0 < 8 ? G - g0 : 8);
  if (gn == 8) {
    const __m256 S = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g0)));
    _mm256_storeu_ps(sf, S);
    if constexpr (MIN) {
      if constexpr (std::is_same_v<MT, float>) {
        _mm256_storeu_ps(mf, _mm256_loadu_ps(m + g0));
      } else {
        _mm256_storeu_ps(mf, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g0))));
      }
    } else if constexpr (BITS == 4) {
      _mm256_storeu_ps(mf, _mm256_mul_ps(S, _mm256_set1_ps(-8.f)));
    }
  } else {
    for (int i = 0; i < gn; ++i) {
      sf[i] = scale_to_float(s[g0 + i]);
      if constexpr (MIN) mf[i] = scale_to_float(m[g0 + i]);
      else mf[i] = BITS == 4 ? -8.f * sf[i] : 0.f;
    }
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

// A row of G groups into o (float32): what the reference dequantizes.
template <int BITS, bool MIN, typename MT>
inline void dequant_row(float* o, const uint8_t* q, const c10::Half* s, const MT* m,
                        int64_t G) {
  constexpr int64_t gbytes = BITS == 8 ? kQuantGroup : kQuantGroup / 2;
  for (int64_t g = 0; g < G; ++g)
    dequant_to<BITS, MIN>(q + g * gbytes, scale_to_float(s[g]), MIN ? scale_to_float(m[g]) : 0.f,
                          o + g * kQuantGroup);
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
    dequant_group<BITS, MIN>(q + g * gbytes, scale_to_float(s[g]),
                             MIN ? scale_to_float(m[g]) : 0.f, w0, w1);
    const float* xg = x + g * kQuantGroup;
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg + r * K), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + r * K + 16), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) acc_out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}
#elif defined(NVLLM_QUANT_AVX2)
// The AVX2 form, for NC consecutive output columns (rows of W qrow bytes apart) at once.
// A group's value is s * q + m (m: the min, -8 s for int4 without one, 0 for int8
// without), so its dot with x is s * (q . x) + m * sum(x): the integers q convert to
// float32 and multiply x directly, one fma per group applies the scale, and the mins meet
// x's group sums (xs, made once per call by group_sums) eight groups per fma. Per group
// that is a third fewer instructions than dequantizing s * q + m first; the sums differ
// from dequantize-then-matmul's only by float32 rounding, as any summation order does.
// At one row of x a single column's group products are a chain of dependent additions;
// two int4 columns give the core two chains to interleave (measured: 1.2x).
template <int BITS, bool MIN, int R, int NC, typename MT>
inline void dot_columns(const float* x, const float* xs, int64_t K, const uint8_t* q,
                        int64_t qrow, const c10::Half* s, const MT* m,
                        float (&acc_out)[NC][R]) {
  constexpr bool kMin = MIN || BITS == 4;  // a term besides s * q
  __m256 acc[NC][R], macc[NC][R];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = macc[c][r] = _mm256_setzero_ps();
  const int64_t G = K / kQuantGroup;
  const int64_t Gp = (G + 7) / 8 * 8;  // xs rows are padded with zero sums to whole 8s
  constexpr int64_t gbytes = BITS == 8 ? kQuantGroup : kQuantGroup / 2;
  // Scales and mins converted 8 groups at a time; a short last block leaves the lanes
  // past it as they were (finite), and xs's zero padding cancels them.
  alignas(32) float sf[NC][8] = {}, mf[NC][8] = {};
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    for (int c = 0; c < NC; ++c)
      group_params<BITS, MIN, MT>(s + c * G, MIN ? m + c * G : nullptr, g0, G, sf[c], mf[c]);
    if constexpr (kMin) {
      for (int c = 0; c < NC; ++c) {
        const __m256 vm = _mm256_load_ps(mf[c]);
        for (int r = 0; r < R; ++r)
          macc[c][r] = _mm256_fmadd_ps(vm, _mm256_loadu_ps(xs + r * Gp + g0), macc[c][r]);
      }
    }
    const int gn = static_cast<int>(G - g0 < 8 ? G - g0 : 8);
    for (int i = 0; i < gn; ++i) {
      const int64_t g = g0 + i;
      const float* xg = x + g * kQuantGroup;
      for (int c = 0; c < NC; ++c) {
        __m256 f[4];
        group_values<BITS>(q + c * qrow + g * gbytes, f);  // the integers, unscaled
        const __m256 vs = _mm256_set1_ps(sf[c][i]);
        for (int r = 0; r < R; ++r) {
          const float* xr = xg + r * K;
          __m256 p = _mm256_mul_ps(f[0], _mm256_loadu_ps(xr));
          const __m256 p1 = _mm256_mul_ps(f[1], _mm256_loadu_ps(xr + 8));
          p = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xr + 16), p);
          const __m256 pb = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xr + 24), p1);
          acc[c][r] = _mm256_fmadd_ps(_mm256_add_ps(p, pb), vs, acc[c][r]);
        }
      }
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < R; ++r)
      acc_out[c][r] = nvllm_cpu::hsum8(kMin ? _mm256_add_ps(acc[c][r], macc[c][r])
                                            : acc[c][r]);
}

// x's group sums for dot_columns: xs[r * Gp + g] = x[r, 32 g .. 32 g + 31] summed, each
// row padded with zeros to Gp (a multiple of 8) groups.
inline std::vector<float> group_sums(const float* x, int64_t R, int64_t K) {
  const int64_t G = K / kQuantGroup, Gp = (G + 7) / 8 * 8;
  std::vector<float> xs(R * Gp, 0.f);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* p = x + r * K + g * kQuantGroup;
      const __m256 a = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(p + 16),
                                                   _mm256_loadu_ps(p + 24)));
      xs[r * Gp + g] = nvllm_cpu::hsum8(a);
    }
  return xs;
}

// One output column: dot_columns with NC = 1 (the form the other builds define).
template <int BITS, bool MIN, int R, typename MT>
inline void dot_column(const float* x, const float* xs, int64_t K, const uint8_t* q,
                       const c10::Half* s, const MT* m, float* acc_out) {
  float acc[1][R];
  dot_columns<BITS, MIN, R, 1, MT>(x, xs, K, q, 0, s, m, acc);
  for (int r = 0; r < R; ++r) acc_out[r] = acc[0][r];
}

// Many rows of x (kBufferedMinRows and more): the dequantize-in-register loop above holds
// 2 * R accumulators, which past 5 rows no longer fit AVX2's 16 registers. Instead,
// kBufCols columns of W are dequantized once into a float32 buffer (exactly as
// dequant_group computes them: the same values as the reference) and every row of x is
// multiplied against the buffer by a register-blocked kernel: kBufCols x RB dot products,
// one accumulator each, one load of W per kBufCols * RB FMAs.
// Measured on SmolLM2's shapes at 16 rows, two threads (a 2-core EPYC, AVX2): 1.5-1.6x
// the loop above (3072 x 576: 606 against 947 us).
constexpr int kBufCols = 3;
constexpr int64_t kBufferedMinRows = 5;
// Rows of x per pass over W: each pass dequantizes W's columns again (a few percent of a
// pass at this many rows) and sweeps its rows of x from cache (128 x 1536 float32 is
// 768 KiB, within a core's L2 on the machines measured), so a prompt of any length runs
// at about the per-row cost of 128 rows: on SmolLM2's shapes at 128-512 rows that is
// level with or faster than dequantized tiles and torch.mm, without the tiles' memory.
constexpr int64_t kBufferedChunkRows = 128;

template <int C, int RB, typename T>
inline void buffered_block(const float* buf, int64_t K, const float* x, T* out, int64_t N) {
  __m256 acc[C][RB];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < RB; ++r) acc[c][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 w[C];
    for (int c = 0; c < C; ++c) w[c] = _mm256_loadu_ps(buf + c * K + k);
    for (int r = 0; r < RB; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[c][r] = _mm256_fmadd_ps(w[c], xv, acc[c][r]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < C; ++c) out[r * N + c] = nvllm_cpu::from_float<T>(nvllm_cpu::hsum8(acc[c][r]));
}

template <int C, typename T>
void buffered_rows(const float* buf, int64_t K, const float* x, int64_t M, T* out, int64_t N) {
  constexpr int RB = 4;
  int64_t r = 0;
  for (; r + RB <= M; r += RB) buffered_block<C, RB, T>(buf, K, x + r * K, out + r * N, N);
  switch (M - r) {
    case 3: buffered_block<C, 3, T>(buf, K, x + r * K, out + r * N, N); break;
    case 2: buffered_block<C, 2, T>(buf, K, x + r * K, out + r * N, N); break;
    case 1: buffered_block<C, 1, T>(buf, K, x + r * K, out + r * N, N); break;
    default: break;
  }
}

template <int BITS, bool MIN, typename T, typename MT>
void rows_buffered(T* out, const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* qw,
                   const c10::Half* scales, const MT* mins) {
  const int64_t G = K / kQuantGroup;
  const int64_t qrow = BITS == 8 ? K : K / 2;
  const int64_t blocks = (N + kBufCols - 1) / kBufCols;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(kBufCols * K);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kBufCols;
      const int cols = static_cast<int>(std::min<int64_t>(kBufCols, N - n0));
      for (int c = 0; c < cols; ++c) {
        const int64_t n = n0 + c;
        dequant_row<BITS, MIN, MT>(buf.data() + c * K, qw + n * qrow, scales + n * G,
                                   MIN ? mins + n * G : nullptr, G);
      }
      // The next block's weights stream from memory while this one's products run (the
      // hardware prefetcher, seeing no reads of W during them, fetches too late).
      if (blk + 1 < end)
        prefetch_columns<BITS, MIN, MT>(n0 + kBufCols,
                                        std::min<int64_t>(kBufCols, N - n0 - kBufCols), qw,
                                        qrow, scales, mins, G);
      T* o = out + n0;
      switch (cols) {
        case 3: buffered_rows<3, T>(buf.data(), K, x, M, o, N); break;
        case 2: buffered_rows<2, T>(buf.data(), K, x, M, o, N); break;
        default: buffered_rows<1, T>(buf.data(), K, x, M, o, N); break;
      }
    }
  });
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
    dequant_to<BITS, MIN>(q + g * gbytes, scale_to_float(s[g]), MIN ? scale_to_float(m[g]) : 0.f,
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
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(std::is_same_v<T, float> ? 0 : K);  // bfloat16: rounded from it
    for (int64_t n = begin; n < end; ++n) {
      const MT* mn = MIN ? mins + n * G : nullptr;
      if constexpr (std::is_same_v<T, float>) {
        dequant_row<BITS, MIN, MT>(out + n * K, qw + n * qrow, scales + n * G, mn, G);
      } else {
        dequant_row<BITS, MIN, MT>(row.data(), qw + n * qrow, scales + n * G, mn, G);
        for (int64_t k = 0; k < K; ++k) out[n * K + k] = nvllm_cpu::from_float<T>(row[k]);
      }
    }
  });
}

template <int BITS, bool MIN, int R, typename T, typename MT>
void rows_pass(T* out, const float* x, int64_t K, int64_t N, const uint8_t* qw,
               const c10::Half* scales, const MT* mins) {
  const int64_t G = K / kQuantGroup;
  const int64_t qrow = BITS == 8 ? K : K / 2;
#if defined(NVLLM_QUANT_AVX2)
  // Two int4 columns at a time at one row (int8: measured 2.7x slower on the 49152 x 576
  // LM head, two streams of 576-byte rows; no faster on the other shapes).
  constexpr int NC = R == 1 && BITS == 4 ? 2 : 1;
#else
  constexpr int NC = 1;
#endif
#if defined(NVLLM_QUANT_AVX2)
  const std::vector<float> xs = group_sums(x, R, K);
#endif
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float acc[NC][R];
    int64_t n = begin;
#if defined(NVLLM_QUANT_AVX2)
    for (; n + NC <= end; n += NC) {
      dot_columns<BITS, MIN, R, NC, MT>(x, xs.data(), K, qw + n * qrow, qrow, scales + n * G,
                                        MIN ? mins + n * G : nullptr, acc);
      for (int c = 0; c < NC; ++c)
        for (int r = 0; r < R; ++r) out[r * N + n + c] = nvllm_cpu::from_float<T>(acc[c][r]);
    }
    for (; n < end; ++n) {
      dot_column<BITS, MIN, R, MT>(x, xs.data(), K, qw + n * qrow, scales + n * G,
                                   MIN ? mins + n * G : nullptr, acc[0]);
      for (int r = 0; r < R; ++r) out[r * N + n] = nvllm_cpu::from_float<T>(acc[0][r]);
    }
#else
    for (; n < end; ++n) {
      dot_column<BITS, MIN, R, MT>(x, K, qw + n * qrow, scales + n * G,
                                   MIN ? mins + n * G : nullptr, acc[0]);
      for (int r = 0; r < R; ++r) out[r * N + n] = nvllm_cpu::from_float<T>(acc[0][r]);
    }
#endif
  });
}

template <int BITS, bool MIN, typename T, typename MT>
void dispatch_rows(T* out, const float* x, int64_t M, int64_t K, int64_t N,
                   const uint8_t* qw, const c10::Half* s, const MT* m) {
#if defined(NVLLM_QUANT_AVX2)
  if (M >= kBufferedMinRows) {
    for (int64_t r0 = 0; r0 < M; r0 += kBufferedChunkRows)
      rows_buffered<BITS, MIN, T, MT>(out + r0 * N, x + r0 * K,
                                      std::min(kBufferedChunkRows, M - r0), K, N, qw, s, m);
    return;
  }
#endif
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
  const nvllm_cpu::LinearDims dims =
      nvllm_cpu::check_quant_linear(out, x, qweight, scales, mins, bits);
  const int64_t M = dims.M, K = dims.K, N = dims.N;
  const auto* qw = static_cast<const uint8_t*>(qweight.data_ptr());
  const auto* s = scales.data_ptr<c10::Half>();
  auto go = [&](auto* m) {
    if (x.scalar_type() == at::kFloat) {
      run(out.data_ptr<float>(), x.data_ptr<float>(), M, K, N, qw, s, m, bits);
    } else {  // bfloat16
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

// Whether many rows of x take the buffered kernel (the AVX2 build), which beats
// dequantizing tiles for torch.mm up to 64 rows (nvllm/worker/layers/quant.py reads it).
bool quant_linear_buffered() {
#if defined(NVLLM_QUANT_AVX2)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nvllm_cpu, m) {
  m.def("quant_linear_buffered() -> bool", &quant_linear_buffered);
  m.def("quant_linear(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, Tensor? mins, "
        "int bits) -> ()");
  m.def("quant_dequantize(Tensor(a!) out, Tensor qweight, Tensor scales, Tensor? mins, "
        "int bits) -> ()");
}

TORCH_LIBRARY_IMPL(nvllm_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
