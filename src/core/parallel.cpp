#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <unistd.h>
#include <vector>

namespace tpf {
namespace {

class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 0; i < threads - 1; ++i) workers_.emplace_back([this] { work(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  void run(int64_t n, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> serial(run_mu_);  // one parallel region at a time
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      active_ = int(workers_.size());
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return active_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void drain() {
    for (int64_t i; (i = next_.fetch_add(1)) < n_;) {
      try {
        (*fn_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
        next_.store(n_);
      }
    }
  }

  void work() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      drain();
      std::lock_guard<std::mutex> lock(mu_);
      if (--active_ == 0) done_.notify_all();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  std::atomic<int64_t> next_{0};
  int64_t n_ = 0;
  int active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

// The pool's threads do not survive fork(); a forked child (a DataLoader worker) runs serially.
pid_t pool_owner = 0;

Pool& pool() {
  static Pool p((pool_owner = getpid(), num_threads()));
  return p;
}

}  // namespace

int num_threads() {
  static const int n = [] {
    if (const char* env = std::getenv("TPF_NUM_THREADS")) {
      int v = std::atoi(env);
      if (v > 0) return v;
    }
    return std::max(1, int(std::thread::hardware_concurrency()));
  }();
  return n;
}

void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1 || num_threads() == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  Pool& p = pool();
  if (getpid() != pool_owner) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  p.run(n, fn);
}

}  // namespace tpf
