// x W^T with x quantized to int8 per block of 32 (llama.cpp's Q8_0 / Q8_1 activations)
// and integer dot products, for the grouped weights of nvllm/worker/layers/quant.py (int8,
// or int4 in GGUF's nibble order; an fp16 scale per group of 32 and optionally a min).
//
// Why: at decode every weight is read once per token, and the dequantize-in-register op
// (cpu_quant_linear.cpp) spends ~4 float instructions on every 16 weights; with x in int8,
// AVX-512 VNNI's vpdpbusd multiplies 64 unsigned bytes by 64 signed ones and sums them in
// fours into 16 int32 lanes in one instruction.
//
// The arithmetic, per row of x and group g of 32 (d: the weight's scale, m: its min or 0):
//   dx = max|x| * (1/127), qx = round(x * (1/dx)) (to nearest), Sx = sum(qx)
//   y += d * dx * sum(q * qx) + m * dx * Sx
// with q the stored integer (int4: the nibble, minus 8 without a min; int8: as stored).
// So y is exactly W's dequantized values times x's int8-rounded values, up to the order
// of float32 sums: the only error against the float reference is x's rounding, at most
// dx / 2 per value (what the contract tests bound).
// vpdpbusd takes unsigned weights: int4 nibbles are 0..15 already (q - 8 is the integer
// sum minus 8 Sx), int8 weights are stored signed and read as q + 128 (an xor), minus 128
// Sx. Those corrections are exact int32 subtractions.
//
// With AVX2 only (AMD Zen 1-3, most client CPUs), the same arithmetic with vpmaddubsw
// (32 unsigned x signed byte products, summed in pairs into int16: at most 2 * 128 * 127,
// no saturation, because int8 weights go in as |q| against x with q's sign) and vpmaddwd
// (pairs of int16 into int32). Without either, portable scalar loops: correct
// everywhere, fast nowhere; quant_a8_vectorized() says whether a vector loop was built,
// and nvllm/worker/layers/quant.py uses this op only where it is.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define NVLLM_A8_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 without AVX-512 VNNI: vpmaddubsw / vpmaddwd, llama.cpp's AVX2 route.
#define NVLLM_A8_AVX2 1
#include <immintrin.h>
#endif

#include "bf16.h"
#include "quant_args.h"

namespace {

using nvllm_cpu::kQuantGroup;
using nvllm_cpu::kQuantMaxRows;

using nvllm_cpu::scale_to_float;

// x's rows quantized per group: qx [M, G * 32] int8, dx [M, G], sx [M, G] (sum of qx).
struct QuantX {
  int64_t M, G;
  std::vector<int8_t> qx;
  std::vector<float> dx;
  std::vector<int32_t> sx;
};

template <typename XT>
QuantX quantize_x(const XT* x, int64_t M, int64_t K) {
  QuantX q{M, K / kQuantGroup, std::vector<int8_t>(M * K), std::vector<float>(M * (K / kQuantGroup)),
           std::vector<int32_t>(M * (K / kQuantGroup))};
  for (int64_t i = 0; i < M * q.G; ++i) {
    const XT* xg = x + i * kQuantGroup;
    float v[kQuantGroup], amax = 0.f;
    for (int j = 0; j < kQuantGroup; ++j) {
      v[j] = nvllm_cpu::to_float(xg[j]);
      amax = std::max(amax, std::fabs(v[j]));
    }
    // amax times float32's 1/127, written so: -ffast-math may turn a division by 127
    // into that product anyway, and the tests reproduce the rounding (ties included).
    const float d = amax * (1.f / 127.f);
    const float id = d > 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < kQuantGroup; ++j) {
      const int32_t r = static_cast<int32_t>(std::nearbyint(v[j] * id));
      const int32_t c = std::min(127, std::max(-127, r));
      q.qx[i * kQuantGroup + j] = static_cast<int8_t>(c);
      sum += c;
    }
    q.dx[i] = d;
    q.sx[i] = sum;
  }
  return q;
}

