// x W^T on Intel AMX (Sapphire Rapids and later) for the grouped weights of
// nvllm/worker/layers/quant.py: int8, or int4 in GGUF's nibble order, an fp16 scale per
// group of 32 and optionally a min (fp16, or float32 for AWQ / GPTQ zero points).
//
// Why: one AMX tdpbf16ps multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one (8,192
// multiply-adds) in about 16 cycles, some 16x what AVX-512's two FMA ports do in float32;
// torch's bfloat16 GEMM runs 3-6x its float32 one on such a CPU. A group of 32 is exactly
// one tile step along K, so the per-group scale can be applied when a tile is read out.
//
// The arithmetic, per 16 output columns n, 16 rows of x (m) and group g:
//   C[n][m] = sum_k q[n][k] * (xh[m][k] + xl[m][k])     (two tdpbf16ps, float32 sums)
//   y[m][n] += s[n][g] * C[n][m] + mn[n][g] * sum_k x[m][k]
// q is the stored integer (int4: the nibble, minus 8 without a min; int8 as stored), exact
// in bfloat16 (8 significant bits). x's float32 value is split into xh = bf16(x) and
// xl = bf16(x - xh): xh + xl holds 16 of x's 24 significant bits, an error of at most
// 2^-17 of |x| per value (finer than the int16 rounding the AVX2 op applies, 2^-16 of the
// group's largest). bfloat16 x needs no xl: then the result is exact up to the order of
// float32 sums. So against dequantize-then-matmul only x's rounding and the sums' order
// differ; the contract tests bound it.
//
// Layout: the weights are tile A (16 rows = 16 output columns, each its group's 32 values
// as 16 bfloat16 pairs), x is tile B (row i = the pair index, each of 16 rows of x as a
// pair), so a weight group unpacks from its 16 (int4) or 32 (int8) contiguous bytes with no
// transpose. A pair holds values i and i + 16 of a group: an int4 byte's two nibbles
// (GGUF's order). int4 unpacks through a 16-entry bfloat16 table (vpermw).
//
// Built where the compiler targets AMX-TILE, AMX-BF16 and AVX512-BF16 on Linux
// (-march=native on such a CPU); quant_amx_usable() also asks the kernel for permission to
// use the tile registers (arch_prctl), once per process.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__linux__)
#define NVLLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "bf16.h"
#include "quant_args.h"

