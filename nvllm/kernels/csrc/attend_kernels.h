// The one-query attention routines of cpu_decode_attention.cpp, one per instruction set:
// AVX-512 (16 keys at a time, a transposing sum per 16), AVX2 + FMA (8 at a time), and a
// portable loop for the shapes without a fixed kernel (or a CPU with neither). Each reads
// one (sequence, KV head)'s keys and values through KVRows (a contiguous copy, or the
// paged cache through a block table) and writes the group's query heads' outputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// A fixed-shape kernel per (group, head_dim): AVX-512, or AVX2 + FMA (8 lanes).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define NVLLM_ATTN_FIXED 1
#endif

#include "bf16.h"

namespace nvllm_cpu_attn {

using nvllm_cpu::from_float;
using nvllm_cpu::to_float;

// Softmax numerators in place (exp(s - max)) over s[0..len); returns 1 / their sum.
inline float exp_in_place(float* s, int64_t len) {
  float mx = s[0];
  for (int64_t j = 1; j < len; ++j) mx = s[j] > mx ? s[j] : mx;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < len; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  return 1.f / sum;
}

constexpr int64_t kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kMaxHeadDim = 256;

// Where key (or value) j of one (sequence, KV head) lives, j counted from the first key a
// query sees: in the sequence's contiguous copy (a row every `stride` elements), or in the
// paged cache through the sequence's block table (slot blocks[p / bs] * bs + p % bs, a
// slot every `stride` elements; bs = 1 << shift).
template <typename T>
struct KVRows {
  const T* base;
  int64_t stride;
  int64_t first = 0;
  const int32_t* blocks = nullptr;
  int shift = 0;
  inline const T* at(int64_t j) const {
    const int64_t p = first + j;
    if (blocks == nullptr) return base + p * stride;
    const int64_t slot = (static_cast<int64_t>(blocks[p >> shift]) << shift) +
                         (p & ((int64_t{1} << shift) - 1));
    return base + slot * stride;
  }
};

#ifdef __AVX512F__
// The AVX-512 path of the scores: 16 keys at a time, each key's dot products with the
// group's queries accumulated over head_dim in vector lanes (no reduction per key), then
// one transposing sum per 16 keys turns 16 vectors into one vector of 16 scores.

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Lane sums of v[0..15], in a fixed lane order that kSumOrder undoes.
__attribute__((always_inline)) inline __m512 transpose_sum_raw(const __m512* v) {
  __m512 t[8], u[4], r[2];
  for (int j = 0; j < 8; ++j)  // 128-bit chunks: v[j] in 0-1, v[j + 8] in 2-3
    t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[j], v[j + 8], 0x44),
                         _mm512_shuffle_f32x4(v[j], v[j + 8], 0xEE));
  for (int j = 0; j < 4; ++j)  // one vector per 128-bit chunk
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t[j], t[j + 4], 0x88),
                         _mm512_shuffle_f32x4(t[j], t[j + 4], 0xDD));
  for (int j = 0; j < 2; ++j)  // two lanes per vector in each chunk
    r[j] = _mm512_add_ps(_mm512_shuffle_ps(u[j], u[j + 2], 0x44),
                         _mm512_shuffle_ps(u[j], u[j + 2], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x88),
                       _mm512_shuffle_ps(r[0], r[1], 0xDD));
}

// kSumOrder[j] = the lane of transpose_sum_raw's result that holds v[j]'s sum, found by
// running it on v[j] = j (so no hand-derived table can be wrong).
const __m512i kSumOrder = [] {
  __m512 v[16];
  for (int j = 0; j < 16; ++j) v[j] = _mm512_set1_ps(static_cast<float>(j) / 16.f);
  float lanes[16];
  _mm512_storeu_ps(lanes, transpose_sum_raw(v));
  int32_t idx[16];
  for (int lane = 0; lane < 16; ++lane) idx[static_cast<int>(lanes[lane] + 0.5f)] = lane;
  return _mm512_loadu_si512(idx);
}();

