// The elementwise layer ops on CPU, each one pass over its rows instead of the several
// torch ops (and temporaries) of its reference twin in nvllm/kernels/reference.py. They
// round where the reference rounds (bfloat16 after each op that produces bfloat16), so a
// bfloat16 model gets the reference's values up to float32 summation order; float32
// differs from it only in the last bits of the RMS.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "bf16.h"

namespace {

using nvllm_cpu::from_float;
using nvllm_cpu::round_to;
using nvllm_cpu::to_float;

constexpr int64_t kMaxDim = 16384;

// out = weight * (x * rsqrt(mean(x^2) + eps)).to(T) per row of D; with residual:
// s = (x + residual).to(T) is normalised instead and written to res_out.
template <typename T>
void rms_rows(T* out, int64_t out_s0, int64_t out_s1, T* res_out, const T* x, int64_t x_s0,
              int64_t x_s1, const T* res, int64_t r_s0, int64_t r_s1, const T* w,
              int64_t A, int64_t B, int64_t D, float eps) {
  at::parallel_for(0, A * B, 16, [&](int64_t begin, int64_t end) {
    float buf[kMaxDim];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t a = r / B, b = r % B;
      const T* xr = x + a * x_s0 + b * x_s1;
      if (res != nullptr) {
        const T* rr = res + a * r_s0 + b * r_s1;
        T* ro = res_out + r * D;
        for (int64_t i = 0; i < D; ++i) {
          const T s = from_float<T>(to_float(xr[i]) + to_float(rr[i]));
          ro[i] = s;
          buf[i] = to_float(s);
        }
      } else {
        for (int64_t i = 0; i < D; ++i) buf[i] = to_float(xr[i]);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < D; ++i) ss += buf[i] * buf[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
      T* o = out + a * out_s0 + b * out_s1;
      for (int64_t i = 0; i < D; ++i)
        o[i] = from_float<T>(to_float(w[i]) * round_to<T>(buf[i] * inv));
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, name, " must be [A, B, D] with D contiguous");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

// A 2-D [A, D] or 3-D [A, B, D] tensor's rows as [A, B, D] sizes and strides (2-D: B = 1),
// so callers need not make a 3-D view first.
struct Rows {
  int64_t A, B, D, s0, s1;
};

Rows rows_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK((t.dim() == 2 || t.dim() == 3) && t.stride(-1) == 1, name,
              " must be [A, D] or [A, B, D] with D contiguous");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
  if (t.dim() == 2) return {t.size(0), 1, t.size(1), t.stride(0), 0};
  return {t.size(0), t.size(1), t.size(2), t.stride(0), t.stride(1)};
}

// x, out (and residual, res_out): [A, B, D] or [A, D], one shape; res_out contiguous (it
// may be residual itself, and out may be x: each row is read before it is written).
// weight: [D].
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps,
              const c10::optional<at::Tensor>& residual, c10::optional<at::Tensor> res_out) {
  const Rows xr = rows_of(x, "x"), orr = rows_of(out, "out");
  const int64_t A = xr.A, B = xr.B, D = xr.D;
  TORCH_CHECK(orr.A == A && orr.B == B && orr.D == D, "out must be shaped like x");
  TORCH_CHECK(D <= kMaxDim && weight.is_contiguous() && weight.numel() == D &&
                  weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "weight must be [D] of x's dtype, D <= 16384");
  const bool add = residual.has_value();
  Rows rr{0, 0, 0, 0, 0};
  if (add) {
    rr = rows_of(*residual, "residual");
    TORCH_CHECK(rr.A == A && rr.B == B && rr.D == D && residual->scalar_type() == x.scalar_type(),
                "residual must be shaped and typed like x");
    TORCH_CHECK(res_out.has_value() && res_out->is_contiguous() &&
                    res_out->numel() == x.numel() && res_out->scalar_type() == x.scalar_type(),
                "res_out must be contiguous like x");
  }
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    rms_rows<float>(out.data_ptr<float>(), orr.s0, orr.s1,
                    add ? res_out->data_ptr<float>() : nullptr, x.data_ptr<float>(),
                    xr.s0, xr.s1, add ? residual->data_ptr<float>() : nullptr,
                    rr.s0, rr.s1, weight.data_ptr<float>(), A, B, D, e);
  } else {
    auto p = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    rms_rows<uint16_t>(p(out), orr.s0, orr.s1, add ? p(*res_out) : nullptr, p(x), xr.s0,
                       xr.s1, add ? p(*residual) : nullptr, rr.s0, rr.s1, p(weight), A, B, D,
                       e);
  }
}

// out[N, D] = (silu(gate).to(T) * up).to(T) for x = [gate | up], [N, 2D] (rows contiguous).
template <typename T>
void silu_rows(T* out, const T* x, int64_t x_s0, int64_t N, int64_t D) {
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * x_s0;
      const T* u = g + D;
      T* o = out + r * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) {
        const float gf = to_float(g[i]);
        const float s = round_to<T>(gf / (1.f + std::exp(-gf)));
        o[i] = from_float<T>(s * to_float(u[i]));
      }
    }
  });
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.is_contiguous() &&
                  out.size(0) == x.size(0) && 2 * out.size(1) == x.size(1) &&
                  out.scalar_type() == x.scalar_type(),
              "x must be [N, 2D] with rows contiguous, out [N, D]");
  if (x.scalar_type() == at::kFloat)
    silu_rows<float>(out.data_ptr<float>(), x.data_ptr<float>(), x.stride(0), x.size(0),
                     out.size(1));
  else if (x.scalar_type() == at::kBFloat16)
    silu_rows<uint16_t>(reinterpret_cast<uint16_t*>(out.data_ptr()),
                        reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                        x.size(0), out.size(1));
  else
    TORCH_CHECK(false, "silu_and_mul runs in float32 or bfloat16");
}

