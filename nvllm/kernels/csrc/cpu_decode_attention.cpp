// Decode attention on CPU for a whole batch in one call per layer.
//
// Each decoding sequence keeps its K/V contiguous (nvllm/kernels/cpu_attention.py): one
// buffer [layers, 2, kv_heads, capacity, head_dim] per sequence, addressed here by its
// base pointer, so one call walks every sequence without a Python-level loop (the
// per-sequence SDPA calls this replaces cost ~25 us each in float32 and ~110 us in
// bfloat16, 2 x 10 layers x batch of them per step).
//
// A sequence may bring a few new tokens rather than one (speculative verify rows: the
// last token and k drafts; short prompt chunks): query j of its run sees the keys up to
// its own position, so the step's decodes and verify rows share the one call.
//
// Paged mode (paged_decode_attention*, no copies: cpu_kv_mirror off) reads each sequence's
// keys and values from the paged cache through its block table instead, with the same
// arithmetic in the same order, so the same bits.
//
// One task per (sequence, KV head), or in paged mode with a few sequences per thread one
// per sequence (all its KV heads: each cache slot holds their rows side by side, read
// whole): a task first appends this step's keys and values, then the query heads of each
// group read each key and value once per query (attend_kernels.h). Scores and sums are
// float32 whatever the storage type (float32 or bfloat16); softmax is the two-pass
// max / exp / sum form.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <type_traits>
#include <vector>

#include "attend_kernels.h"
#include "bf16.h"

namespace {

using nvllm_cpu::from_float;
using nvllm_cpu::round_to;
using nvllm_cpu::to_float;
using nvllm_cpu_attn::attend_one;
using nvllm_cpu_attn::KVRows;
using nvllm_cpu_attn::kMaxGroup;
using nvllm_cpu_attn::kMaxHeadDim;
#ifdef NVLLM_ATTN_FIXED
using nvllm_cpu_attn::AttendFn;
using nvllm_cpu_attn::fixed_kernel;
#endif

// A row into the cache's type KT (float32 into a bfloat16 cache: rounded to nearest even).
template <typename KT, typename T>
void append(KT* dst, const T* src, int64_t d) {
  if constexpr (std::is_same_v<KT, T>) {
    std::memcpy(dst, src, static_cast<size_t>(d) * sizeof(T));
  } else {
    for (int64_t i = 0; i < d; ++i) dst[i] = from_float<KT>(to_float(src[i]));
  }
}

// Neox rotary of one [d] row into o, rounded as csrc/cpu_layer_ops.cpp's rotate does (so
// decode_attention_qkv stores and reads exactly what rotary_embedding would produce).
template <typename T>
inline void rope_row(T* o, const T* x, const float* c, const float* s, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float xi = to_float(x[i]);
    const float rot = i < half ? -to_float(x[i + half]) : to_float(x[i - half]);
    const float a = round_to<T>(xi * round_to<T>(c[i]));
    const float b = round_to<T>(rot * round_to<T>(s[i]));
    o[i] = from_float<T>(a + b);
  }
}

// Below this many multiply-adds (scores and values, all tasks) a call runs on the calling
// thread: waking a second one costs more than it saves, and on a shared core it may wait
// a whole time slice for it (1 sequence at context 128: ~0.15 M).
constexpr int64_t kSerialWork = 1 << 20;

// Sequences per thread from which a paged call runs one task per sequence (every KV head)
// rather than one per (sequence, KV head): fewer tasks than that leave threads idle.
constexpr int64_t kSequenceTasksPerThread = 2;

struct Rope {  // positions of the step's tokens and the [max_pos, d] float32 tables
  const int64_t* pos = nullptr;
  const float* cos = nullptr;
  const float* sin = nullptr;
};

struct Paging {  // paged mode: keys and values read through the block tables, no copies
  const int32_t* tables = nullptr;  // [sequences, stride] (nullptr: the contiguous copies)
  int64_t stride = 0;
  int shift = 0;  // log2(block_size)
};

struct Queries {  // each sequence's new tokens: rows[b] .. rows[b] + qlens[b] - 1
  const int64_t* row = nullptr;
  const int64_t* qlen = nullptr;   // nullptr: one token each
  const int64_t* first = nullptr;  // prefix sums of qlen: sequence b's slots start here
  int64_t len(int64_t b) const { return qlen != nullptr ? qlen[b] : 1; }
  int64_t slot0(int64_t b) const { return first != nullptr ? first[b] : b; }
};

