// Persistent worker threads shared by this library's CPU kernels (cpu_paged_attention.cc, cpu_dense.cc).
//
// Why not XLA's intra-op pool (ffi::ThreadPool)? Its idle threads park, and a task scheduled onto a parked pool
// started on average 93 us late in a SmolLM2 decode step at batch 16 (WORKSPACE_NOTES 2026-12-04): longer than a
// whole qkv projection (~110 us), so the calling thread did most of each call's work alone. These workers spin
// for a while after each call (a decode step calls the kernels every 20-200 us) and only then sleep, so the next
// call finds them awake.
//
// Protocol (one job at a time; a call that finds the workers busy, e.g. two kernels run concurrently by XLA,
// runs its job on the calling thread alone): the caller publishes `job` and a new generation with the OPEN bit;
// a worker joins by incrementing the active count in the same atomic word, only while OPEN is set and the
// generation is the one it saw, runs the job, then decrements. After running the job itself the caller clears
// OPEN and waits until the active count is 0, so no worker ever touches a job after Run returns. The job must
// be a work-stealing drain: correct whoever (and however few) run it.
#ifndef SUPERINFER_CPU_WORKERS_H_
#define SUPERINFER_CPU_WORKERS_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SUPERINFER_PAUSE() _mm_pause()
#else
#define SUPERINFER_PAUSE() std::this_thread::yield()
#endif

namespace superinfer {

class Workers {
 public:
  // How long an idle worker spins (checking for a new job) before it sleeps.
  static constexpr int64_t kSpinMicros = 2000;

  // The process's workers: `threads - 1` of them, created by the first call (later calls' counts are ignored).
  static Workers& Get(int64_t threads) {
    static Workers* workers = new Workers(threads - 1);  // never destroyed: workers outlive static destructors
    return *workers;
  }

  // Runs `job` on the calling thread and on up to `helpers` workers; returns once every runner has returned.
  void Run(const std::function<void()>& job, int64_t helpers) {
    // A forked child has none of the workers (and maybe a mutex locked at the fork): it runs alone.
    if (helpers <= 0 || threads_.empty() || getpid() != pid_ || !busy_.try_lock()) {
      job();
      return;
    }
    job_ = &job;
    wanted_.store(helpers, std::memory_order_relaxed);
    const uint64_t gen = (state_.load() >> kGenShift) + 1;
    state_.store((gen << kGenShift) | kOpen);  // seq_cst: ordered before the sleepers_ read below
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    job();
    state_.fetch_and(~kOpen);
    while ((state_.load() & kActiveMask) != 0) SUPERINFER_PAUSE();
    job_ = nullptr;
    busy_.unlock();
  }

 private:
  static constexpr int kGenShift = 17;
  static constexpr uint64_t kOpen = uint64_t{1} << 16;
  static constexpr uint64_t kActiveMask = kOpen - 1;

  explicit Workers(int64_t n) : pid_(getpid()) {
    for (int64_t i = 0; i < n; ++i) {
      threads_.emplace_back([this, i] { Loop(i); });
      threads_.back().detach();
    }
  }

  // Joins the job of generation `gen` if it is still open and wants this worker; true if it ran it.
  bool TryJoin(uint64_t gen, int64_t index) {
    uint64_t s = state_.load();
    while ((s >> kGenShift) == gen && (s & kOpen)) {
      if (index >= wanted_.load(std::memory_order_relaxed)) return false;
      if (state_.compare_exchange_weak(s, s + 1)) {
        (*job_)();
        state_.fetch_sub(1);
        return true;
      }
    }
    return false;
  }

  void Loop(int64_t index) {
    uint64_t seen = state_.load() >> kGenShift;
    for (;;) {
      // Spin until a new generation appears or the spin time is up; then sleep until one appears.
      auto start = std::chrono::steady_clock::now();
      uint64_t gen = state_.load() >> kGenShift;
      for (int64_t i = 0; gen == seen; ++i) {
        SUPERINFER_PAUSE();
        if ((i & 15) == 15) std::this_thread::yield();  // a runnable thread on this core (XLA's pool) goes first
        if ((i & 255) == 255 &&
            std::chrono::steady_clock::now() - start > std::chrono::microseconds(kSpinMicros)) {
          std::unique_lock<std::mutex> lock(mu_);
          sleepers_.fetch_add(1);  // seq_cst: before the state read in the predicate
          cv_.wait(lock, [&] { return (state_.load() >> kGenShift) != seen; });
          sleepers_.fetch_sub(1);
        }
        gen = state_.load() >> kGenShift;
      }
      seen = gen;
      TryJoin(gen, index);
    }
  }

  const pid_t pid_;                       // the process that started the workers
  std::vector<std::thread> threads_;
  std::mutex busy_;                       // held by the caller of Run while its job is published
  std::atomic<uint64_t> state_{0};        // generation << 17 | OPEN << 16 | active runners
  std::atomic<int64_t> wanted_{0};        // workers the current job wants (index < wanted_ join)
  const std::function<void()>* job_ = nullptr;
  std::mutex mu_;                         // sleeping workers
  std::condition_variable cv_;
  std::atomic<int64_t> sleepers_{0};
};

}  // namespace superinfer

#endif  // SUPERINFER_CPU_WORKERS_H_