// Neox rotary of one [heads, d] row set: o = (x * c).to(T) + (rotate_half(x) * s).to(T).
template <typename T>
void rotate(T* o, const T* x, int64_t s0, int64_t s1, int64_t T_, int64_t H, int64_t d,
            const int64_t* pos, const float* cos, const float* sin, int64_t cs0) {
  const int64_t half = d / 2;
  at::parallel_for(0, T_ * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / H, h = r % H;
      const T* xr = x + t * s0 + h * s1;
      const float* c = cos + pos[t] * cs0;
      const float* s = sin + pos[t] * cs0;
      T* orow = o + r * d;
      for (int64_t i = 0; i < d; ++i) {
        const float xi = to_float(xr[i]);
        const float rot = i < half ? -to_float(xr[i + half]) : to_float(xr[i - half]);
        const float a = round_to<T>(xi * round_to<T>(c[i]));
        const float b = round_to<T>(rot * round_to<T>(s[i]));
        orow[i] = from_float<T>(a + b);
      }
    }
  });
}

// q_out, k_out: contiguous [T, H, d] / [T, KH, d]; q, k: [T, *, d] with d contiguous.
void rotary_embedding(at::Tensor q_out, at::Tensor k_out, const at::Tensor& positions,
                      const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                      const at::Tensor& sin) {
  for (const at::Tensor* t : {&q, &k}) check_rows(*t, "q and k");
  TORCH_CHECK(q_out.is_contiguous() && k_out.is_contiguous() && q_out.sizes() == q.sizes() &&
                  k_out.sizes() == k.sizes() && q_out.scalar_type() == q.scalar_type() &&
                  k.scalar_type() == q.scalar_type() && k_out.scalar_type() == q.scalar_type(),
              "q_out and k_out must be contiguous, shaped and typed like q and k");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == q.size(0),
              "positions must be int64, one per token");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == q.size(2) &&
                  q.size(2) % 2 == 0,
              "cos and sin must be contiguous float32 [max_pos, d], d even");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t Tn = q.size(0), d = q.size(2);
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  if (q.scalar_type() == at::kFloat) {
    rotate<float>(q_out.data_ptr<float>(), q.data_ptr<float>(), q.stride(0), q.stride(1), Tn,
                  q.size(1), d, pos, c, s, d);
    rotate<float>(k_out.data_ptr<float>(), k.data_ptr<float>(), k.stride(0), k.stride(1), Tn,
                  k.size(1), d, pos, c, s, d);
  } else {
    auto p = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    rotate<uint16_t>(p(q_out), p(q), q.stride(0), q.stride(1), Tn, q.size(1), d, pos, c, s, d);
    rotate<uint16_t>(p(k_out), p(k), k.stride(0), k.stride(1), Tn, k.size(1), d, pos, c, s, d);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nvllm_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps, Tensor? residual, "
        "Tensor(b!)? res_out) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_embedding(Tensor(a!) q_out, Tensor(b!) k_out, Tensor positions, Tensor q, "
        "Tensor k, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(nvllm_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}