// The first row of KV head h's keys (kv = 0) or values (kv = 1) in sequence b's contiguous
// copy ([layers, 2, kv_heads, cap, d] at base[b]).
template <typename KT>
KT* copy_rows(int64_t b, int64_t h, int kv, int64_t kv_heads, int64_t d, const int64_t* base,
              const int64_t* cap, int64_t layer) {
  return reinterpret_cast<KT*>(base[b]) + ((layer * 2 + kv) * kv_heads + h) * cap[b] * d;
}

// KV head h's keys (kv = 0) or values (kv = 1) of sequence b: its contiguous copy, or the
// paged cache's slots through its block table (the next head's row D elements on).
template <typename KT>
KVRows<KT> head_rows(int64_t b, int64_t h, KT* cache, int64_t kv_heads, int64_t d,
                     const int64_t* base, const int64_t* cap, int64_t layer, int kv,
                     const Paging& paging) {
  if (paging.tables != nullptr)
    return KVRows<KT>{cache + h * d, kv_heads * d, 0, paging.tables + b * paging.stride,
                      paging.shift};
  return KVRows<KT>{copy_rows<KT>(b, h, kv, kv_heads, d, base, cap, layer), d};
}

// Sequence b's new keys and values for KV head h (rotated first when rope.pos is set):
// into its contiguous copy (paged mode: none) and the paged cache.
template <typename T, typename KT>
void store_new(int64_t b, int64_t h, const T* kp, int64_t ks0, int64_t ks1, const T* vp,
               int64_t vs0, int64_t vs1, int64_t kv_heads, int64_t d, KT* kc, KT* vc,
               const int64_t* slot, const Queries& qs, const int64_t* base, const int64_t* cap,
               const int64_t* len, int64_t layer, Rope rope, bool paged) {
  T k_rot[kMaxHeadDim];
  KT* k = paged ? nullptr : copy_rows<KT>(b, h, 0, kv_heads, d, base, cap, layer);
  KT* v = paged ? nullptr : copy_rows<KT>(b, h, 1, kv_heads, d, base, cap, layer);
  const int64_t nq = qs.len(b), past = len[b] - nq;
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t r = qs.row[b] + j, sl = slot[qs.slot0(b) + j];
    const T* kb = kp + r * ks0 + h * ks1;
    const T* vb = vp + r * vs0 + h * vs1;
    if (rope.pos != nullptr) {
      rope_row<T>(k_rot, kb, rope.cos + rope.pos[r] * d, rope.sin + rope.pos[r] * d, d);
      kb = k_rot;
    }
    if (!paged) {
      append(k + (past + j) * d, kb, d);
      append(v + (past + j) * d, vb, d);
    }
    if (sl >= 0) {  // the paged cache too: prefix hits and rebuilt copies read it
      append(kc + (sl * kv_heads + h) * d, kb, d);
      append(vc + (sl * kv_heads + h) * d, vb, d);
    }
  }
}

