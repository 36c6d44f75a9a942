// Ragged paged attention for XLA:CPU, as an XLA FFI custom call (pallas_kernels/cpu_paged_attention.py).
//
// The contract is pallas_kernels/reference.py's, read for one layer of the block-first cache:
//   q               [T, Hq, D]                f32 or bf16 (the output has q's dtype)
//   kv_cache        [NB, L, 2, BS, Hkv, D]    f32 or bf16 (independently of q); this step's K/V written
//   layer           [] int32                  the layer to read
//   block_tables    [S, MB] int32             block ids per sequence, in token order
//   context_lens    [S] int32                 tokens of each sequence after this step's writes
//   query_start_loc [S+1] int32               sequence s's queries are q[qsl[s]:qsl[s+1]]
//   window          [] int32                  W > 0: a query at position p sees keys p-W < k <= p; else all
//   attribute scale f32
// Query j of sequence s sits at position context_lens[s] - q_len + j and attends causally to the cached
// keys 0..position (clipped to the table's MB * BS keys, as the reference's mask is). Tokens outside every
// sequence's range give 0. Arithmetic in float32: scores, a max-subtracted soft-max, then the weighted sum
// of V, divided by the soft-max's denominator.
//
// Per (token, kv head) the kernel streams the sequence's keys once and scores every query head of the
// group against each (GQA: group = Hq / Hkv heads share a K/V row), so K and V are each read once per
// token and kv head. Scratch (the query, scores and accumulators of one token) is kept per thread and reused.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as XLA's convert does; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

