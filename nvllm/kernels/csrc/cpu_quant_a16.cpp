// x W^T with x rounded to int16 per group of 32 and integer dot products, for the grouped
// weights of nvllm/worker/layers/quant.py (int8, or int4 in GGUF's nibble order; an fp16
// scale per group of 32 and optionally a min), at decode (up to 8 rows of x) on AVX2.
//
// Why: at one row the float op (cpu_quant_linear.cpp) spends ~20 instructions on each
// group of 32 weights (widen to int32, convert, four multiplies, the scale), and a
// decode step of SmolLM2-135M on 2 AVX2 cores is mostly that. With x in int16 the weights
// widen only to int16 and vpmaddwd multiplies 16 pairs and sums them in twos into int32
// lanes: ~11 instructions a group. llama.cpp rounds x to int8 (cpu_quant_vnni.cpp does
// too) and moves greedy output on the real model; int16's rounding is 256 times finer,
// about a hundredth of bfloat16's.
//
// The arithmetic, per row of x and group g of 32 (d: the weight's scale, m: its min, or
// -8 d for int4 without one, or 0):
//   dx = max|x| * (1/32767), qx = round(x * (1/dx)) (to nearest even), Sx = sum(qx)
//   y += d * dx * sum(q * qx) + m * dx * Sx
// with q the stored integer (int4: the nibble 0..15; int8: as stored, signed). So y is
// exactly W's dequantized values times x's int16-rounded values, up to the order of
// float32 sums: the only error against the float reference is x's rounding, at most
// dx / 2 per value (what the contract tests bound). The integer sums fit int32: a group's
// |sum(q * qx)| is at most 32 * 128 * 32767.
//
// Built wherever AVX2 + FMA + F16C are, AVX-512 CPUs included: there too the loop stays
// 256 bits wide, which keeps three vector ports busy where 512-bit code has two (on a
// 2-core Xeon with AVX-512 and AMX, a decode step of the real model at one row: 6.9 ms
// against the AVX-512 float op's 11.1). Elsewhere quant_a16_vectorized() is false and
// the op runs portable loops (the same results, slower), which
// nvllm/worker/layers/quant.py then does not take.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define NVLLM_A16_AVX2 1
#include <immintrin.h>
#endif

#include "bf16.h"
#include "quant_args.h"

namespace {

using nvllm_cpu::kQuantGroup;
using nvllm_cpu::kQuantMaxRows;
#if defined(__AVX2__)
using nvllm_cpu::prefetch_columns;
#endif

using nvllm_cpu::scale_to_float;

// x's rows rounded per group: qx [M, G * 32] int16; dx and xs = dx * Sx [M, gpad] (G
// rounded up to 8, zero-padded, so eight groups load as one vector).
struct QuantX16 {
  int64_t M, G, gpad;
  std::vector<int16_t> qx;
  std::vector<float> dx, xs;
};

template <typename XT>
QuantX16 quantize_x16(const XT* x, int64_t M, int64_t K) {
  const int64_t G = K / kQuantGroup, gpad = (G + 7) / 8 * 8;
  QuantX16 q{M, G, gpad, std::vector<int16_t>(M * K), std::vector<float>(M * gpad, 0.f),
             std::vector<float>(M * gpad, 0.f)};
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const XT* xg = x + (r * G + g) * kQuantGroup;
      float v[kQuantGroup], amax = 0.f;
      for (int j = 0; j < kQuantGroup; ++j) {
        v[j] = nvllm_cpu::to_float(xg[j]);
        amax = std::max(amax, std::fabs(v[j]));
      }
      // amax times float32's 1/32767, written so (the tests reproduce the rounding).
      const float d = amax * (1.f / 32767.f);
      const float id = d > 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      int16_t* out = q.qx.data() + (r * G + g) * kQuantGroup;
      for (int j = 0; j < kQuantGroup; ++j) {
        const int32_t c = std::min(32767, std::max(-32767, static_cast<int32_t>(
                                                               std::nearbyint(v[j] * id))));
        out[j] = static_cast<int16_t>(c);
        sum += c;
      }
      q.dx[r * gpad + g] = d;
      q.xs[r * gpad + g] = d * static_cast<float>(sum);
    }
  return q;
}

