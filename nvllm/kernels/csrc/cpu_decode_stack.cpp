// A Llama-family decoder's layers at decode, all of them in one call (one CPU rank: no
// all-reduce between the halves of a layer).
//
// Why: at one decoding row a layer is ~10 small native calls (norms, four quantized
// linears, the attention with its rotary and KV store, the activation), each a few
// microseconds of Python and dispatcher on top of its arithmetic; over 30 layers that
// glue was about a quarter of SmolLM2-135M's decode step on 2 cores. DecodeStack holds the
// layers' tensors (taken once from the modules, nvllm/worker/models/decode_stack.py) and
// runs the same kernels in the same order with the same arguments as the Python path, so
// its hidden states are bit for bit the Python path's (tests/worker/test_decode_stack.py).
//
// Per layer (h: the hidden rows, r: the residual stream):
//   first layer: r = h, h = rms_norm(h)    later: r += h, h = rms_norm(r)   (in place)
//   qkv = h W_qkv^T; a = attention(rotary(q, k), store k and v); h = a W_o^T
//   r += h, h = rms_norm(r); h = silu(h W_gate^T) * (h W_up^T); h = h W_down^T
// Each linear takes quant_linear_a8 up to its bits' a8 row count, else quant_linear_a16
// up to its a16 row count, else quant_linear_amx from the AMX row count (0: never), else
// quant_linear (the caller passes nvllm/worker/layers/quant.py's act_rows for each op at
// 4 and 8 bits and its amx_min_rows); the caller sends only steps whose rows quant_linear
// serves (native_max_rows).
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace {

struct StackLinear {
  at::Tensor qweight, scales;
  std::optional<at::Tensor> mins;
  int64_t bits = 0;
};

struct StackLayer {
  at::Tensor norm1, norm2;
  StackLinear qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;
  int64_t window = 0;
};

// Rows of x up to which a linear of 4 or 8 bits quantizes x to int8, or to int16; from
// which it takes the AMX op (0: never).
struct ActRows {
  int64_t a8_4, a8_8, a16_4, a16_8, amx;
};

at::Tensor stack_linear(const at::Tensor& x, const StackLinear& w, const ActRows& act) {
  at::Tensor out = at::empty({x.size(0), w.qweight.size(0)}, x.options());
  const int64_t rows = x.size(0);
  if (rows <= (w.bits == 4 ? act.a8_4 : act.a8_8))
    quant_linear_a8(out, x, w.qweight, w.scales, w.mins, w.bits);
  else if (rows <= (w.bits == 4 ? act.a16_4 : act.a16_8))
    quant_linear_a16(out, x, w.qweight, w.scales, w.mins, w.bits);
  else if (act.amx > 0 && rows >= act.amx)
    quant_linear_amx(out, x, w.qweight, w.scales, w.mins, w.bits);
  else
    quant_linear(out, x, w.qweight, w.scales, w.mins, w.bits);
  return out;
}

struct DecodeStack : torch::CustomClassHolder {
  int64_t heads, kv_heads;
  double eps, scale;
  std::vector<StackLayer> layers;

  DecodeStack(int64_t heads_, int64_t kv_heads_, double eps_, double scale_)
      : heads(heads_), kv_heads(kv_heads_), eps(eps_), scale(scale_) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
                "DecodeStack: heads must be a multiple of kv_heads");
  }

  // The next layer's tensors, as the modules hold them (not copied: the stack sees what
  // they see, and keeps them alive while it lives).
  void add_layer(at::Tensor norm1, at::Tensor norm2, at::Tensor qkv_w, at::Tensor qkv_s,
                 std::optional<at::Tensor> qkv_m, int64_t qkv_bits, at::Tensor o_w,
                 at::Tensor o_s, std::optional<at::Tensor> o_m, int64_t o_bits,
                 at::Tensor gu_w, at::Tensor gu_s, std::optional<at::Tensor> gu_m,
                 int64_t gu_bits, at::Tensor down_w, at::Tensor down_s,
                 std::optional<at::Tensor> down_m, int64_t down_bits, at::Tensor k_cache,
                 at::Tensor v_cache, int64_t window) {
    TORCH_CHECK(layers.empty() || k_cache.sizes() == layers[0].k_cache.sizes(),
                "DecodeStack: every layer's KV cache must have one shape");
    layers.push_back(StackLayer{norm1, norm2, {qkv_w, qkv_s, qkv_m, qkv_bits},
                                {o_w, o_s, o_m, o_bits}, {gu_w, gu_s, gu_m, gu_bits},
                                {down_w, down_s, down_m, down_bits}, k_cache, v_cache,
                                window});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // hidden [M, H] (the embeddings; becomes the residual stream, updated in place) through
  // every layer: (the last layer's output, the residual), for the final norm's fused add.
  // The attention arguments are those of paged_decode_attention_qkv (block_tables given:
  // the pages read in place) or of decode_attention_qkv (bases and caps: each sequence's
  // contiguous copy, layer i at index i), for every row of the step.
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor hidden, at::Tensor positions,
                                         at::Tensor cos, at::Tensor sin, at::Tensor slots,
                                         at::Tensor rows, at::Tensor lens,
                                         std::optional<at::Tensor> query_lens,
                                         std::optional<at::Tensor> block_tables,
                                         std::optional<at::Tensor> bases_in,
                                         std::optional<at::Tensor> caps_in, int64_t a8_rows4,
                                         int64_t a8_rows8, int64_t a16_rows4,
                                         int64_t a16_rows8, int64_t amx_rows) {
    const ActRows act{a8_rows4, a8_rows8, a16_rows4, a16_rows8, amx_rows};
    TORCH_CHECK(!layers.empty(), "DecodeStack: no layers");
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be contiguous 2-D");
    const bool paged = block_tables.has_value();
    TORCH_CHECK(paged != (bases_in.has_value() && caps_in.has_value()),
                "DecodeStack.run takes block_tables, or bases and caps");
    // The block tables and lengths are every layer's: checked once.
    at::Tensor caps, bases;
    Paging paging{};
    if (paged)
      paging = check_paging(*block_tables, layers[0].k_cache, lens, slots, caps, bases);
    else
      bases = *bases_in, caps = *caps_in;
    at::Tensor residual = hidden, h;
    for (size_t i = 0; i < layers.size(); ++i) {
      const StackLayer& L = layers[i];
      if (i == 0) {
        h = at::empty_like(residual);
        rms_norm(h, residual, L.norm1, eps, std::nullopt, std::nullopt);
      } else {
        rms_norm(h, h, L.norm1, eps, residual, residual);
      }
      const at::Tensor qkv = stack_linear(h, L.qkv, act);
      const int64_t d = qkv.size(1) / (heads + 2 * kv_heads);
      at::Tensor attn = at::empty({qkv.size(0), heads * d}, qkv.options());
      attention_qkv_impl(attn, qkv, positions, cos, sin, heads, kv_heads, L.k_cache,
                         L.v_cache, slots, rows, bases, caps, lens,
                         paged ? 0 : static_cast<int64_t>(i), scale, L.window, query_lens,
                         paging);
      h = stack_linear(attn, L.o, act);
      rms_norm(h, h, L.norm2, eps, residual, residual);
      const at::Tensor gu = stack_linear(h, L.gate_up, act);
      at::Tensor act_h = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
      silu_and_mul(act_h, gu);
      h = stack_linear(act_h, L.down, act);
    }
    return {h, residual};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(nvllm_cpu, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, double, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("run", &DecodeStack::run);
}