// attend_one for a fixed group size G and head_dim D (a multiple of 16): queries and
// the output accumulators live in registers, the per-key partial vectors go through a
// small buffer to the transposing sum.
template <typename T, typename KT, int G, int D>
void attend_fixed_head(const T* q, int64_t q_head_stride, const KVRows<KT>& k,
                       const KVRows<KT>& v, int64_t len, float scale, T* out,
                       int64_t out_head_stride, std::vector<float>& scores) {
  constexpr int C = D / 16;
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      qv[g][c] = _mm512_mul_ps(load16(q + g * q_head_stride + c * 16), sc);
  const int64_t stride = (len + 15) / 16 * 16;  // each head's scores, padded to 16
  scores.resize(static_cast<size_t>(G * stride));
  float* s = scores.data();
  alignas(64) __m512 part[G][16];
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int n = static_cast<int>(len - j0 < 16 ? len - j0 : 16);
    for (int jj = 0; jj < 16; ++jj) {
      if (jj >= n) {
        for (int g = 0; g < G; ++g) part[g][jj] = _mm512_setzero_ps();
        continue;
      }
      const KT* kj = k.at(j0 + jj);
      // The keys are read once per step, from memory: fetch ahead of the loads.
      if (j0 + jj + 16 < len)
        for (int b = 0; b < D * static_cast<int>(sizeof(KT)); b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(k.at(j0 + jj + 16)) + b, _MM_HINT_T0);
      __m512 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load16(kj + c * 16);
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
        part[g][jj] = acc;
      }
    }
    for (int g = 0; g < G; ++g)
      _mm512_storeu_ps(s + g * stride + j0,
                       _mm512_permutexvar_ps(kSumOrder, transpose_sum_raw(part[g])));
  }
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = exp_in_place(s + g * stride, len);
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    const KT* vj = v.at(j);
    if (j + 16 < len)
      for (int b = 0; b < D * static_cast<int>(sizeof(KT)); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(v.at(j + 16)) + b, _MM_HINT_T0);
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(vj + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(s[g * stride + j]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
    }
  }
  alignas(64) float o[D];
  for (int g = 0; g < G; ++g) {
    const __m512 iv = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + c * 16, _mm512_mul_ps(acc[g][c], iv));
    for (int i = 0; i < D; ++i) (out + g * out_head_stride)[i] = from_float<T>(o[i]);
  }
}