// Sequence b's work for KV heads h0 .. h0 + nh - 1 (nh > 1 in paged mode only): store
// their new keys and values (store_new), then attend each query over its causal prefix,
// read from the buffer or through the block table. Each query is one call of the
// one-query routine, so query j of a verify run computes exactly what decoding that token
// alone would.
template <typename T, typename KT>
void run_task(int64_t b, int64_t h0, int64_t nh, T* op, int64_t os0, int64_t os1, const T* qp,
              int64_t qs0, int64_t qs1, const T* kp, int64_t ks0, int64_t ks1, const T* vp,
              int64_t vs0, int64_t vs1, int64_t kv_heads, int64_t group, int64_t d, KT* kc,
              KT* vc, const int64_t* slot, const Queries& qs, const int64_t* base,
              const int64_t* cap, const int64_t* len, int64_t layer, float scale,
              int64_t window, Rope rope, const Paging& paging, std::vector<float>& scores,
              std::vector<T>& q_rot) {
  const bool paged = paging.tables != nullptr;
  for (int64_t h = h0; h < h0 + nh; ++h)
    store_new(b, h, kp, ks0, ks1, vp, vs0, vs1, kv_heads, d, kc, vc, slot, qs, base, cap, len,
              layer, rope, paged);
#ifdef NVLLM_ATTN_FIXED
  const AttendFn<T, KT> fixed = fixed_kernel<T, KT>(group, d);
#endif
  const int64_t nq = qs.len(b);
  q_rot.resize(static_cast<size_t>(nh * group * d));
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t r = qs.row[b] + j;
    const T* qh = qp + r * qs0 + h0 * group * qs1;
    int64_t q_stride = qs1;
    if (rope.pos != nullptr) {
      const float* c = rope.cos + rope.pos[r] * d;
      const float* s = rope.sin + rope.pos[r] * d;
      for (int64_t g = 0; g < nh * group; ++g)
        rope_row<T>(q_rot.data() + g * d, qh + g * qs1, c, s, d);
      qh = q_rot.data();
      q_stride = d;
    }
    T* oh = op + r * os0 + h0 * group * os1;
    // Query j sees keys 0 .. past + j; a sliding window only moves the first of them.
    const int64_t seen = len[b] - nq + j + 1;
    const int64_t first = window > 0 && seen > window ? seen - window : 0;
    for (int64_t i = 0; i < nh; ++i) {
      KVRows<KT> kr = head_rows(b, h0 + i, kc, kv_heads, d, base, cap, layer, 0, paging);
      KVRows<KT> vr = head_rows(b, h0 + i, vc, kv_heads, d, base, cap, layer, 1, paging);
      kr.first = vr.first = first;
#ifdef NVLLM_ATTN_FIXED
      if (fixed != nullptr) {  // every head of the task in one call (their slots read whole)
        fixed(qh, q_stride, kr, vr, seen - first, scale, oh, os1, scores, nh);
        break;
      }
#endif
      attend_one<T, KT>(qh + i * group * q_stride, q_stride, kr, vr, seen - first, group, d,
                        scale, oh + i * group * os1, os1, scores);
    }
  }
}

template <typename T, typename KT>
void run(T* op, int64_t os0, int64_t os1, const T* qp, int64_t qs0, int64_t qs1, const T* kp,
         int64_t ks0, int64_t ks1, const T* vp, int64_t vs0, int64_t vs1, int64_t heads,
         int64_t kv_heads, int64_t d, at::Tensor& k_cache, at::Tensor& v_cache,
         const at::Tensor& slots, const at::Tensor& rows, const at::Tensor& bases,
         const at::Tensor& caps, const at::Tensor& lens, const Queries& qs, int64_t layer,
         double scale, int64_t window, Rope rope, const Paging& paging) {
  const int64_t n = rows.size(0);
  const int64_t group = heads / kv_heads;
  const int64_t* len = lens.data_ptr<int64_t>();
  int64_t keys = 0;  // keys read, over every query
  for (int64_t b = 0; b < n; ++b) keys += qs.len(b) * len[b];
  // Paged, with enough sequences to share among the threads: one task per sequence, all
  // its KV heads (the fixed kernels read each slot whole); else one per (sequence, KV head).
  const int64_t nh =
      paging.tables != nullptr && n >= kSequenceTasksPerThread * at::get_num_threads()
          ? kv_heads
          : 1;
  const int64_t per_seq = kv_heads / nh, tasks = n * per_seq;
  auto task = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<T> q_rot;
    for (int64_t t = begin; t < end; ++t)
      run_task<T, KT>(t / per_seq, t % per_seq * nh, nh, op, os0, os1, qp, qs0, qs1, kp, ks0,
                      ks1, vp, vs0, vs1, kv_heads, group, d,
                      reinterpret_cast<KT*>(k_cache.data_ptr()),
                      reinterpret_cast<KT*>(v_cache.data_ptr()), slots.data_ptr<int64_t>(), qs,
                      bases.data_ptr<int64_t>(), caps.data_ptr<int64_t>(), len, layer,
                      static_cast<float>(scale), window, rope, paging, scores, q_rot);
  };
  if (2 * keys * heads * d < kSerialWork)
    task(0, tasks);
  else
    at::parallel_for(0, tasks, 1, task);
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// f(T{}, KT{}) for q's dtype T and the cache's KT (the pairs check_cache admits).
template <typename F>
void with_types(at::ScalarType q, at::ScalarType cache, const F& f) {
  if (q == at::kBFloat16)
    f(uint16_t{}, uint16_t{});
  else if (cache == at::kBFloat16)
    f(float{}, uint16_t{});
  else
    f(float{}, float{});
}

