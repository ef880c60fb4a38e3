// A fork-join pool for the CPU kernels in this folder: why not torch's OpenMP pool.
//
// A decode step of a small model is ~150 kernel calls of 5-60 us each. With OMP_WAIT_POLICY=PASSIVE
// (the engine's default, because spinning OpenMP threads collapse when another process holds a
// core) every parallel region first wakes the sleeping second thread, ~25 us here, so on 2 cores a
// 4-bit GEMM ran *slower* on two threads than on one. This pool differs in two ways:
//   - its worker spins for a short while (kSpinMicros) after each job, yielding the core at every
//     turn, so the next kernel of the same step finds it awake; between steps it sleeps;
//   - the work is split into many small chunks claimed one at a time, and the calling thread claims
//     them too: it never waits for a worker that has not started (asleep, or its core taken by
//     another process), only for chunks a worker already holds.
// The chunk functions touch raw memory only (no torch calls), so they may run on any thread.
//
// Read-ahead: between a decode step's kernels the calling thread runs the model's Python (norms,
// RoPE, attention, sampling: ~12 % of a 1B's step at one row) while memory sits idle and the
// workers spin. read_ahead(t, bytes) names the bytes the next kernel will read (the next
// projection's weights); an idle worker reads them into cache then, line by line, and stops at the
// next job. A one-row GEMM is bound by reading its weights, so what is read ahead comes from cache
// instead of memory when the kernel gets there (docs/profile.md).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ISV_PAUSE() _mm_pause()
#else
#define ISV_PAUSE() ((void)0)
#endif

namespace iterserve {

class WorkPool {
 public:
  using Fn = std::function<void(int64_t)>;
  // a step's kernels are closer together than this; ITERSERVE_POOL_SPIN_US overrides it (0: always sleep)
  static constexpr int kSpinMicros = 100;

  // One pool per process, with at::get_num_threads() - 1 workers (read at first use).
  static WorkPool& instance() {
    static WorkPool* pool = new WorkPool(std::max(1, at::get_num_threads()) - 1);  // never destroyed
    return *pool;
  }

  int num_threads() const { return static_cast<int>(workers_) + 1; }

  // The first `bytes` of t's data (all of it when bytes exceeds it) for an idle worker to read into
  // cache (see the top of this file); replaces a read-ahead no worker has taken yet. Called with the
  // GIL held (from Python): the pool keeps a reference to t, taken and dropped on this thread only,
  // so t's memory outlives any read of it; a worker never touches the tensor itself (a tensor that
  // Python has seen takes the GIL when a second thread adds or drops a reference: a worker blocked on
  // it for a switch interval left the whole step's kernels on one thread). Without workers: nothing.
  void read_ahead(const at::Tensor& t, int64_t bytes) {
    if (workers_ == 0 || forked_child() || !t.defined()) return;
    const int64_t n = std::min<int64_t>(bytes, t.numel() * t.element_size());
    if (n <= 0) return;
    at::Tensor old;
    {
      std::lock_guard<std::mutex> lock(ahead_mu_);
      old = std::move(ahead_);
      ahead_ = t;
      ahead_ptr_ = static_cast<const uint8_t*>(t.const_data_ptr());
      ahead_bytes_ = n;
      ahead_posted_.fetch_add(1);
    }
    // the last reference to the old bytes (their model is gone): no worker may be reading them
    if (old.defined() && old.use_count() == 1)
      while (ahead_reading_.load() > 0) ISV_PAUSE();
  }

  // bytes read ahead so far by this pool's workers (tests, benchmarks)
  int64_t read_ahead_bytes() const { return ahead_done_.load(); }

  // Calls fn(c) for every c in [0, n), spread over the pool; returns when all are done.
  void run(int64_t n, const Fn& fn) {
    if (n <= 0) return;
    if (workers_ == 0 || n == 1 || forked_child()) {
      for (int64_t c = 0; c < n; ++c) fn(c);
      return;
    }
    std::lock_guard<std::mutex> one_job(run_mu_);  // jobs from two engine threads take turns
    const uint64_t gen = (ticket_.load() >> kGenShift) + 1;
    fn_.store(&fn);
    done_.store(0);
    ticket_.store(gen << kGenShift | static_cast<uint64_t>(n) << kNShift);  // publishes the job
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    int64_t c;
    while ((c = claim(gen)) >= 0) {
      fn(c);
      done_.fetch_add(1);
    }
    while (done_.load() < n) {  // only chunks a worker holds are left
      ISV_PAUSE();
      sched_yield();
    }
  }

 private:
  // ticket_ = generation (24 bits) | chunk count (20) | next chunk (20): one atomic word, so a claim
  // can never mix one job's counter with another's
  static constexpr int kGenShift = 40, kNShift = 20;
  static constexpr uint64_t kMask20 = (1ull << 20) - 1;

  // A child made by fork() has no worker threads, and a lock a worker held at the fork stays held:
  // the child runs every job on its calling thread.
  static std::atomic<bool>& forked_child() {
    static std::atomic<bool> flag{false};
    return flag;
  }

  explicit WorkPool(int workers) : workers_(workers) {
    pthread_atfork(nullptr, nullptr, [] { forked_child().store(true); });
    const char* env = std::getenv("ITERSERVE_POOL_SPIN_US");
    spin_us_ = env ? std::max(0, std::atoi(env)) : kSpinMicros;
    for (int i = 0; i < workers; ++i) std::thread([this] { work(); }).detach();
  }