namespace {

#if defined(NVLLM_AMX)
using nvllm_cpu::kQuantGroup;

constexpr int kTile = 16;                // rows of a tile, output columns / rows of x per block
constexpr int kTileElems = kTile * 32;   // bfloat16 values in a 16 x 64-byte tile
// Rows of x per pass over W: 8 blocks of 16, whose packed hi and lo tiles (16 KiB a group)
// stay in L2 (2,048 rows at once: 4.6 MB for K = 576, and 0.6x the speed).
constexpr int64_t kChunkRows = 128;

// palette 1, all eight tiles 16 rows of 64 bytes. A constant in memory: GCC does not see
// that ldtilecfg reads its operand and drops the stores that would fill one on the stack.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
constexpr TileConfig kTileConfig = {
    1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

inline void configure_tiles() { _tile_loadconfig(&kTileConfig); }

// x split into tile B's layout per block of 16 rows and group: hi and lo [blocks][G][512]
// bfloat16 bits, row i of a tile = 16 rows of x as pairs (value i, value i + 16); and per
// (block, group) the 16 rows' sums of x (for the mins).
struct PackedX {
  int64_t blocks = 0, G = 0;
  bool has_lo = false;
  std::vector<uint16_t> hi, lo;
  std::vector<float> sums;
};

// bfloat16 (as the top half of a float32's bits) nearest to each lane's float.
inline __m512i round_bf16(__m512i bits) {
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

// Two float32 vectors (values 0-15 and 16-31 of a group) as 16 bfloat16 pairs: lane i =
// (bf16 of a[i]) | (bf16 of b[i]) << 16, from bits already rounded (low halves zero).
inline __m512i pair_bf16(__m512i a, __m512i b) {
  return _mm512_or_si512(_mm512_srli_epi32(a, 16), b);
}

template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<uint16_t>(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

template <typename T>
PackedX pack_x(const T* x, int64_t M, int64_t K) {
  PackedX px;
  px.blocks = (M + kTile - 1) / kTile;
  px.G = K / kQuantGroup;
  px.has_lo = std::is_same_v<T, float>;
  const int64_t tiles = px.blocks * px.G;
  px.hi.assign(tiles * kTileElems, 0);
  if (px.has_lo) px.lo.assign(tiles * kTileElems, 0);
  px.sums.assign(tiles * kTile, 0.f);
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t th[kTile][kTile], tl[kTile][kTile];  // [row of x][pair]
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / px.G, g = t % px.G;
      const int64_t rows = std::min<int64_t>(kTile, M - b * kTile);
      std::memset(th, 0, sizeof th);
      std::memset(tl, 0, sizeof tl);
      for (int64_t m = 0; m < rows; ++m) {
        const T* xr = x + (b * kTile + m) * K + g * kQuantGroup;
        const __m512 f0 = load16(xr), f1 = load16(xr + 16);
        px.sums[t * kTile + m] = _mm512_reduce_add_ps(_mm512_add_ps(f0, f1));
        const __m512i h0 = round_bf16(_mm512_castps_si512(f0));
        const __m512i h1 = round_bf16(_mm512_castps_si512(f1));
        _mm512_store_si512(th[m], pair_bf16(h0, h1));
        if (px.has_lo) {
          const __m512 r0 = _mm512_sub_ps(f0, _mm512_castsi512_ps(h0));
          const __m512 r1 = _mm512_sub_ps(f1, _mm512_castsi512_ps(h1));
          _mm512_store_si512(tl[m], pair_bf16(round_bf16(_mm512_castps_si512(r0)),
                                              round_bf16(_mm512_castps_si512(r1))));
        }
      }
      // tile row i, dword m = pair i of x's row m
      uint32_t* dh = reinterpret_cast<uint32_t*>(px.hi.data() + t * kTileElems);
      for (int i = 0; i < kTile; ++i)
        for (int m = 0; m < kTile; ++m) dh[i * kTile + m] = th[m][i];
      if (px.has_lo) {
        uint32_t* dl = reinterpret_cast<uint32_t*>(px.lo.data() + t * kTileElems);
        for (int i = 0; i < kTile; ++i)
          for (int m = 0; m < kTile; ++m) dl[i * kTile + m] = tl[m][i];
      }
    }
  });
  return px;
}

// vpermw tables (32 entries, indexed by 5 bits): a nibble's value, and its value - 8, in
// bfloat16 (small integers: exact).
struct alignas(64) NibbleTable {
  uint16_t v[32];
};
NibbleTable nibble_table(int offset) {
  NibbleTable t{};
  for (int i = 0; i < 32; ++i)
    t.v[i] = nvllm_cpu::from_float<uint16_t>(static_cast<float>((i & 15) - offset));
  return t;
}
const NibbleTable kNibbleTable = nibble_table(0);
const NibbleTable kNibbleTableCentered = nibble_table(8);

// One weight group of up to 16 output columns into tile A's layout (row = column, lane i =
// the pair (value i, value i + 16)); rows past `cols` stay as they were (zero).
template <int BITS, bool MIN>
inline void unpack_group(const uint8_t* q, int64_t qrow, int cols, uint16_t* a) {
  if constexpr (BITS == 4) {
    const __m512i tab = _mm512_load_si512((MIN ? kNibbleTable : kNibbleTableCentered).v);
    const __m512i lowmask = _mm512_set1_epi32(0x000F000F);
    for (int n = 0; n < cols; ++n) {
      const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * qrow)));
      // 16-bit lanes: 2i = low nibble of byte i, 2i + 1 = its high nibble
      const __m512i idx = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), lowmask, 0xA8);
      _mm512_storeu_si512(a + n * 32, _mm512_permutexvar_epi16(idx, tab));
    }
  } else {
    for (int n = 0; n < cols; ++n) {
      const int8_t* w = reinterpret_cast<const int8_t*>(q + n * qrow);
      const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
      const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
      // |q| <= 128: exact in bfloat16, the float's low 16 bits are zero
      _mm512_storeu_si512(a + n * 32, pair_bf16(_mm512_castps_si512(f0), _mm512_castps_si512(f1)));
    }
  }
}

// Groups whose products run before their read-out (column_block). Chunks of 2 to 64
// groups measured alike (3072 x 576 at 16 and 128 rows, one thread).
constexpr int64_t kChunkGroups = 4;

// A column block's scales (and mins) as float32 [g][16 columns], gathered from W's
// [N, G] rows (16-bit values read as the low halves of 32-bit gathers).
template <typename MT>
void block_scales(const MT* src, int64_t n0, int cols, int64_t G, float* dst) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(G)));
  const __mmask16 live = static_cast<__mmask16>((1u << cols) - 1);
  const MT* base = src + n0 * G;
  for (int64_t g = 0; g < G; ++g) {
    __m512 v;
    if constexpr (std::is_same_v<MT, float>) {
      v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, rows, base + g, 4);
    } else {
      const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, base + g, 2);
      v = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w));
    }
    _mm512_store_ps(dst + g * kTile, v);
  }
}