// The term added per group besides d * q: the min, -8 d (int4 without one), or none.
template <int BITS, bool MIN, typename MT>
inline float min_term(const c10::Half* s, const MT* m, int64_t g) {
  if constexpr (MIN) return scale_to_float(m[g]);
  else return BITS == 4 ? -8.f * scale_to_float(s[g]) : 0.f;
}

#if defined(NVLLM_A16_AVX2)
// Eight groups' scales and min terms from g0 as floats.
template <int BITS, bool MIN, typename MT>
inline void group_terms8(const c10::Half* s, const MT* m, int64_t g0, __m256& d, __m256& mt) {
  d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g0)));
  if constexpr (!MIN) {
    mt = BITS == 4 ? _mm256_mul_ps(d, _mm256_set1_ps(-8.f)) : _mm256_setzero_ps();
  } else if constexpr (std::is_same_v<MT, float>) {
    mt = _mm256_loadu_ps(m + g0);
  } else {
    mt = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g0)));
  }
}

// One group's 32 stored integers as int16: values 0-15 and 16-31.
template <int BITS>
inline void group_int16(const uint8_t* qg, __m256i& w0, __m256i& w1) {
  if constexpr (BITS == 8) {
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg)));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16)));
  } else {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg)));
    w0 = _mm256_and_si256(b, _mm256_set1_epi16(0x0F));
    w1 = _mm256_srli_epi16(b, 4);
  }
}

// sum(q * qx) of one group in 8 int32 lanes, as floats.
inline __m256 group_dot(const __m256i w0, const __m256i w1, const int16_t* xg) {
  const __m256i p = _mm256_add_epi32(
      _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg))),
      _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16))));
  return _mm256_cvtepi32_ps(p);
}

// NC consecutive output columns (rows of W qrow bytes apart) against R rows of x (rows
// r0..): per group and column, the weights widened to int16 once, then per row two
// vpmaddwd and one conversion; the scale d * dx applied by one fma per group. Each
// (column, row) pair is its own chain of dependent fmas: at one row two columns give the
// core two chains to interleave. Groups go eight at a time (their scales converted in
// one instruction, each group's d * dx broadcast from a register by a permute); the last
// G % 8 one by one with scalar terms (K = 576 leaves 2): building a vector of them in
// memory would stall on store forwarding once per column, a third of a column's time.
template <int BITS, bool MIN, int R, int NC, typename MT>
inline void columns_a16(const QuantX16& xq, int64_t r0, const uint8_t* q, int64_t qrow,
                        const c10::Half* s, const MT* m, float (&out)[NC][R]) {
  constexpr int64_t gbytes = BITS == 8 ? kQuantGroup : kQuantGroup / 2;
  constexpr bool kMin = MIN || BITS == 4;
  const int64_t G = xq.G, gpad = xq.gpad, G8 = G / 8 * 8;
  __m256 acc[NC][R], macc[NC][R];
  float tail[NC][R] = {};
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = macc[c][r] = _mm256_setzero_ps();
  const int16_t* qx = xq.qx.data();
  const float* dx = xq.dx.data();
  const float* xs = xq.xs.data();
  for (int64_t g0 = 0; g0 < G8; g0 += 8) {
    __m256 sd[NC][R];  // d * dx per (column, row) for the eight groups
    for (int c = 0; c < NC; ++c) {
      __m256 d, mt;
      group_terms8<BITS, MIN, MT>(s + c * G, MIN ? m + c * G : nullptr, g0, d, mt);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * gpad + g0;
        sd[c][r] = _mm256_mul_ps(d, _mm256_loadu_ps(dx + at));
        if constexpr (kMin)
          macc[c][r] = _mm256_fmadd_ps(mt, _mm256_loadu_ps(xs + at), macc[c][r]);
      }
    }
    for (int i = 0; i < 8; ++i) {
      const int64_t g = g0 + i;
      const __m256i lane = _mm256_set1_epi32(i);
      for (int c = 0; c < NC; ++c) {
        __m256i w0, w1;
        group_int16<BITS>(q + c * qrow + g * gbytes, w0, w1);
        for (int r = 0; r < R; ++r)
          acc[c][r] = _mm256_fmadd_ps(group_dot(w0, w1, qx + ((r0 + r) * G + g) * kQuantGroup),
                                      _mm256_permutevar8x32_ps(sd[c][r], lane), acc[c][r]);
      }
    }
  }
  for (int64_t g = G8; g < G; ++g) {
    for (int c = 0; c < NC; ++c) {
      const float d = scale_to_float(s[c * G + g]);
      const float mt = min_term<BITS, MIN, MT>(s + c * G, MIN ? m + c * G : nullptr, g);
      __m256i w0, w1;
      group_int16<BITS>(q + c * qrow + g * gbytes, w0, w1);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * gpad + g;
        acc[c][r] = _mm256_fmadd_ps(group_dot(w0, w1, qx + ((r0 + r) * G + g) * kQuantGroup),
                                    _mm256_set1_ps(d * dx[at]), acc[c][r]);
        if constexpr (kMin) tail[c][r] += mt * xs[at];
      }
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < R; ++r)
      out[c][r] = nvllm_cpu::hsum8(kMin ? _mm256_add_ps(acc[c][r], macc[c][r]) : acc[c][r]) +
                  tail[c][r];
}