// The stored integer of weight value j of a group (what multiplies d).
template <int BITS, bool MIN>
inline int32_t stored(const uint8_t* qg, int j) {
  if constexpr (BITS == 8) {
    return static_cast<int8_t>(qg[j]);
  } else {
    const int32_t nib = j < 16 ? (qg[j] & 0xF) : (qg[j - 16] >> 4);
    return MIN ? nib : nib - 8;
  }
}

// Portable: one output column, R rows of x, the arithmetic of the header.
template <int BITS, bool MIN, int R, typename MT>
void column_scalar(const QuantX& xq, int64_t r0, const uint8_t* q, const c10::Half* s,
                   const MT* m, float* out) {
  constexpr int64_t gbytes = BITS == 8 ? kQuantGroup : kQuantGroup / 2;
  const int64_t G = xq.G;
  float acc[R] = {};
  for (int64_t g = 0; g < G; ++g) {
    int32_t w[kQuantGroup];
    for (int j = 0; j < kQuantGroup; ++j) w[j] = stored<BITS, MIN>(q + g * gbytes, j);
    const float d = scale_to_float(s[g]);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * G + g;
      const int8_t* xg = xq.qx.data() + i * kQuantGroup;
      int32_t dot = 0;
      for (int j = 0; j < kQuantGroup; ++j) dot += w[j] * xg[j];
      acc[r] += d * xq.dx[i] * static_cast<float>(dot);
      if constexpr (MIN) acc[r] += scale_to_float(m[g]) * xq.dx[i] * static_cast<float>(xq.sx[i]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

#if defined(NVLLM_A8_VNNI)
// x rearranged for the vector loop, one "step" (S groups, 64 weight bytes) at a time.
// int4 (S = 4): a step's 64 bytes are 4 groups of 16 nibble pairs; their low nibbles
// (values 0-15 of each group) meet x bytes [qx_g[0:16] for the 4 groups], their high ones
// (16-31) the next 64 bytes. int8 (S = 2): 64 bytes of 2 groups, x in its own order.
// Each group owns 16 / S int32 lanes of vpdpbusd's result: dxl holds dx in each of them,
// off the integer correction (offset * Sx) in a group's first lane. The min's term,
// sum_g m_g * (dx_g * Sx_g), is a dot product over groups of its own: xs holds dx * Sx
// per group, 16 groups a vector.
struct LanesX {
  int64_t steps, gpad;
  std::vector<int8_t> qx;     // [M, steps, 128 (int4) or 64 (int8)], zero-padded
  std::vector<float> dxl;     // [M, steps, 16]
  std::vector<int32_t> off;   // [M, steps, 16]
  std::vector<float> xs;      // [M, gpad], zero-padded
};

template <int BITS, bool MIN>
LanesX lanes_x(const QuantX& xq) {
  constexpr int64_t S = BITS == 8 ? 2 : 4, L = 16 / S, xb = BITS == 8 ? 64 : 128;
  constexpr int32_t offset = BITS == 8 ? 128 : (MIN ? 0 : 8);
  const int64_t G = xq.G, steps = (G + S - 1) / S, gpad = (G + 15) / 16 * 16;
  LanesX lx{steps, gpad, std::vector<int8_t>(xq.M * steps * xb, 0),
            std::vector<float>(xq.M * steps * 16, 0.f),
            std::vector<int32_t>(xq.M * steps * 16, 0),
            std::vector<float>(xq.M * gpad, 0.f)};
  for (int64_t r = 0; r < xq.M; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = r * G + g, t = g / S, jj = g % S;
      const int8_t* src = xq.qx.data() + i * kQuantGroup;
      int8_t* dst = lx.qx.data() + (r * steps + t) * xb;
      if constexpr (BITS == 8) {
        std::copy(src, src + kQuantGroup, dst + jj * kQuantGroup);
      } else {
        std::copy(src, src + 16, dst + jj * 16);
        std::copy(src + 16, src + 32, dst + 64 + jj * 16);
      }
      const int64_t lane0 = (r * steps + t) * 16 + jj * L;
      for (int64_t l = 0; l < L; ++l) lx.dxl[lane0 + l] = xq.dx[i];
      lx.off[lane0] = offset * xq.sx[i];
      lx.xs[r * gpad + g] = xq.dx[i] * static_cast<float>(xq.sx[i]);
    }
  }
  return lx;
}

// S consecutive fp16 scales (or fp16 / float32 mins), n <= S of them real, each
// repeated over its group's 16 / S lanes.
template <int S>
inline __m512 expand(const c10::Half* p, int n) {
  const __m128 v = _mm_cvtph_ps(_mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << n) - 1), p));
  const __m512i idx = S == 4 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                             : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}
