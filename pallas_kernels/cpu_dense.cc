// Dense projection y = x . W for XLA:CPU, as an XLA FFI custom call (pallas_kernels/cpu_dense.py).
//
//   x      [M, K]          f32
//   w      [...]           f32, any shape: read as a flat buffer; elements offset .. offset + 16 P K - 1 hold
//                          W [K, N = 16 P] packed in panels of 16 output columns: w[offset + (p K + k) 16 + j] = W[k, 16 p + j]
//   attributes offset, panels (= P) int64
//   out    [M, N]          f32
// (One buffer may hold every packed weight of a model, each call reading its own range: one jit argument.)
// y[m, n] = sum over k = 0..K-1, in order, of x[m, k] * W[k, n] (fused multiply-adds, one accumulator per output).
//
// Why: at decode (a few rows) a step's dense layers are bound by streaming the weights from memory. XLA's dots,
// like torch's, ran at ~12 GB/s at 16 rows, against the ~28 GB/s a 1-row pass reaches (WORKSPACE_NOTES,
// 2026-12-04). Here each thread streams its panels once, contiguously, two or three adjacent panels at a time: per
// k, one 64-byte row of each, used by up to 8 or 14 rows of x (24 or 28 accumulator registers, each row's x[m, k]
// broadcast), so the weights are read from memory once per call whatever M is (further rows re-read the panels
// from L1/L2).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "cpu_workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// 16 floats, loaded and stored through a may_alias, 4-byte-aligned type: one vector access each (a memcpy into a
// local vector compiles to narrower stores and a wide reload: a store-forwarding stall).
typedef float V16 __attribute__((vector_size(64), aligned(4), may_alias));

constexpr int64_t kLanes = 16;
// Software prefetch distances, in 64-byte rows (k) of a panel: into L1 a little ahead, into L2 further ahead. With
// the 30 SmolLM2 layers' weights streamed from memory at 16 rows, (8, none) ran at 19 GB/s, (32, 256) at 20-22; at
// one row 22 against 28-30 GB/s (WORKSPACE_NOTES 2026-12-04, /tmp harness).
constexpr int64_t kPrefetchL1 = 32;
constexpr int64_t kPrefetchL2 = 256;
// A tile is up to MR rows of x against NP adjacent panels: MR x NP accumulator registers, each k loading NP
// weight vectors and MR broadcasts of x for MR x NP fused multiply-adds. Two shapes, by the call's rows (C++
// harness, the 30 SmolLM2 layers streamed from memory on 2 cores): 8 x 3 for up to 24 rows (16 rows: 19.0-19.2 ms
// against 20.5 for 14 x 2; 1 row 13.1 against 13.7), 14 x 2 above (64 rows: 45.3 against 48.1).
constexpr int64_t kFewRows = 24;

// Rows m0..m0+MR-1 of x (transposed: xt[k * M + m]) against panels p..p+NP-1 (`panel` points at panel p; panel
// p + j starts K * 16 floats later): MR x 16 NP outputs, written to out[m, n0 ..].
template <int MR, int NP>
void Tile(const float* xt, int64_t M, int64_t m0, const float* panel, int64_t K, float* out, int64_t N, int64_t n0) {
  V16 acc[MR][NP];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NP; ++j) acc[i][j] = V16{};
  }
  const int64_t stride = K * kLanes;
  const float* xk = xt + m0;
  for (int64_t k = 0; k < K; ++k, xk += M) {
    V16 w[NP];
    for (int j = 0; j < NP; ++j) {
      const float* row = panel + j * stride + k * kLanes;
      w[j] = *reinterpret_cast<const V16*>(row);
      __builtin_prefetch(row + kPrefetchL1 * kLanes);
      __builtin_prefetch(row + kPrefetchL2 * kLanes, 0, 1);
    }
    for (int i = 0; i < MR; ++i) {
      const float xv = xk[i];
      for (int j = 0; j < NP; ++j) acc[i][j] += xv * w[j];
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NP; ++j) *reinterpret_cast<V16*>(out + (m0 + i) * N + n0 + j * kLanes) = acc[i][j];
  }
}