// The cache holds q's dtype, or bfloat16 under float32 queries (--kv-cache-dtype: half the
// bytes; keys and values rounded once, when stored, and read back exactly).
void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t kv_heads,
                 int64_t d, at::ScalarType dtype, const at::Tensor& rows,
                 std::initializer_list<const at::Tensor*> vectors) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k_cache, &v_cache})
    TORCH_CHECK(t->is_contiguous() && t->dim() == 4 && t->size(2) == kv_heads &&
                    t->size(3) == d,
                "k_cache and v_cache must be contiguous [blocks, block_size, kv_heads, d]");
  const at::ScalarType kt = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kt &&
                  (kt == dtype || (dtype == at::kFloat && kt == at::kBFloat16)),
              "k_cache and v_cache must hold q's dtype, or bfloat16 under float32 q; got ",
              kt, " and ", v_cache.scalar_type(), " under ", dtype);
  for (const at::Tensor* t : vectors)
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1 &&
                    t->size(0) == rows.size(0),
                "rows, bases, caps, lens and query_lens must be int64 vectors of one length");
}

// Up to this many new tokens per sequence: a verify row at the largest k the config
// allows (1 + MAX_SPECULATIVE_TOKENS, nvllm/common/speculative.py), so every one fits.
// The kernel reads a run's keys once per query where SDPA's matmul reads them once for
// all, so its lead narrows as runs grow (scripts/bench_cpu_verify.py, 16 sequences at
// context 256: 5.5x the per-sequence SDPA calls' speed at 1 query, 3.9x at 5, 1.8x at
// 17); longer prompt runs go to SDPA.
constexpr int64_t kMaxQueries = 17;

// The per-sequence indices, checked before any write: a query run past the tokens, a
// query count outside 1..kMaxQueries, a length shorter than the run (the new tokens are
// always keys) or past its buffer's capacity, or a slot past the paged cache would write
// out of bounds, so each is an error, not undefined behaviour. Returns the runs, their
// slot offsets in `first` (filled here when query_lens is given).
Queries check_rows(const at::Tensor& rows, const std::optional<at::Tensor>& query_lens,
                   const at::Tensor& caps, const at::Tensor& lens, const at::Tensor& slots,
                   int64_t num_tokens, const at::Tensor& k_cache, std::vector<int64_t>& first) {
  const int64_t n = rows.size(0);
  Queries qs{rows.data_ptr<int64_t>()};
  if (query_lens.has_value()) {
    const at::Tensor& ql = *query_lens;
    TORCH_CHECK(ql.scalar_type() == at::kLong && ql.is_contiguous() && ql.dim() == 1 &&
                    ql.size(0) == n,
                "query_lens must be an int64 vector, one per sequence (as rows)");
    qs.qlen = ql.data_ptr<int64_t>();
    first.resize(static_cast<size_t>(n));
    int64_t total = 0;
    for (int64_t b = 0; b < n; ++b) {
      TORCH_CHECK(qs.qlen[b] >= 1 && qs.qlen[b] <= kMaxQueries, "query_lens[", b, "] = ",
                  qs.qlen[b], " must be in 1..", kMaxQueries);
      first[b] = total;
      total += qs.qlen[b];
    }
    qs.first = first.data();
    TORCH_CHECK(slots.dim() == 1 && slots.size(0) == total, "slots must have one entry per "
                "new token (sum(query_lens) = ", total, "), not ", slots.numel());
  } else {
    TORCH_CHECK(slots.dim() == 1 && slots.size(0) == n,
                "slots must have one entry per sequence (as rows) without query_lens");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots must be a contiguous int64 vector");
  const int64_t* cap = caps.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t b = 0; b < n; ++b) {
    const int64_t nq = qs.len(b), row = qs.row[b];
    TORCH_CHECK(row >= 0 && row < num_tokens, "rows[", b, "] = ", row,
                " is not a token row (", num_tokens, " tokens)");
    TORCH_CHECK(row + nq <= num_tokens, "rows[", b, "] = ", row, " + query_lens[", b,
                "] = ", nq, " runs past the tokens (", num_tokens, " tokens)");
    TORCH_CHECK(len[b] >= nq && len[b] <= cap[b], "lens[", b, "] = ", len[b], " must be in ",
                nq, "..caps[", b, "] = ", cap[b]);
  }
  for (int64_t i = 0; i < slots.size(0); ++i)
    TORCH_CHECK(slot[i] >= -1 && slot[i] < num_slots, "slots[", i, "] = ", slot[i],
                " is outside the paged cache (", num_slots, " slots)");
  return qs;
}