// Up to 16 consecutive mins (fp16 or float32) as floats, the rest 0.
inline __m512 load16(const c10::Half* p, int n) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p));
}
inline __m512 load16(const float* p, int n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}

// One output column against R rows of x (rows r0.. of lx).
template <int BITS, bool MIN, int R, typename MT>
inline void column_vnni(const LanesX& lx, int64_t r0, int64_t G, const uint8_t* q,
                        const c10::Half* s, const MT* m, float* out) {
  constexpr int S = BITS == 8 ? 2 : 4;
  constexpr int64_t xb = BITS == 8 ? 64 : 128, gbytes = BITS == 8 ? kQuantGroup : kQuantGroup / 2;
  constexpr bool has_off = BITS == 8 || !MIN;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t t = 0; t < lx.steps; ++t) {
    const int64_t g0 = t * S;
    const int n = static_cast<int>(std::min<int64_t>(S, G - g0));
    const uint8_t* qt = q + g0 * gbytes;
    const __m512i v = n == S ? _mm512_loadu_si512(qt)
                             : _mm512_maskz_loadu_epi8((~0ULL) >> (64 - n * gbytes), qt);
    const __m512 d = expand<S>(s + g0, n);
    __m512i lo, hi;
    if constexpr (BITS == 8) {
      lo = _mm512_xor_si512(v, flip);
    } else {
      lo = _mm512_and_si512(v, nib);
      hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * lx.steps + t;
      const int8_t* xr = lx.qx.data() + at * xb;
      __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xr));
      if constexpr (BITS == 4) isum = _mm512_dpbusd_epi32(isum, hi, _mm512_loadu_si512(xr + 64));
      if constexpr (has_off) isum = _mm512_sub_epi32(isum, _mm512_loadu_si512(lx.off.data() + at * 16));
      const __m512 dd = _mm512_mul_ps(d, _mm512_loadu_ps(lx.dxl.data() + at * 16));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), dd, acc[r]);
    }
  }
  if constexpr (MIN) {  // sum_g m_g * dx_g * Sx_g, 16 groups at a time
    for (int64_t g0 = 0; g0 < G; g0 += 16) {
      const __m512 mn = load16(m + g0, static_cast<int>(std::min<int64_t>(16, G - g0)));
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(mn, _mm512_loadu_ps(lx.xs.data() + (r0 + r) * lx.gpad + g0), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

#if defined(NVLLM_A8_AVX2)
struct Avx2X {  // x as quantized, and its min terms
  const QuantX& xq;
  int64_t gpad;           // G rounded up to 8
  std::vector<float> xs;  // [M, gpad]: dx * Sx per group, zero-padded
};

inline Avx2X avx2_x(const QuantX& xq, bool mins) {
  const int64_t gpad = (xq.G + 7) / 8 * 8;
  Avx2X a{xq, gpad, std::vector<float>(mins ? xq.M * gpad : 0, 0.f)};
  if (mins)
    for (int64_t r = 0; r < xq.M; ++r)
      for (int64_t g = 0; g < xq.G; ++g)
        a.xs[r * gpad + g] = xq.dx[r * xq.G + g] * static_cast<float>(xq.sx[r * xq.G + g]);
  return a;
}

// Up to 8 consecutive mins (fp16 or float32) as floats, the rest 0.
inline __m256 load_mins(const c10::Half* p, int n) {
  if (n == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) c10::Half h[8] = {};
  for (int i = 0; i < n; ++i) h[i] = p[i];
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}
inline __m256 load_mins(const float* p, int n) {
  if (n == 8) return _mm256_loadu_ps(p);
  alignas(32) float f[8] = {};
  for (int i = 0; i < n; ++i) f[i] = p[i];
  return _mm256_load_ps(f);
}

// One output column against R rows of x (rows r0.. of xq), the arithmetic of the header:
// per group, the integer dot product (minus offset * Sx) in 8 int32 lanes, converted and
// scaled by d * dx; the min's term as a dot product over groups at the end.
template <int BITS, bool MIN, int R, typename MT>
inline void column_avx2(const QuantX& xq, const float* xs, int64_t xs_stride, int64_t r0,
                        const uint8_t* q,
                        const c10::Half* s, const MT* m, float* out) {
  constexpr int64_t gbytes = BITS == 8 ? kQuantGroup : kQuantGroup / 2;
  constexpr int32_t offset = BITS == 4 && !MIN ? 8 : 0;
  const int64_t G = xq.G;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i nib = _mm_set1_epi8(0x0F);
  alignas(32) float sf[8];
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const int gn = static_cast<int>(G - g0 < 8 ? G - g0 : 8);
    if (gn == 8) {
      _mm256_store_ps(sf, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g0))));
    } else {
      for (int i = 0; i < gn; ++i) sf[i] = scale_to_float(s[g0 + i]);
    }
    for (int i = 0; i < gn; ++i) {
      const int64_t g = g0 + i;
      const uint8_t* qg = q + g * gbytes;
      __m256i wu;  // unsigned weight bytes
      __m256i wsign;  // int8: the weights, whose signs go onto x
      if constexpr (BITS == 8) {
        wsign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg));
        wu = _mm256_abs_epi8(wsign);
      } else {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
        wu = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), nib), _mm_and_si128(v, nib));
      }
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * G + g;
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.qx.data() + at * kQuantGroup));
        if constexpr (BITS == 8) xv = _mm256_sign_epi8(xv, wsign);
        __m256i isum = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), ones);
        if constexpr (offset != 0)
          isum = _mm256_sub_epi32(isum, _mm256_castsi128_si256(_mm_cvtsi32_si128(offset * xq.sx[at])));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(sf[i] * xq.dx[at]), acc[r]);
      }
    }
  }
  if constexpr (MIN) {  // sum_g m_g * dx_g * Sx_g, 8 groups at a time
    for (int64_t g0 = 0; g0 < G; g0 += 8) {
      const __m256 mn = load_mins(m + g0, static_cast<int>(G - g0 < 8 ? G - g0 : 8));
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(xs + (r0 + r) * xs_stride + g0), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = nvllm_cpu::hsum8(acc[r]);
}
#endif

template <int BITS, bool MIN, int R, typename T, typename MT, typename XL>
void rows_pass(T* out, const XL& xl, int64_t r0, int64_t G, int64_t N, const uint8_t* qw,
               const c10::Half* scales, const MT* mins) {
  const int64_t qrow = BITS == 8 ? G * kQuantGroup : G * kQuantGroup / 2;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float acc[R];
    for (int64_t n = begin; n < end; ++n) {
      const MT* mn = MIN ? mins + n * G : nullptr;
#if defined(NVLLM_A8_VNNI)
      column_vnni<BITS, MIN, R, MT>(xl, r0, G, qw + n * qrow, scales + n * G, mn, acc);
#elif defined(NVLLM_A8_AVX2)
      column_avx2<BITS, MIN, R, MT>(xl.xq, xl.xs.data(), xl.gpad, r0, qw + n * qrow,
                                    scales + n * G, mn, acc);
#else
      column_scalar<BITS, MIN, R, MT>(xl, r0, qw + n * qrow, scales + n * G, mn, acc);
#endif
      for (int r = 0; r < R; ++r) out[(r0 + r) * N + n] = nvllm_cpu::from_float<T>(acc[r]);
    }
  });
}