// The last `rows` (< MR) rows: a tile of exactly that many rows.
template <int MR, int NP>
void TailTile(const float* xt, int64_t M, int64_t m0, const float* panel, int64_t K, float* out, int64_t N,
              int64_t n0, int64_t rows) {
  if constexpr (MR > 0) {
    if (rows == MR) return Tile<MR, NP>(xt, M, m0, panel, K, out, N, n0);
    return TailTile<MR - 1, NP>(xt, M, m0, panel, K, out, N, n0, rows);
  }
}

// Every row of x against panels p..p+NP-1, in tiles of MR rows.
template <int NP, int MR>
void Panels(const float* xt, int64_t M, const float* w, int64_t K, float* out, int64_t N, int64_t p) {
  const float* panel = w + p * K * kLanes;
  int64_t m0 = 0;
  for (; m0 + MR <= M; m0 += MR) Tile<MR, NP>(xt, M, m0, panel, K, out, N, p * kLanes);
  if (m0 < M) TailTile<MR - 1, NP>(xt, M, m0, panel, K, out, N, p * kLanes, M - m0);
}

// Panels p0..p1-1: three (up to kFewRows rows) or two at a time; one left over at a time.
void PanelRange(const float* xt, int64_t M, const float* w, int64_t K, float* out, int64_t N, int64_t p0,
                int64_t p1) {
  int64_t p = p0;
  if (M <= kFewRows) {
    for (; p + 3 <= p1; p += 3) Panels<3, 8>(xt, M, w, K, out, N, p);
  } else {
    for (; p + 2 <= p1; p += 2) Panels<2, 14>(xt, M, w, K, out, N, p);
  }
  for (; p < p1; ++p) Panels<1, 14>(xt, M, w, K, out, N, p);
}

ffi::Error Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, int64_t offset,
                 int64_t panels, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || od.size() != 2) {
    return ffi::Error::InvalidArgument("cpu_dense: expected x [M, K] and out [M, 16 P]");
  }
  const int64_t M = xd[0], K = xd[1], P = panels, N = P * kLanes;
  if (od[0] != M || od[1] != N || P < 0) {
    return ffi::Error::InvalidArgument("cpu_dense: x, panels and out shapes disagree");
  }
  if (offset < 0 || offset + P * K * kLanes > static_cast<int64_t>(w.element_count())) {
    return ffi::Error::InvalidArgument("cpu_dense: the packed weight's range lies outside w");
  }
  float* op = out->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::memset(op, 0, M * N * sizeof(float));
    return ffi::Error::Success();
  }
  std::vector<float> xt(K * M);  // x transposed, [K, M]
  const float* xp = x.typed_data();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) xt[k * M + m] = xp[m * K + k];
  }
  const float* wp = w.typed_data() + offset;
  // Chunks of panels: ~256 KiB of weights each (a whole number of tiles), so that handing one out costs little
  // against its work and each thread streams long contiguous runs (at one row, 64 KiB chunks ran at 25 GB/s,
  // 256 KiB at 28-30).
  const int64_t per_chunk = std::max<int64_t>(1, (256 * 1024) / (K * kLanes * int64_t(sizeof(float))));
  const int64_t chunk = (per_chunk + 5) / 6 * 6;  // whole tiles of 2 or 3 panels
  const int64_t chunks = (P + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};  // the next chunk (work stealing over chunks)
  const std::function<void()> drain = [&] {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      PanelRange(xt.data(), M, wp, K, op, N, c * chunk, std::min(P, (c + 1) * chunk));
    }
  };
  // The calling thread and the library's workers (cpu_workers.h), one per core of XLA's pool.
  superinfer::Workers::Get(pool.num_threads()).Run(drain, chunks - 1);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SuperinferCpuDense, Dense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // XLA:CPU's intra-op pool
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x
                                  .Arg<ffi::Buffer<ffi::F32>>()    // w (packed panels, flat)
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("panels")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out
