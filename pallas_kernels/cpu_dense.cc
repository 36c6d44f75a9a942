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
// 2026-12-04). Here each thread streams its panels once, contiguously: one 64-byte row of a panel per k, used by
// every row of x (up to 16 accumulator registers, one per row, the row's x[m, k] broadcast), so the weights are read
// once per call whatever M is (rows beyond 16 re-read the panel from L1/L2, not from memory).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// 16 floats, loaded and stored through a may_alias, 4-byte-aligned type: one vector access each (a memcpy into a
// local vector compiles to narrower stores and a wide reload: a store-forwarding stall).
typedef float V16 __attribute__((vector_size(64), aligned(4), may_alias));

constexpr int64_t kLanes = 16;
constexpr int64_t kPrefetch = 8;  // rows (k) of the panel ahead of the one being used

// Rows m0..m0+MR-1 of x (transposed: xt[k * M + m]) against one panel: MR x 16 outputs.
template <int MR>
void PanelRows(const float* xt, int64_t M, int64_t m0, const float* panel, int64_t K, float* out, int64_t N,
               int64_t n0) {
  V16 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = V16{};
  const float* xk = xt + m0;
  for (int64_t k = 0; k < K; ++k, xk += M) {
    const V16 w = *reinterpret_cast<const V16*>(panel + k * kLanes);
    __builtin_prefetch(panel + (k + kPrefetch) * kLanes);
    for (int i = 0; i < MR; ++i) acc[i] += xk[i] * w;
  }
  for (int i = 0; i < MR; ++i) *reinterpret_cast<V16*>(out + (m0 + i) * N + n0) = acc[i];
}

template <int MR>
void PanelTail(const float* xt, int64_t M, int64_t m0, const float* panel, int64_t K, float* out, int64_t N,
               int64_t n0, int64_t rows) {
  if constexpr (MR > 0) {
    if (rows == MR) return PanelRows<MR>(xt, M, m0, panel, K, out, N, n0);
    return PanelTail<MR - 1>(xt, M, m0, panel, K, out, N, n0, rows);
  }
}

// Every row of x against panel p.
void Panel(const float* xt, int64_t M, const float* w, int64_t K, float* out, int64_t N, int64_t p) {
  const float* panel = w + p * K * kLanes;
  int64_t m0 = 0;
  for (; m0 + kLanes <= M; m0 += kLanes) PanelRows<kLanes>(xt, M, m0, panel, K, out, N, p * kLanes);
  if (m0 < M) PanelTail<kLanes - 1>(xt, M, m0, panel, K, out, N, p * kLanes, M - m0);
}

// The panels of one call, shared by the threads that compute them (as in cpu_paged_attention.cc: heap-allocated
// and reference-counted, so a pool task that starts after the call returned finds nothing left to do).
struct Work {
  std::vector<float> xt;             // x transposed, [K, M]
  std::atomic<int64_t> next{0};      // the next chunk of panels
  std::atomic<int64_t> active{0};    // threads inside the drain loop
};

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
  auto work = std::make_shared<Work>();
  work->xt.resize(K * M);
  const float* xp = x.typed_data();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) work->xt[k * M + m] = xp[m * K + k];
  }
  const float* wp = w.typed_data() + offset;
  // Chunks of panels: at least ~64 KiB of weights each, so that handing one out costs little against its work.
  const int64_t chunk = std::max<int64_t>(1, (64 * 1024) / (K * kLanes * int64_t(sizeof(float))));
  const int64_t chunks = (P + chunk - 1) / chunk;
  auto drain = [=](Work& wk) {
    wk.active.fetch_add(1);
    for (int64_t c; (c = wk.next.fetch_add(1)) < chunks;) {
      const int64_t p1 = std::min(P, (c + 1) * chunk);
      for (int64_t p = c * chunk; p < p1; ++p) Panel(wk.xt.data(), M, wp, K, op, N, p);
    }
    wk.active.fetch_sub(1);
  };
  // Helpers from XLA's intra-op pool; the calling thread works too, so the call finishes even if none starts.
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([work, drain]() { drain(*work); });
  }
  drain(*work);
  while (work->active.load() != 0) std::this_thread::yield();
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