template <int BITS, bool MIN, typename T, typename MT>
void run_format(T* out, const QuantX& xq, int64_t N, const uint8_t* qw, const c10::Half* s,
                const MT* m) {
#if defined(NVLLM_A8_VNNI)
  const LanesX xl = lanes_x<BITS, MIN>(xq);
#elif defined(NVLLM_A8_AVX2)
  const Avx2X xl = avx2_x(xq, MIN);
#else
  const QuantX& xl = xq;
#endif
  const int64_t G = xq.G;
  for (int64_t r0 = 0; r0 < xq.M; r0 += kQuantMaxRows) {
    nvllm_cpu::with_rows(std::min(kQuantMaxRows, xq.M - r0), [&](auto R) {
      rows_pass<BITS, MIN, decltype(R)::value, T, MT>(out, xl, r0, G, N, qw, s, m);
    });
  }
}

template <typename T, typename MT>
void run(T* out, const QuantX& xq, int64_t N, const uint8_t* qw, const c10::Half* s,
         const MT* m, int64_t bits) {
  if (bits == 8) {
    if (m) run_format<8, true, T, MT>(out, xq, N, qw, s, m);
    else run_format<8, false, T, MT>(out, xq, N, qw, s, m);
  } else {
    if (m) run_format<4, true, T, MT>(out, xq, N, qw, s, m);
    else run_format<4, false, T, MT>(out, xq, N, qw, s, m);
  }
}