// For each sequence b with m = query_lens[b] new tokens (1 when query_lens is None), at
// rows[b] .. rows[b] + m - 1: write their k_new and v_new rows as its tokens lens[b] - m
// .. lens[b] - 1 in the buffer at bases[b] ([layers, 2, kv_heads, caps[b], d], the cache's dtype)
// and at their slots (one per new token, in sequence order; -1: not stored) of the paged
// cache, then out[row] = attention of q[row] over the keys and values up to its own
// (causal: query j sees lens[b] - m + j + 1 of them; the last `window` of those when
// window > 0: sliding-window attention; 0: all). The caller guarantees the buffers
// (cpu_attention.CpuKVStore); rows, query_lens, lens and slots are checked (check_rows).
void attention_impl(at::Tensor out, const at::Tensor& q, const at::Tensor& k_new,
                    const at::Tensor& v_new, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slots, const at::Tensor& rows, const at::Tensor& bases,
                    const at::Tensor& caps, const at::Tensor& lens, int64_t layer,
                    double scale, int64_t window, const std::optional<at::Tensor>& query_lens,
                    const Paging& paging) {
  const int64_t kv_heads = k_new.size(1), heads = q.size(1), d = q.size(2);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &q, &k_new, &v_new})
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->size(2) == q.size(2) &&
                    t->scalar_type() == q.scalar_type(),
                "out, q, k_new and v_new must be [tokens, heads, d] of one dtype, d contiguous");
  TORCH_CHECK(v_new.size(1) == kv_heads, "k_new and v_new must have the same heads");
  check_cache(k_cache, v_cache, kv_heads, d, q.scalar_type(), rows,
              {&rows, &bases, &caps, &lens});
  TORCH_CHECK(k_new.size(0) == q.size(0) && v_new.size(0) == q.size(0) &&
                  out.size(0) == q.size(0), "out, q, k_new and v_new must have one row count");
  std::vector<int64_t> first;
  const Queries qs = check_rows(rows, query_lens, caps, lens, slots, q.size(0), k_cache, first);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup,
              "query heads per KV head must divide evenly and be at most 16");
  TORCH_CHECK(d <= kMaxHeadDim, "head_dim must be at most 256");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "decode_attention runs in float32 or bfloat16");
  with_types(q.scalar_type(), k_cache.scalar_type(), [&](auto t, auto kt) {
    using T = decltype(t);
    using KT = decltype(kt);
    run<T, KT>(ptr<T>(out), out.stride(0), out.stride(1), ptr<T>(q), q.stride(0), q.stride(1),
               ptr<T>(k_new), k_new.stride(0), k_new.stride(1), ptr<T>(v_new),
               v_new.stride(0), v_new.stride(1), heads, kv_heads, d, k_cache, v_cache, slots,
               rows, bases, caps, lens, qs, layer, scale, window, Rope{}, paging);
  });
}