  // The next chunk of job `gen`, or -1 when it has none left (or is not the current job).
  int64_t claim(uint64_t gen) {
    uint64_t t = ticket_.load();
    while ((t >> kGenShift) == gen) {
      const uint64_t next = t & kMask20, n = (t >> kNShift) & kMask20;
      if (next >= n) return -1;
      if (ticket_.compare_exchange_weak(t, t + 1)) return static_cast<int64_t>(next);
    }
    return -1;
  }

  void work() {
    uint64_t seen = ticket_.load() >> kGenShift;
    for (;;) {
      auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      uint64_t gen;
      while ((gen = ticket_.load() >> kGenShift) == seen && std::chrono::steady_clock::now() < deadline) {
        if (ahead_posted_.load(std::memory_order_relaxed) != ahead_taken_.load(std::memory_order_relaxed) &&
            read_ahead_once(seen)) {
          deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);  // a step is under way
          continue;  // read ahead until done or a job came; then spin on
        }
        ISV_PAUSE();
        sched_yield();
      }
      if (gen == seen) {  // nothing came: sleep until a job is published
        sleepers_.fetch_add(1);
        {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return (ticket_.load() >> kGenShift) != seen; });
        }
        sleepers_.fetch_sub(1);
        gen = ticket_.load() >> kGenShift;
      }
      seen = gen;
      // fn_ is read before each claim: a claim that succeeds proves job `gen` was live all along,
      // so the function read is that job's (run() stores the next job's only after this one ends)
      for (;;) {
        const Fn* fn = fn_.load();
        const int64_t c = claim(gen);
        if (c < 0) break;
        (*fn)(c);
        done_.fetch_add(1);
      }
    }
  }

  // Takes the posted read-ahead (if another worker has not) and reads it a piece at a time while no
  // job is published past `seen`; true when it took one.
  bool read_ahead_once(uint64_t seen) {
    const uint8_t* p;
    int64_t n;
    {
      std::lock_guard<std::mutex> lock(ahead_mu_);
      if (ahead_taken_.load() == ahead_posted_.load()) return false;
      ahead_taken_.store(ahead_posted_.load());
      p = ahead_ptr_;
      n = ahead_bytes_;
      ahead_reading_.fetch_add(1);
    }
    constexpr int64_t kPiece = 16 << 10;  // between checks for a job: ~1 us from memory
    constexpr int64_t kYieldEvery = 256 << 10;  // ~20 us
    uint64_t sink = 0;
    int64_t off = 0;
    for (; off < n && (ticket_.load(std::memory_order_relaxed) >> kGenShift) == seen; off += kPiece) {
      const int64_t end = std::min(n, off + kPiece);
      for (int64_t i = off; i < end; i += 64) sink += p[i];  // one load a line: the line comes into cache
      if (off % kYieldEvery == kYieldEvery - kPiece) sched_yield();  // as the spin does: a server's other threads run
    }
    ahead_reading_.fetch_sub(1);
    ahead_sink_.store(sink, std::memory_order_relaxed);  // the loads are kept
    ahead_done_.fetch_add(std::min(off, n));
    return true;
  }

  const int workers_;
  int spin_us_;
  std::mutex ahead_mu_;
  at::Tensor ahead_;  // the last read-ahead posted (under ahead_mu_, and only ever on the posting thread)
  const uint8_t* ahead_ptr_ = nullptr;
  int64_t ahead_bytes_ = 0;
  std::atomic<uint64_t> ahead_posted_{0}, ahead_taken_{0}, ahead_sink_{0};
  std::atomic<int> ahead_reading_{0};
  std::atomic<int64_t> ahead_done_{0};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<const Fn*> fn_{nullptr};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::mutex mu_, run_mu_;
  std::condition_variable cv_;
};

// Row kernels of few elements a call (element-wise steps, the sampler's argmax): below kElemInline
// elements a call stays on the calling thread, as waking the pool would cost more than the work
// (elementwise.cpp's measurements); above, chunks of about kElemChunk elements, whole rows.
constexpr int64_t kElemInline = 32768;
constexpr int64_t kElemChunk = 16384;

// Runs rows [0, T) through row(t), inline when small, else in chunks of whole rows on the pool.
template <typename F>
void for_rows(int64_t T, int64_t row_elems, const F& row) {
  if (T * row_elems < kElemInline) {
    for (int64_t t = 0; t < T; ++t) row(t);
    return;
  }
  const int64_t per = std::max<int64_t>(1, kElemChunk / std::max<int64_t>(1, row_elems));
  WorkPool::instance().run((T + per - 1) / per, [&](int64_t c) {
    for (int64_t t = c * per; t < std::min(T, c * per + per); ++t) row(t);
  });
}

// Splits [0, n) into about `chunks` ranges and runs fn(begin, end) on each through the pool.
inline void parallel_ranges(int64_t n, int64_t chunks, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  chunks = std::max<int64_t>(1, std::min(chunks, n));
  const int64_t step = (n + chunks - 1) / chunks;
  WorkPool::instance().run((n + step - 1) / step, [&](int64_t c) { fn(c * step, std::min(n, (c + 1) * step)); });
}

}  // namespace iterserve