// out [M, N] and x [M, K] (contiguous, float32 or bfloat16, one dtype); qweight int8
// [N, K] (bits 8) or uint8 [N, K / 2] (bits 4); scales fp16 [N, K / 32]; mins fp16 or
// float32 [N, K / 32].
void quant_linear_a8(at::Tensor out, const at::Tensor& x, const at::Tensor& qweight,
                     const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                     int64_t bits) {
  const nvllm_cpu::LinearDims dims =
      nvllm_cpu::check_quant_linear(out, x, qweight, scales, mins, bits);
  const int64_t M = dims.M, K = dims.K, N = dims.N;
  const bool f32 = x.scalar_type() == at::kFloat;
  const QuantX xq = f32 ? quantize_x(x.data_ptr<float>(), M, K)
                        : quantize_x(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K);
  const auto* qw = static_cast<const uint8_t*>(qweight.data_ptr());
  const auto* s = scales.data_ptr<c10::Half>();
  auto go = [&](auto* m) {
    if (f32) run(out.data_ptr<float>(), xq, N, qw, s, m, bits);
    else run(reinterpret_cast<uint16_t*>(out.data_ptr()), xq, N, qw, s, m, bits);
  };
  nvllm_cpu::with_mins(mins, go);
}

// Whether this build has a vector loop, AVX-512 VNNI or AVX2 (else the portable one).
bool quant_a8_vectorized() {
#if defined(NVLLM_A8_VNNI) || defined(NVLLM_A8_AVX2)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nvllm_cpu, m) {
  m.def("quant_linear_a8(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, "
        "Tensor? mins, int bits) -> ()");
  m.def("quant_a8_vectorized() -> bool", &quant_a8_vectorized);
}

TORCH_LIBRARY_IMPL(nvllm_cpu, CPU, m) {
  m.impl("quant_linear_a8", &quant_linear_a8);
}