// nh KV heads of one sequence (nh > 1: paged mode, head h's row at +h * D in each slot),
// one after the other.
template <typename T, typename KT, int G, int D>
void attend_fixed(const T* q, int64_t q_head_stride, const KVRows<KT>& k, const KVRows<KT>& v,
                  int64_t len, float scale, T* out, int64_t out_head_stride,
                  std::vector<float>& scores, int64_t nh) {
  for (int64_t h = 0; h < nh; ++h) {
    KVRows<KT> kh = k, vh = v;
    kh.base += h * D;
    vh.base += h * D;
    attend_fixed_head<T, KT, G, D>(q + h * G * q_head_stride, q_head_stride, kh, vh, len, scale,
                                   out + h * G * out_head_stride, out_head_stride, scores);
  }
}
#elif defined(NVLLM_ATTN_FIXED)
// The AVX2 path: 8 keys at a time, each key's dot products with the group's queries
// accumulated in vector lanes, then one transposing sum per 8 keys; the weighted sum of
// values runs over 32 dimensions at a time so the group's accumulators stay in registers.

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The lane sums of v[0..7], in order.
inline __m256 transpose_sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// nh KV heads of one sequence at once (nh > 1: paged mode, where a slot holds every KV
// head's row side by side, head h at +h * D): each block of 8 keys is read slot by slot
// for all nh heads (measured on a 2-core EPYC, 16 sequences x 3 KV heads at context 192,
// 30 layers: 0.7x the time of one task per (sequence, KV head), whose strided reads of a
// slot's third each the hardware fetches poorly), and the values of the slots ahead are
// fetched into L2 while the scores run. Each head's arithmetic is the same, in the same
// order, as with nh = 1: the same bits.
template <typename T, typename KT, int G, int D>
void attend_fixed(const T* q, int64_t q_head_stride, const KVRows<KT>& k, const KVRows<KT>& v,
                  int64_t len,
                  float scale, T* out, int64_t out_head_stride, std::vector<float>& scores,
                  int64_t nh) {
  constexpr int C = D / 8;
  constexpr int CC = C < 4 ? C : 4;  // value vectors per pass
  const __m256 sc = _mm256_set1_ps(scale);
  const int64_t stride = (len + 7) / 8 * 8;  // each head's scores, padded to 8
  // Each head's scaled queries (G x D floats), then its scores, in one scratch buffer.
  const int64_t qsize = G * D;
  scores.resize(static_cast<size_t>(nh * (G * stride + qsize) + 8));
  float* qf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scores.data()) + 31) &
                                       ~uintptr_t{31});
  float* s = qf + nh * qsize;
  for (int64_t h = 0; h < nh; ++h)
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c)
        _mm256_store_ps(qf + h * qsize + g * D + c * 8,
                        _mm256_mul_ps(load8(q + (h * G + g) * q_head_stride + c * 8), sc));
  const int pf_bytes = static_cast<int>(nh * D * sizeof(KT));
  __m256 part[G][8];
  for (int64_t j0 = 0; j0 < len; j0 += 8) {
    const int n = static_cast<int>(len - j0 < 8 ? len - j0 : 8);
    for (int jj = 0; jj < n; ++jj) {
      if (j0 + jj + 8 < len) {
        const char* pk = reinterpret_cast<const char*>(k.at(j0 + jj + 8));
        for (int b = 0; b < pf_bytes; b += 64) _mm_prefetch(pk + b, _MM_HINT_T0);
        if (nh > 1) {
          const char* pv = reinterpret_cast<const char*>(v.at(j0 + jj + 8));
          for (int b = 0; b < pf_bytes; b += 64) _mm_prefetch(pv + b, _MM_HINT_T1);
        }
      }
    }
    for (int64_t h = 0; h < nh; ++h) {
      const float* qh = qf + h * qsize;
      for (int jj = 0; jj < 8; ++jj) {
        if (jj >= n) {
          for (int g = 0; g < G; ++g) part[g][jj] = _mm256_setzero_ps();
          continue;
        }
        const KT* kj = k.at(j0 + jj) + h * D;
        for (int g = 0; g < G; ++g) {
          __m256 acc = _mm256_mul_ps(_mm256_load_ps(qh + g * D), load8(kj));
          for (int c = 1; c < C; ++c)
            acc = _mm256_fmadd_ps(_mm256_load_ps(qh + g * D + c * 8), load8(kj + c * 8), acc);
          part[g][jj] = acc;
        }
      }
      for (int g = 0; g < G; ++g)
        _mm256_storeu_ps(s + (h * G + g) * stride + j0, transpose_sum8(part[g]));
    }
  }
  for (int64_t h = 0; h < nh; ++h) {
    float* sh = s + h * G * stride;
    float inv[G];
    for (int g = 0; g < G; ++g) inv[g] = exp_in_place(sh + g * stride, len);
    alignas(32) float o[G][D];
    for (int c0 = 0; c0 < C; c0 += CC) {
      __m256 acc[G][CC];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CC; ++c) acc[g][c] = _mm256_setzero_ps();
      for (int64_t j = 0; j < len; ++j) {
        const KT* vj = v.at(j) + h * D + c0 * 8;
        for (int c = 0; c < CC; ++c) {
          const __m256 vv = load8(vj + c * 8);
          for (int g = 0; g < G; ++g)
            acc[g][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(sh + g * stride + j), vv, acc[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CC; ++c)
          _mm256_store_ps(o[g] + (c0 + c) * 8, _mm256_mul_ps(acc[g][c], _mm256_set1_ps(inv[g])));
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < D; ++i) (out + (h * G + g) * out_head_stride)[i] = from_float<T>(o[g][i]);
  }
}
#endif

#ifdef NVLLM_ATTN_FIXED

// The fixed-shape kernel for (group, d), or nullptr (the generic loop then runs).
template <typename T, typename KT>
using AttendFn = void (*)(const T*, int64_t, const KVRows<KT>&, const KVRows<KT>&, int64_t,
                          float, T*, int64_t, std::vector<float>&, int64_t);

template <typename T, typename KT>
AttendFn<T, KT> fixed_kernel(int64_t group, int64_t d) {
#define NVLLM_CASE(G, D) \
  if (group == G && d == D) return &attend_fixed<T, KT, G, D>;
  NVLLM_CASE(1, 64) NVLLM_CASE(2, 64) NVLLM_CASE(3, 64) NVLLM_CASE(4, 64)
  NVLLM_CASE(6, 64) NVLLM_CASE(8, 64)
  NVLLM_CASE(1, 128) NVLLM_CASE(2, 128) NVLLM_CASE(3, 128) NVLLM_CASE(4, 128)
  NVLLM_CASE(6, 128) NVLLM_CASE(8, 128)
#undef NVLLM_CASE
  return nullptr;
}
#endif  // NVLLM_ATTN_FIXED

template <typename T, typename KT>
void attend_one(const T* q, int64_t q_head_stride, const KVRows<KT>& k, const KVRows<KT>& v,
                int64_t len,
                int64_t group, int64_t d, float scale, T* out, int64_t out_head_stride,
                std::vector<float>& scores) {
  float qf[kMaxGroup][kMaxHeadDim];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i) qf[g][i] = to_float((q + g * q_head_stride)[i]) * scale;
  scores.resize(static_cast<size_t>(group * len));
  float* s = scores.data();
  for (int64_t j = 0; j < len; ++j) {
    const KT* kj = k.at(j);
    float kf[kMaxHeadDim];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) kf[i] = to_float(kj[i]);
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; ++i) dot += qf[g][i] * kf[i];
      s[g * len + j] = dot;
    }
  }
  float acc[kMaxGroup][kMaxHeadDim];
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * len;
    const float inv = exp_in_place(sg, len);
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) sg[j] *= inv;
    for (int64_t i = 0; i < d; ++i) acc[g][i] = 0.f;
  }
  for (int64_t j = 0; j < len; ++j) {
    const KT* vj = v.at(j);
    float vf[kMaxHeadDim];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) vf[i] = to_float(vj[i]);
    for (int64_t g = 0; g < group; ++g) {
      const float p = s[g * len + j];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc[g][i] += p * vf[i];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i)
      (out + g * out_head_stride)[i] = from_float<T>(acc[g][i]);
}

}  // namespace nvllm_cpu_attn