// Columns this far ahead of the one being multiplied are fetched into cache: at decode
// every weight comes from memory once per step, and the hardware prefetcher alone left
// the LM head (28 MiB of int8) at ~9 GB/s on one core.
constexpr int64_t kPrefetchCols = 8;

#else
// The stored integer of weight value j of a group (what multiplies d).
template <int BITS>
inline int32_t a16_stored(const uint8_t* qg, int j) {
  if constexpr (BITS == 8) return static_cast<int8_t>(qg[j]);
  else return j < 16 ? (qg[j] & 0xF) : (qg[j - 16] >> 4);
}

// Portable: the same arithmetic, one column, scalar loops.
template <int BITS, bool MIN, int R, int NC, typename MT>
inline void columns_a16(const QuantX16& xq, int64_t r0, const uint8_t* q, int64_t qrow,
                        const c10::Half* s, const MT* m, float (&out)[NC][R]) {
  constexpr int64_t gbytes = BITS == 8 ? kQuantGroup : kQuantGroup / 2;
  const int64_t G = xq.G;
  for (int c = 0; c < NC; ++c) {
    float acc[R] = {};
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* qg = q + c * qrow + g * gbytes;
      const float d = scale_to_float(s[c * G + g]);
      const float mt = min_term<BITS, MIN, MT>(s + c * G, MIN ? m + c * G : nullptr, g);
      for (int r = 0; r < R; ++r) {
        const int16_t* xg = xq.qx.data() + ((r0 + r) * G + g) * kQuantGroup;
        int32_t dot = 0;
        for (int j = 0; j < kQuantGroup; ++j) dot += a16_stored<BITS>(qg, j) * xg[j];
        const int64_t at = (r0 + r) * xq.gpad + g;
        acc[r] += d * xq.dx[at] * static_cast<float>(dot) + mt * xq.xs[at];
      }
    }
    for (int r = 0; r < R; ++r) out[c][r] = acc[r];
  }
}
#endif