struct F32 {
  using T = float;
  static inline void load(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
  static inline void store(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
};

struct BF16 {
  using T = uint16_t;
  static inline void load(const uint16_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
  }
  static inline void store(const float* src, uint16_t* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
  }
};

// sum_d a[d] * b[d]: 16 interleaved partial sums (lane i sums d = i mod 16) in one SIMD register (GCC/Clang
// vector extensions: a zmm with AVX-512, two ymm with AVX2), folded pairwise (8 + 8, 4 + 4, 2 + 2, 1 + 1), then
// the scalar tail. A fixed order, vectorised without -ffast-math; a sequential 16-lane sum per dot product
// cost more than the products themselves at head_dim 64.
typedef float V16 __attribute__((vector_size(64), aligned(4)));
typedef float V8 __attribute__((vector_size(32), aligned(4)));

// Unaligned loads of 16 floats through a may_alias type: one vector load each. (std::memcpy into a V16 compiled
// to two 32-byte stores and a 64-byte reload per operand, a store-forwarding stall that cost ~6x the dot.)
typedef float V16u __attribute__((vector_size(64), aligned(4), may_alias));

inline float Dot(const float* a, const float* b, int64_t n) {
  V16 acc = {};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    acc += *reinterpret_cast<const V16u*>(a + d) * *reinterpret_cast<const V16u*>(b + d);
  }
  V8 lo8, hi8;
  std::memcpy(&lo8, &acc, sizeof lo8);
  std::memcpy(&hi8, reinterpret_cast<const char*>(&acc) + sizeof lo8, sizeof hi8);
  V8 s8 = lo8 + hi8;
  float s4[4] = {s8[0] + s8[4], s8[1] + s8[5], s8[2] + s8[6], s8[3] + s8[7]};
  float sum = (s4[0] + s4[2]) + (s4[1] + s4[3]);
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

#define SHUF __builtin_shufflevector
// Dot(q, key j) for 16 keys j = 0..15 (key j at k + j * stride), returned as one vector in key order: each with
// Dot's own additions in Dot's order (per key, 16 partial sums over d; then lanes 8 + 8, 4 + 4, (0 + 2) + (1 + 3)),
// so bit-identical to 16 calls of Dot, but folded for 16 keys at once by shuffles (a 16-lane horizontal sum per
// score cost more than its products at head_dim 64). D must be a multiple of 16.
inline V16 Dot16(const float* q, const float* k, int64_t stride, int64_t D) {
  V16 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = V16{};
  for (int64_t d = 0; d < D; d += 16) {
    const V16 qd = *reinterpret_cast<const V16u*>(q + d);
    for (int j = 0; j < 16; ++j) acc[j] += qd * *reinterpret_cast<const V16u*>(k + j * stride + d);
  }
  // Keys (2i, 2i+1): lanes 0-7 key 2i's s8 = lo8 + hi8, lanes 8-15 key 2i+1's.
  V16 x[8];
  for (int i = 0; i < 8; ++i) {
    x[i] = SHUF(acc[2 * i], acc[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUF(acc[2 * i], acc[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  // Keys 4m..4m+3: 4 lanes each, s4[j] = s8[j] + s8[j + 4].
  V16 y[4];
  for (int m = 0; m < 4; ++m) {
    y[m] = SHUF(x[2 * m], x[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUF(x[2 * m], x[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  // Keys 8n..8n+7: 2 lanes each, (s4[0] + s4[2]) and (s4[1] + s4[3]).
  V16 z[2];
  for (int n = 0; n < 2; ++n) {
    z[n] = SHUF(y[2 * n], y[2 * n + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SHUF(y[2 * n], y[2 * n + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  // Keys 0..15: their two halves summed.
  return SHUF(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUF(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#undef SHUF

// One query token: every query head against keys lo..hi of its sequence, in key order. Each key's K row
// (all kv heads, contiguous in the cache) is read once and scored against all Hq heads; then the same for V.
template <typename EQ, typename E>
void Attend(const typename EQ::T* q, const typename E::T* cache, int64_t L, int64_t BS, int64_t Hkv, int64_t D,
            int64_t layer, const int32_t* table, int64_t MB, int64_t num_blocks, int64_t pos, int32_t window,
            int64_t group, float scale, typename EQ::T* out) {
  using T = typename E::T;
  const int64_t hq = Hkv * group;
  // Keys lo..hi (inclusive) of this query, clipped to the table (the reference masks keys past MB * BS).
  const int64_t hi = std::min<int64_t>(pos, MB * BS - 1);
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  const int64_t n = hi - lo + 1;
  thread_local std::vector<float> qf, scores, acc, row, den;
  qf.resize(hq * D);
  acc.assign(hq * D, 0.0f);
  if (n <= 0) {  // no key in range: the reference's all-masked row gives 0
    EQ::store(acc.data(), out, hq * D);
    return;
  }
  scores.resize(hq * n);
  row.resize(Hkv * D);
  den.resize(hq);
  EQ::load(q, qf.data(), hq * D);
  const int64_t row_len = Hkv * D;  // one token's K (or V) row within a (block, layer, k|v) slab
  const int64_t slab = BS * row_len;
  // Prefetch every K and V row this token reads before using any: the rows sit in a few 2 x BS-row slabs
  // scattered over a large cache (cold after the step's weights streamed through), and asked for one at a
  // time they arrived at ~7 GB/s (a decode step at batch 16: 166 us a layer; WORKSPACE_NOTES 2026-12-04).
  // Block b of the table (clipped into the cache: in range by contract, never read outside): its (block, layer,
  // k|v) slab and the keys k0..k1 of lo..hi inside it.
  auto slab_of = [&](int64_t b, int kv) {
    int64_t blk = table[b];
    blk = blk < 0 ? 0 : (blk >= num_blocks ? num_blocks - 1 : blk);
    return cache + ((blk * L + layer) * 2 + kv) * slab;
  };
  auto keys_of = [&](int64_t b) {
    return std::make_pair(std::max<int64_t>(lo, b * BS), std::min<int64_t>(hi, b * BS + BS - 1));
  };
  for (int64_t b = lo / BS; b <= hi / BS; ++b) {
    const auto [k0, k1] = keys_of(b);
    for (int kv = 0; kv < 2; ++kv) {
      const char* first = reinterpret_cast<const char*>(slab_of(b, kv) + (k0 - b * BS) * row_len);
      const int64_t bytes = (k1 - k0 + 1) * row_len * static_cast<int64_t>(sizeof(T));
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(first + off);
    }
  }
  for (int kv = 0; kv < 2; ++kv) {
    for (int64_t b = lo / BS; b <= hi / BS; ++b) {
      const T* base = slab_of(b, kv);
      const auto [k0, k1] = keys_of(b);
      int64_t k = k0;
      if constexpr (sizeof(T) == sizeof(float)) {  // scores of 16 keys at a time (float32 cache, D % 16 == 0)
        if (kv == 0 && D % 16 == 0) {
          for (; k + 16 <= k1 + 1; k += 16) {
            const float* src = reinterpret_cast<const float*>(base + (k - b * BS) * row_len);
            for (int64_t h = 0; h < Hkv; ++h) {
              for (int64_t g = 0; g < group; ++g) {
                const int64_t qh = h * group + g;
                const V16 sc = Dot16(qf.data() + qh * D, src + h * D, row_len, D) * scale;
                *reinterpret_cast<V16u*>(scores.data() + qh * n + (k - lo)) = sc;
              }
            }
          }
        }
      }
      for (; k <= k1; ++k) {
        const T* src = base + (k - b * BS) * row_len;
        const float* r;
        if constexpr (sizeof(T) == sizeof(float)) {
          r = reinterpret_cast<const float*>(src);
        } else {
          E::load(src, row.data(), row_len);
          r = row.data();
        }
        if (kv == 0) {
          for (int64_t h = 0; h < Hkv; ++h) {
            for (int64_t g = 0; g < group; ++g) {
              const int64_t qh = h * group + g;
              scores[qh * n + (k - lo)] = Dot(qf.data() + qh * D, r + h * D, D) * scale;
            }
          }
        } else {
          for (int64_t h = 0; h < Hkv; ++h) {
            const float* vh = r + h * D;
            for (int64_t g = 0; g < group; ++g) {
              const int64_t qh = h * group + g;
              const float p = scores[qh * n + (k - lo)];
              float* a = acc.data() + qh * D;
              for (int64_t d = 0; d < D; ++d) a[d] += p * vh[d];
            }
          }
        }
      }
    }
    if (kv == 0) {  // soft-max numerators per query head (float32, max-subtracted) and their sums
      for (int64_t qh = 0; qh < hq; ++qh) {
        float* sg = scores.data() + qh * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
        if (!std::isfinite(m)) m = 0.0f;  // as the reference: a row of -inf scores gives 0, not NaN
        float sum = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
          sg[i] = std::exp(sg[i] - m);
          sum += sg[i];
        }
        den[qh] = sum;
      }
    }
  }
  for (int64_t qh = 0; qh < hq; ++qh) {
    const float inv = den[qh] == 0.0f ? 1.0f : 1.0f / den[qh];
    float* a = acc.data() + qh * D;
    for (int64_t d = 0; d < D; ++d) a[d] *= inv;
  }
  EQ::store(acc.data(), out, hq * D);
}

template <typename EQ, typename E>
ffi::Error Run(ffi::ThreadPool& pool, ffi::AnyBuffer q, ffi::AnyBuffer cache, int64_t layer,
               const int32_t* tables, int64_t S, int64_t MB, const int32_t* ctx, const int32_t* qsl,
               int32_t window, float scale, ffi::Result<ffi::AnyBuffer> out) {
  using T = typename E::T;
  using TQ = typename EQ::T;
  auto qd = q.dimensions();
  auto cd = cache.dimensions();
  const int64_t T_ = qd[0], Hq = qd[1], D = qd[2];
  const int64_t NB = cd[0], L = cd[1], BS = cd[3], Hkv = cd[4];
  const TQ* qp = reinterpret_cast<const TQ*>(q.untyped_data());
  const T* cp = reinterpret_cast<const T*>(cache.untyped_data());
  TQ* op = reinterpret_cast<TQ*>(out->untyped_data());
  const int64_t group = Hq / Hkv;
  std::vector<std::pair<int32_t, int32_t>> tokens;  // (token, its sequence) for every query token in a range
  std::vector<bool> done(T_, false);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t t = std::max<int64_t>(0, qsl[s]); t < std::min<int64_t>(T_, qsl[s + 1]); ++t) {
      if (!done[t]) tokens.emplace_back(static_cast<int32_t>(t), static_cast<int32_t>(s));
      done[t] = true;  // query_start_loc is non-decreasing, so ranges do not overlap
    }
  }
  for (int64_t t = 0; t < T_; ++t) {  // padding tokens: 0 (all-zero bits in f32 and bf16)
    if (!done[t]) std::memset(op + t * Hq * D, 0, Hq * D * sizeof(TQ));
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  // Each thread takes the next token until none is left (work stealing over tokens).
  std::atomic<int64_t> next{0};
  const std::function<void()> drain = [&] {
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      const int64_t t = tokens[i].first, s = tokens[i].second;
      const int64_t pos = static_cast<int64_t>(ctx[s]) - (qsl[s + 1] - qsl[s]) + (t - qsl[s]);
      Attend<EQ, E>(qp + t * Hq * D, cp, L, BS, Hkv, D, layer, tables + s * MB, MB, NB, pos, window, group,
                    scale, op + t * Hq * D);
    }
  };
  // The calling thread and the library's workers (cpu_workers.h: XLA's pool threads park and wake late); one
  // token is too little to share.
  superinfer::Workers::Get(pool.num_threads()).Run(drain, n - 1);
  return ffi::Error::Success();
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> context_lens,
                          ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> window, float scale,
                          ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions();
  auto cd = cache.dimensions();
  auto td = block_tables.dimensions();
  if (qd.size() != 3 || cd.size() != 6 || td.size() != 2) {
    return ffi::Error::InvalidArgument("cpu_paged_attention: expected q [T,Hq,D], cache [NB,L,2,BS,Hkv,D], "
                                       "block_tables [S,MB]");
  }
  if (out->element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("cpu_paged_attention: the output must have q's dtype");
  }
  if (cd[2] != 2 || cd[5] != qd[2] || cd[4] <= 0 || qd[1] % cd[4] != 0) {
    return ffi::Error::InvalidArgument("cpu_paged_attention: cache/q head shapes disagree");
  }
  const int64_t S = td[0];
  if (context_lens.element_count() != static_cast<size_t>(S) ||
      query_start_loc.element_count() != static_cast<size_t>(S + 1)) {
    return ffi::Error::InvalidArgument("cpu_paged_attention: context_lens [S] and query_start_loc [S+1] expected");
  }
  if (cd[0] <= 0) {
    return ffi::Error::InvalidArgument("cpu_paged_attention: the cache has no blocks");
  }
  int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= cd[1]) {
    return ffi::Error::InvalidArgument("cpu_paged_attention: layer out of range");
  }
  const int32_t* tables = block_tables.typed_data();
  const int32_t* ctx = context_lens.typed_data();
  const int32_t* qsl = query_start_loc.typed_data();
  int32_t w = window.typed_data()[0];
  const auto qt = q.element_type(), ct = cache.element_type();
  const int64_t MB = td[1];
  if (qt == ffi::F32 && ct == ffi::F32) return Run<F32, F32>(pool, q, cache, l, tables, S, MB, ctx, qsl, w, scale, out);
  if (qt == ffi::F32 && ct == ffi::BF16) return Run<F32, BF16>(pool, q, cache, l, tables, S, MB, ctx, qsl, w, scale, out);
  if (qt == ffi::BF16 && ct == ffi::F32) return Run<BF16, F32>(pool, q, cache, l, tables, S, MB, ctx, qsl, w, scale, out);
  if (qt == ffi::BF16 && ct == ffi::BF16) return Run<BF16, BF16>(pool, q, cache, l, tables, S, MB, ctx, qsl, w, scale, out);
  return ffi::Error::InvalidArgument("cpu_paged_attention: q and cache must be float32 or bfloat16");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SuperinferCpuPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()       // XLA:CPU's intra-op pool
                                  .Arg<ffi::AnyBuffer>()        // q
                                  .Arg<ffi::AnyBuffer>()        // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>() // layer
                                  .Arg<ffi::Buffer<ffi::S32>>() // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>() // context_lens
                                  .Arg<ffi::Buffer<ffi::S32>>() // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>() // window
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>());