// decode_attention of the fused projection's output qkv = [tokens, (heads + 2 kv_heads) d]
// (rows d-contiguous): q and k rotated first (neox, by positions and the float32
// [max_pos, d] cos and sin tables), as rotary_embedding would rotate them; out:
// [tokens, heads * d] contiguous. One call does what the split, the rotary op and
// decode_attention did.
void attention_qkv_impl(at::Tensor out, const at::Tensor& qkv, const at::Tensor& positions,
                        const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                        int64_t kv_heads, at::Tensor k_cache, at::Tensor v_cache,
                        const at::Tensor& slots, const at::Tensor& rows,
                        const at::Tensor& bases, const at::Tensor& caps,
                        const at::Tensor& lens, int64_t layer, double scale, int64_t window,
                        const std::optional<at::Tensor>& query_lens, const Paging& paging) {
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 &&
                  heads / kv_heads <= kMaxGroup,
              "query heads per KV head must divide evenly and be at most 16");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) % (heads + 2 * kv_heads) == 0,
              "qkv must be [tokens, (heads + 2 kv_heads) d] with rows contiguous");
  const int64_t d = qkv.size(1) / (heads + 2 * kv_heads);
  TORCH_CHECK(d <= kMaxHeadDim && d % 2 == 0, "head_dim must be even and at most 256");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == qkv.size(0) &&
                  out.size(1) == heads * d && out.scalar_type() == qkv.scalar_type(),
              "out must be contiguous [tokens, heads * d] of qkv's dtype");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16,
              "decode_attention_qkv runs in float32 or bfloat16");
  check_cache(k_cache, v_cache, kv_heads, d, qkv.scalar_type(), rows,
              {&rows, &bases, &caps, &lens});
  std::vector<int64_t> first;
  const Queries qs =
      check_rows(rows, query_lens, caps, lens, slots, qkv.size(0), k_cache, first);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == qkv.size(0),
              "positions must be int64, one per token");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.size(1) == d && sin.sizes() == cos.sizes(),
              "cos and sin must be contiguous float32 [max_pos, d]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows.size(0); ++b)
    for (int64_t j = 0; j < qs.len(b); ++j) {
      const int64_t p = pos[qs.row[b] + j];
      TORCH_CHECK(p >= 0 && p < cos.size(0), "position out of the rotary tables' range");
    }
  const Rope rope{pos, cos.data_ptr<float>(), sin.data_ptr<float>()};
  const int64_t s0 = qkv.stride(0);
  with_types(qkv.scalar_type(), k_cache.scalar_type(), [&](auto t, auto kt) {
    using T = decltype(t);
    using KT = decltype(kt);
    const T* x = ptr<T>(qkv);
    run<T, KT>(ptr<T>(out), out.stride(0), d, x, s0, d, x + heads * d, s0, d,
               x + (heads + kv_heads) * d, s0, d, heads, kv_heads, d, k_cache, v_cache, slots,
               rows, bases, caps, lens, qs, layer, scale, window, rope, paging);
  });
}

void decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_new,
                      const at::Tensor& v_new, at::Tensor k_cache, at::Tensor v_cache,
                      const at::Tensor& slots, const at::Tensor& rows, const at::Tensor& bases,
                      const at::Tensor& caps, const at::Tensor& lens, int64_t layer,
                      double scale, int64_t window,
                      const std::optional<at::Tensor>& query_lens) {
  attention_impl(out, q, k_new, v_new, k_cache, v_cache, slots, rows, bases, caps, lens, layer,
                 scale, window, query_lens, Paging{});
}

void decode_attention_qkv(at::Tensor out, const at::Tensor& qkv, const at::Tensor& positions,
                          const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                          int64_t kv_heads, at::Tensor k_cache, at::Tensor v_cache,
                          const at::Tensor& slots, const at::Tensor& rows,
                          const at::Tensor& bases, const at::Tensor& caps,
                          const at::Tensor& lens, int64_t layer, double scale, int64_t window,
                          const std::optional<at::Tensor>& query_lens) {
  attention_qkv_impl(out, qkv, positions, cos, sin, heads, kv_heads, k_cache, v_cache, slots,
                     rows, bases, caps, lens, layer, scale, window, query_lens, Paging{});
}