// Columns two at a time at one or two rows (two chains), one at a time from three rows
// (R chains already).
template <int BITS, bool MIN, int R, typename T, typename MT>
void pass_a16(T* out, const QuantX16& xq, int64_t r0, int64_t N, const uint8_t* qw,
              const c10::Half* scales, const MT* mins) {
  constexpr int NC = R <= 2 ? 2 : 1;
  const int64_t G = xq.G, qrow = BITS == 8 ? G * kQuantGroup : G * kQuantGroup / 2;
  const int64_t blocks = (N + NC - 1) / NC;
  at::parallel_for(0, blocks, 16 / NC, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * NC;
#if defined(NVLLM_A16_AVX2)
      prefetch_columns<BITS, MIN, MT>(n0 + kPrefetchCols,
                                      std::min<int64_t>(NC, N - n0 - kPrefetchCols), qw, qrow,
                                      scales, mins, G);
#endif
      auto put = [&](auto& acc, int cols) {
        for (int c = 0; c < cols; ++c)
          for (int r = 0; r < R; ++r)
            out[(r0 + r) * N + n0 + c] = nvllm_cpu::from_float<T>(acc[c][r]);
      };
      if (n0 + NC <= N) {
        float acc[NC][R];
        columns_a16<BITS, MIN, R, NC, MT>(xq, r0, qw + n0 * qrow, qrow, scales + n0 * G,
                                          MIN ? mins + n0 * G : nullptr, acc);
        put(acc, NC);
      } else {
        float acc[1][R];
        columns_a16<BITS, MIN, R, 1, MT>(xq, r0, qw + n0 * qrow, qrow, scales + n0 * G,
                                         MIN ? mins + n0 * G : nullptr, acc);
        put(acc, 1);
      }
    }
  });
}

template <int BITS, bool MIN, typename T, typename MT>
void run_a16(T* out, const QuantX16& xq, int64_t N, const uint8_t* qw, const c10::Half* s,
             const MT* m) {
  for (int64_t r0 = 0; r0 < xq.M; r0 += kQuantMaxRows) {
    nvllm_cpu::with_rows(std::min(kQuantMaxRows, xq.M - r0), [&](auto R) {
      pass_a16<BITS, MIN, decltype(R)::value, T, MT>(out, xq, r0, N, qw, s, m);
    });
  }
}

// out [M, N] and x [M, K] (contiguous, float32 or bfloat16, one dtype); qweight int8
// [N, K] (bits 8) or uint8 [N, K / 2] (bits 4); scales fp16 [N, K / 32]; mins fp16 or
// float32 [N, K / 32].
void quant_linear_a16(at::Tensor out, const at::Tensor& x, const at::Tensor& qweight,
                      const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                      int64_t bits) {
  const nvllm_cpu::LinearDims dims =
      nvllm_cpu::check_quant_linear(out, x, qweight, scales, mins, bits);
  const int64_t M = dims.M, K = dims.K, N = dims.N;
  const bool f32 = x.scalar_type() == at::kFloat;
  const QuantX16 xq = f32 ? quantize_x16(x.data_ptr<float>(), M, K)
                          : quantize_x16(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K);
  const auto* qw = static_cast<const uint8_t*>(qweight.data_ptr());
  const auto* s = scales.data_ptr<c10::Half>();
  auto go = [&](auto* m, auto* o) {
    using MT = std::remove_const_t<std::remove_pointer_t<decltype(m)>>;
    using T = std::remove_pointer_t<decltype(o)>;
    if (bits == 8) {
      if (m) run_a16<8, true, T, MT>(o, xq, N, qw, s, m);
      else run_a16<8, false, T, MT>(o, xq, N, qw, s, m);
    } else {
      if (m) run_a16<4, true, T, MT>(o, xq, N, qw, s, m);
      else run_a16<4, false, T, MT>(o, xq, N, qw, s, m);
    }
  };
  nvllm_cpu::with_mins(mins, [&](auto* m) {
    if (f32) go(m, out.data_ptr<float>());
    else go(m, reinterpret_cast<uint16_t*>(out.data_ptr()));
  });
}

// Whether this build has the AVX2 loop (else the portable one).
bool quant_a16_vectorized() {
#if defined(NVLLM_A16_AVX2)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nvllm_cpu, m) {
  m.def("quant_linear_a16(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, "
        "Tensor? mins, int bits) -> ()");
  m.def("quant_a16_vectorized() -> bool", &quant_a16_vectorized);
}

TORCH_LIBRARY_IMPL(nvllm_cpu, CPU, m) {
  m.impl("quant_linear_a16", &quant_linear_a16);
}
