// A fixed pool of worker threads shared by Tether's CPU kernels.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tether_mlx {

// A fixed pool of workers (one per core, the caller being one of them) that
// split a range of rows. Persistent threads: spawning per call would cost
// more than a decode-sized product takes.
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
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &fn;
      n_ = n;
      chunk_ = chunk;
      next_.store(0);
      active_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return active_ == 0; });
    job_ = nullptr;
  }

 private:
  RowPool() {
    unsigned n = std::thread::hardware_concurrency();
    for (unsigned i = 1; i < (n == 0 ? 1 : n); ++i) workers_.emplace_back([this] { loop(); });
  }
  ~RowPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      ++generation_;
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
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        if (stop_) return;
      }
      work();
      std::lock_guard<std::mutex> lk(mu_);
      if (--active_ == 0) done_cv_.notify_all();
    }
  }

  std::mutex run_mutex_, mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<int> next_{0};
  int n_ = 0, chunk_ = 1, active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace tether_mlx
