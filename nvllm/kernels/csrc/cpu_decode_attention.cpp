// Decode attention on CPU for a whole batch in one call per layer.
//
// Each decoding sequence keeps its K/V contiguous (nvllm/kernels/cpu_attention.py): one
// buffer [layers, 2, kv_heads, capacity, head_dim] per sequence, addressed here by its
// base pointer, so one call walks every sequence without a Python-level loop (the
// per-sequence SDPA calls this replaces cost ~25 us each in float32 and ~110 us in
// bfloat16, 2 x 10 layers x batch of them per step).
//
// One task per (sequence, KV head): it first appends this step's key and value to the
// sequence's buffer, then the query heads of that group read each key and value once. Scores and sums are float32 whatever the storage type (float32 or bfloat16);
// softmax is the two-pass max / exp / sum form.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const uint16_t* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store(float* p, int64_t i, float v) { p[i] = v; }

inline void store(uint16_t* p, int64_t i, float v) {
  // Round to nearest even, as torch's float -> bfloat16 conversion does (NaN aside).
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);
  p[i] = static_cast<uint16_t>(bits >> 16);
}

constexpr int64_t kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kMaxHeadDim = 256;

template <typename T>
void attend_one(const T* q, int64_t q_head_stride, const T* k, const T* v, int64_t len,
                int64_t group, int64_t d, float scale, T* out, int64_t out_head_stride,
                std::vector<float>& scores) {
  float qf[kMaxGroup][kMaxHeadDim];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i) qf[g][i] = load(q + g * q_head_stride, i) * scale;
  scores.resize(static_cast<size_t>(group * len));
  float* s = scores.data();
  for (int64_t j = 0; j < len; ++j) {
    const T* kj = k + j * d;
    float kf[kMaxHeadDim];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) kf[i] = load(kj, i);
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
    float mx = sg[0];
    for (int64_t j = 1; j < len; ++j) mx = sg[j] > mx ? sg[j] : mx;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < len; ++j) {
      sg[j] = std::exp(sg[j] - mx);
      sum += sg[j];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) sg[j] *= inv;
    for (int64_t i = 0; i < d; ++i) acc[g][i] = 0.f;
  }
  for (int64_t j = 0; j < len; ++j) {
    const T* vj = v + j * d;
    float vf[kMaxHeadDim];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) vf[i] = load(vj, i);
    for (int64_t g = 0; g < group; ++g) {
      const float p = s[g * len + j];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc[g][i] += p * vf[i];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i) store(out + g * out_head_stride, i, acc[g][i]);
}

template <typename T>
void append(T* dst, const T* src, int64_t d) {
  std::memcpy(dst, src, static_cast<size_t>(d) * sizeof(T));
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
         const at::Tensor& rows, const at::Tensor& bases, const at::Tensor& caps,
         const at::Tensor& lens, int64_t layer, double scale) {
  const int64_t n = rows.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_new.size(1);
  const int64_t group = heads / kv_heads;
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* base = bases.data_ptr<int64_t>();
  const int64_t* cap = caps.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k_new.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v_new.data_ptr());
  const int64_t ks0 = k_new.stride(0), ks1 = k_new.stride(1);
  const int64_t vs0 = v_new.stride(0), vs1 = v_new.stride(1);
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / kv_heads, h = t % kv_heads;
      T* buf = reinterpret_cast<T*>(base[b]);
      T* k = buf + ((layer * 2 + 0) * kv_heads + h) * cap[b] * d;
      T* v = buf + ((layer * 2 + 1) * kv_heads + h) * cap[b] * d;
      append<T>(k + (len[b] - 1) * d, kp + row[b] * ks0 + h * ks1, d);
      append<T>(v + (len[b] - 1) * d, vp + row[b] * vs0 + h * vs1, d);
      attend_one<T>(qp + row[b] * qs0 + h * group * qs1, qs1, k, v, len[b], group, d,
                    static_cast<float>(scale), op + row[b] * os0 + h * group * os1, os1,
                    scores);
    }
  });
}

// For each decoding sequence b: write k_new[rows[b]] and v_new[rows[b]] as its token
// lens[b] - 1 in the buffer at bases[b] ([layers, 2, kv_heads, caps[b], d], q's dtype),
// then out[rows[b]] = attention of q[rows[b]] over its first lens[b] keys and values.
// The caller guarantees the buffers (cpu_attention.CpuKVStore) and lens[b] <= caps[b].
void decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_new,
                      const at::Tensor& v_new, const at::Tensor& rows, const at::Tensor& bases,
                      const at::Tensor& caps, const at::Tensor& lens, int64_t layer,
                      double scale) {
  const int64_t kv_heads = k_new.size(1);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &q, &k_new, &v_new})
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->size(2) == q.size(2) &&
                    t->scalar_type() == q.scalar_type(),
                "out, q, k_new and v_new must be [tokens, heads, d] of one dtype, d contiguous");
  TORCH_CHECK(v_new.size(1) == kv_heads, "k_new and v_new must have the same heads");
  TORCH_CHECK(q.size(1) % kv_heads == 0 && q.size(1) / kv_heads <= kMaxGroup,
              "query heads per KV head must divide evenly and be at most 16");
  TORCH_CHECK(q.size(2) <= kMaxHeadDim, "head_dim must be at most 256");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&rows, &bases, &caps, &lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() &&
                    t->size(0) == rows.size(0),
                "rows, bases, caps and lens must be int64 vectors of one length");
  if (q.scalar_type() == at::kFloat)
    run<float>(out, q, k_new, v_new, rows, bases, caps, lens, layer, scale);
  else if (q.scalar_type() == at::kBFloat16)
    run<uint16_t>(out, q, k_new, v_new, rows, bases, caps, lens, layer, scale);
  else
    TORCH_CHECK(false, "decode_attention runs in float32 or bfloat16");
}

}  // namespace

TORCH_LIBRARY(nvllm_cpu, m) {
  m.def("decode_attention(Tensor(a!) out, Tensor q, Tensor k_new, Tensor v_new, Tensor rows, "
        "Tensor bases, Tensor caps, Tensor lens, int layer, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(nvllm_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
