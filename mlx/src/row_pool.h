// A fixed pool of worker threads shared by Tether's CPU kernels.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <immintrin.h>

namespace tether_mlx {

// A fixed pool of workers (one per core, the caller being one of them) that
// split a range of rows. Persistent threads: spawning per call would cost
// more than a decode-sized product takes.
//
// Hand-offs spin briefly before sleeping. A decode step calls the pool a
// few hundred times, a few microseconds to a few dozen apart; waking a
// sleeping worker through the kernel costs about as much as a small product
// itself. So a worker that finishes a job polls for the next one for up to
// kSpin, and the caller polls for the workers' end for as long, before
// either blocks on a condition variable. Long idle periods still sleep.
class RowPool {
 public:
  static RowPool& get() {
    static RowPool pool;
    return pool;
  }

  // Runs fn(begin, end) over [0, n) in chunks on all workers; returns when done.
  void run(int n, int chunk, const std::function<void(int, int)>& fn) {
    std::lock_guard<std::mutex> serial(run_mutex_);
    if (workers_.empty() || n <= chunk) {
      fn(0, n);
      return;
    }
    job_ = &fn;
    n_ = n;
    chunk_ = chunk;
    next_.store(0, std::memory_order_relaxed);
    active_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    {
      // Under the lock, so a worker about to sleep either sees the new
      // generation in its wait predicate or is already waiting for the notify.
      std::lock_guard<std::mutex> lk(mu_);
      generation_.fetch_add(1, std::memory_order_release);
      if (sleepers_ > 0) cv_.notify_all();
    }
    work();
    if (!spin_until([&] { return active_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock<std::mutex> lk(mu_);
      done_cv_.wait(lk, [&] { return active_.load(std::memory_order_acquire) == 0; });
    }
    job_ = nullptr;
  }

 private:
  // How long a hand-off polls before blocking (TETHER_POOL_SPIN_US overrides,
  // 0 turns polling off).
  static std::chrono::microseconds spin_time() {
    static const std::chrono::microseconds us([] {
      const char* v = std::getenv("TETHER_POOL_SPIN_US");
      return v ? std::atoi(v) : 50;
    }());
    return us;
  }

  template <typename Ready>
  static bool spin_until(Ready ready) {
    if (ready()) return true;
    const auto limit = spin_time();
    if (limit.count() == 0) return false;
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      for (int i = 0; i < 64; ++i) {
        if (ready()) return true;
        _mm_pause();
      }
      if (std::chrono::steady_clock::now() - start > limit) return ready();
    }
  }

  RowPool() {
    unsigned n = std::thread::hardware_concurrency();
    for (unsigned i = 1; i < (n == 0 ? 1 : n); ++i) workers_.emplace_back([this] { loop(); });
  }
  ~RowPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_.store(true, std::memory_order_release);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  void work() {
    for (;;) {
      int begin = next_.fetch_add(chunk_);
      if (begin >= n_) return;
      (*job_)(begin, std::min(n_, begin + chunk_));
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
        std::unique_lock<std::mutex> lk(mu_);
        ++sleepers_;
        cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        --sleepers_;
      }
      seen = generation_.load(std::memory_order_acquire);
      if (stop_.load(std::memory_order_acquire)) return;
      work();
      if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lk(mu_);
        done_cv_.notify_all();
      }
    }
  }

  std::mutex run_mutex_, mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<int> next_{0};
  std::atomic<int> active_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  int n_ = 0, chunk_ = 1, sleepers_ = 0;  // sleepers_ under mu_
};

}  // namespace tether_mlx