// Paged mode: each sequence's keys and values are read from the paged cache through its
// row of block_tables (int32 [sequences, max_blocks], as the step's metadata holds them;
// block_size a power of two), so no contiguous copy exists. Checked here: every block a
// sequence's length reaches is inside the table and the cache, and every new token has a
// slot (the kernel reads it back from the cache). Returns the paging, and fills caps (the
// table's reach, for check_rows) and bases (unused).
Paging check_paging(const at::Tensor& block_tables, const at::Tensor& k_cache,
                    const at::Tensor& lens, const at::Tensor& slots, at::Tensor& caps,
                    at::Tensor& bases) {
  TORCH_CHECK(k_cache.dim() == 4, "k_cache must be [blocks, block_size, kv_heads, d]");
  const int64_t n = lens.size(0), bs = k_cache.size(1), num_blocks = k_cache.size(0);
  TORCH_CHECK(bs > 0 && (bs & (bs - 1)) == 0, "paged decode attention needs a power-of-two "
              "block_size, not ", bs);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.is_contiguous() && block_tables.size(0) == n,
              "block_tables must be contiguous int32 [sequences, max_blocks]");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.is_contiguous() && lens.dim() == 1,
              "lens must be an int64 vector");
  const int64_t stride = block_tables.size(1);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < n; ++b) {
    const int64_t used = (len[b] + bs - 1) / bs;
    TORCH_CHECK(used <= stride, "lens[", b, "] = ", len[b], " needs ", used,
                " blocks; block_tables has ", stride);
    for (int64_t i = 0; i < used; ++i)
      TORCH_CHECK(bt[b * stride + i] >= 0 && bt[b * stride + i] < num_blocks,
                  "block_tables[", b, ", ", i, "] = ", bt[b * stride + i],
                  " is outside the paged cache (", num_blocks, " blocks)");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots must be a contiguous int64 vector");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i)
    TORCH_CHECK(slot[i] >= 0, "slots[", i, "] = ", slot[i], ": paged decode attention "
                "reads every new token back from the cache, so each needs a slot");
  caps = at::full({n}, stride * bs, at::kLong);
  bases = at::zeros({n}, at::kLong);
  int shift = 0;
  while ((int64_t{1} << shift) < bs) ++shift;
  return Paging{bt, stride, shift};
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_new,
                            const at::Tensor& v_new, at::Tensor k_cache, at::Tensor v_cache,
                            const at::Tensor& slots, const at::Tensor& rows,
                            const at::Tensor& block_tables, const at::Tensor& lens,
                            double scale, int64_t window,
                            const std::optional<at::Tensor>& query_lens) {
  at::Tensor caps, bases;
  const Paging paging = check_paging(block_tables, k_cache, lens, slots, caps, bases);
  attention_impl(out, q, k_new, v_new, k_cache, v_cache, slots, rows, bases, caps, lens, 0,
                 scale, window, query_lens, paging);
}

void paged_decode_attention_qkv(at::Tensor out, const at::Tensor& qkv,
                                const at::Tensor& positions, const at::Tensor& cos,
                                const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                                at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                                const at::Tensor& rows, const at::Tensor& block_tables,
                                const at::Tensor& lens, double scale, int64_t window,
                                const std::optional<at::Tensor>& query_lens) {
  at::Tensor caps, bases;
  const Paging paging = check_paging(block_tables, k_cache, lens, slots, caps, bases);
  attention_qkv_impl(out, qkv, positions, cos, sin, heads, kv_heads, k_cache, v_cache, slots,
                     rows, bases, caps, lens, 0, scale, window, query_lens, paging);
}

}  // namespace

TORCH_LIBRARY(nvllm_cpu, m) {
  m.def("decode_attention(Tensor(a!) out, Tensor q, Tensor k_new, Tensor v_new, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, Tensor rows, Tensor bases, "
        "Tensor caps, Tensor lens, int layer, float scale, int window=0, "
        "Tensor? query_lens=None) -> ()");
  m.def("decode_attention_qkv(Tensor(a!) out, Tensor qkv, Tensor positions, Tensor cos, "
        "Tensor sin, int heads, int kv_heads, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slots, Tensor rows, Tensor bases, Tensor caps, Tensor lens, int layer, "
        "float scale, int window=0, Tensor? query_lens=None) -> ()");
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_new, Tensor v_new, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, Tensor rows, "
        "Tensor block_tables, Tensor lens, float scale, int window=0, "
        "Tensor? query_lens=None) -> ()");
  m.def("paged_decode_attention_qkv(Tensor(a!) out, Tensor qkv, Tensor positions, "
        "Tensor cos, Tensor sin, int heads, int kv_heads, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slots, Tensor rows, Tensor block_tables, Tensor lens, "
        "float scale, int window=0, Tensor? query_lens=None) -> ()");
}

TORCH_LIBRARY_IMPL(nvllm_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_qkv", &decode_attention_qkv);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_attention_qkv", &paged_decode_attention_qkv);
}