// Per thread: a column block's unpacked groups, its scales and mins, and a chunk's
// products as read from the C tiles.
struct Scratch {
  std::vector<uint16_t> a;
  std::vector<float> s, m, c;
  explicit Scratch(int64_t G)
      : a(G * kTileElems + 32), s(G * kTile + 16), m(G * kTile + 16),
        c(kChunkGroups * kTile * kTile + 16) {}
  // 64-byte aligned views
  uint16_t* a_at(int64_t i) { return aligned(a.data()) + i * kTileElems; }
  float* s_at() { return aligned(s.data()); }
  float* m_at() { return aligned(m.data()); }
  float* c_at() { return aligned(c.data()); }
  template <typename P>
  static P* aligned(P* p) {
    return reinterpret_cast<P*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
  }
};

// Group G_ of one block of x's rows into C tile CT with A tile AT and x's tiles HT / LT,
// stored to CBUF. Consecutive groups use disjoint tiles and buffers, so neither waits
// for the other's loads and products.
#define NVLLM_AMX_START(G_, CT, AT, HT, LT, CBUF)                                            \
  {                                                                                         \
    const int64_t t = b * G + (G_);                                                         \
    _tile_zero(CT);                                                                         \
    _tile_loadd(AT, sp.a_at(G_), 64);                                                       \
    _tile_loadd(HT, px.hi.data() + t * kTileElems, 64);                                     \
    _tile_dpbf16ps(CT, AT, HT);                                                             \
    if (px.has_lo) {                                                                        \
      _tile_loadd(LT, px.lo.data() + t * kTileElems, 64);                                   \
      _tile_dpbf16ps(CT, AT, LT);                                                           \
    }                                                                                       \
    _tile_stored(CT, CBUF, 64);                                                             \
  }
// acc[n] += s[g][n] * C[n] (+ mins[g][n] * the 16 rows' sums of x), C from CBUF.
#define NVLLM_AMX_READ(G_, CBUF)                                                            \
  {                                                                                         \
    const float* sc = sg + (G_) * kTile;                                                    \
    for (int n = 0; n < kTile; ++n)                                                         \
      acc[n] = _mm512_fmadd_ps(_mm512_load_ps(CBUF + n * kTile), _mm512_set1_ps(sc[n]), acc[n]); \
    if constexpr (MIN) {                                                                    \
      const __m512 xs = _mm512_loadu_ps(px.sums.data() + (b * G + (G_)) * kTile);           \
      const float* mc = mg + (G_) * kTile;                                                  \
      for (int n = 0; n < kTile; ++n) acc[n] = _mm512_fmadd_ps(xs, _mm512_set1_ps(mc[n]), acc[n]); \
    }                                                                                       \
  }

// y for output columns n0 .. n0 + cols - 1 (cols <= 16), every block of x's rows.
template <int BITS, bool MIN, typename T, typename MT>
void column_block(T* out, const PackedX& px, int64_t M, int64_t N, int64_t n0, int cols,
                  const uint8_t* qw, const c10::Half* s, const MT* mn, Scratch& sp) {
  const int64_t G = px.G;
  const int64_t qrow = BITS == 8 ? G * kQuantGroup : G * kQuantGroup / 2;
  const int64_t gbytes = BITS == 8 ? kQuantGroup : kQuantGroup / 2;
  const uint8_t* q0 = qw + n0 * qrow;
  float* sg = sp.s_at();
  float* mg = sp.m_at();
  block_scales(s, n0, cols, G, sg);
  if constexpr (MIN) block_scales(mn, n0, cols, G, mg);
  // every group unpacked once, used by every block of x's rows
  if (cols < kTile) std::fill(sp.a.begin(), sp.a.end(), 0);
  for (int64_t g = 0; g < G; ++g)
    unpack_group<BITS, MIN>(q0 + g * gbytes, qrow, cols, sp.a_at(g));
  float* cb = sp.c_at();
  alignas(64) float c[kTile * kTile];
  for (int64_t b = 0; b < px.blocks; ++b) {
    __m512 acc[kTile];
    for (int n = 0; n < kTile; ++n) acc[n] = _mm512_setzero_ps();
    // kChunkGroups groups' products (the tile unit) into cb, then their read-out (the
    // vector units): each half runs a chunk's worth without waiting on the other
    for (int64_t g0 = 0; g0 < G; g0 += kChunkGroups) {
      const int64_t gn = std::min<int64_t>(kChunkGroups, G - g0);
      for (int64_t j = 0; j < gn; j += 2) {
        NVLLM_AMX_START(g0 + j, 0, 2, 4, 5, cb + j * kTile * kTile)
        if (j + 1 < gn) NVLLM_AMX_START(g0 + j + 1, 1, 3, 6, 7, cb + (j + 1) * kTile * kTile)
      }
      for (int64_t j = 0; j < gn; ++j) NVLLM_AMX_READ(g0 + j, (cb + j * kTile * kTile))
    }
    for (int n = 0; n < kTile; ++n) _mm512_store_ps(c + n * kTile, acc[n]);
    const int64_t rows = std::min<int64_t>(kTile, M - b * kTile);
    for (int64_t m = 0; m < rows; ++m) {
      T* o = out + (b * kTile + m) * N + n0;
      for (int n = 0; n < cols; ++n) o[n] = nvllm_cpu::from_float<T>(c[n * kTile + m]);
    }
  }
}

template <int BITS, bool MIN, typename T, typename MT>
void run_format(T* out, const PackedX& px, int64_t M, int64_t N, const uint8_t* qw,
                const c10::Half* s, const MT* mn) {
  const int64_t nblocks = (N + kTile - 1) / kTile;
  at::parallel_for(0, nblocks, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    Scratch sp(px.G);
    const int64_t qrow = BITS == 8 ? px.G * kQuantGroup : px.G * kQuantGroup / 2;
    for (int64_t nb = begin; nb < end; ++nb) {
      const int cols = static_cast<int>(std::min<int64_t>(kTile, N - nb * kTile));
      // the next block's weight rows, scales and mins come from memory (at decode every
      // weight does, once per step) while this one computes (a decode step's linears
      // at 16 rows: 16.1 -> 15.5 ms, its LM head 4.0 -> 2.7)
      if (nb + 1 < end)
        nvllm_cpu::prefetch_columns<BITS, MIN, MT>((nb + 1) * kTile,
                                                   std::min<int64_t>(kTile, N - (nb + 1) * kTile),
                                                   qw, qrow, s, mn, px.G);
      column_block<BITS, MIN, T, MT>(out, px, M, N, nb * kTile, cols, qw, s, mn, sp);
    }
    _tile_release();
  });
}

bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}
#endif  // NVLLM_AMX

// Whether this build has the AMX loop and the kernel lets this process use it.
bool quant_amx_usable() {
#if defined(NVLLM_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

// out [M, N] and x [M, K] (contiguous, float32 or bfloat16, one dtype); qweight int8
// [N, K] (bits 8) or uint8 [N, K / 2] (bits 4); scales fp16 [N, K / 32]; mins fp16 or
// float32 [N, K / 32]. Only where quant_amx_usable().
void quant_linear_amx(at::Tensor out, const at::Tensor& x, const at::Tensor& qweight,
                      const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                      int64_t bits) {
  TORCH_CHECK(quant_amx_usable(), "quant_linear_amx: this build or CPU has no AMX");
#if defined(NVLLM_AMX)
  const nvllm_cpu::LinearDims d = nvllm_cpu::check_quant_linear(out, x, qweight, scales, mins, bits);
  const bool f32 = x.scalar_type() == at::kFloat;
  const auto* qw = static_cast<const uint8_t*>(qweight.data_ptr());
  const auto* s = scales.data_ptr<c10::Half>();
  // kChunkRows rows of x at a time: their packed tiles stay in L2 while every column
  // block of W reads them.
  for (int64_t r0 = 0; r0 < d.M; r0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, d.M - r0);
    const PackedX px =
        f32 ? pack_x(x.data_ptr<float>() + r0 * d.K, rows, d.K)
            : pack_x(reinterpret_cast<const uint16_t*>(x.data_ptr()) + r0 * d.K, rows, d.K);
    auto go = [&](auto* m) {
      using MT = std::remove_const_t<std::remove_pointer_t<decltype(m)>>;
      auto per_dtype = [&](auto* o) {
        using T = std::remove_pointer_t<decltype(o)>;
        o += r0 * d.N;
        if (bits == 8) {
          if (m) run_format<8, true, T, MT>(o, px, rows, d.N, qw, s, m);
          else run_format<8, false, T, MT>(o, px, rows, d.N, qw, s, m);
        } else {
          if (m) run_format<4, true, T, MT>(o, px, rows, d.N, qw, s, m);
          else run_format<4, false, T, MT>(o, px, rows, d.N, qw, s, m);
        }
      };
      if (f32) per_dtype(out.data_ptr<float>());
      else per_dtype(reinterpret_cast<uint16_t*>(out.data_ptr()));
    };
    nvllm_cpu::with_mins(mins, go);
  }
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nvllm_cpu, m) {
  m.def("quant_linear_amx(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, "
        "Tensor? mins, int bits) -> ()");
  m.def("quant_amx_usable() -> bool", &quant_amx_usable);
}

TORCH_LIBRARY_IMPL(nvllm_cpu, CPU, m) {
  m.impl("quant_linear_amx", &quant_linear_amx);
}
