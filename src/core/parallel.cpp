#include "tpf/parallel.h"

#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace tpf {
namespace {

// One parallel_for call. Workers that join hold it through a shared_ptr, so the caller can return
// as soon as every task has finished, without waiting for workers that woke too late to take one.
struct Job {
  const std::function<void(int64_t)>* fn = nullptr;
  int64_t n = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  std::exception_ptr error;
};

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
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->n = n;
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = job;
      ++generation_;
    }
    wake_.notify_all();
    drain(*job);
    std::unique_lock<std::mutex> lock(mu_);
    job_.reset();
    // Only tasks already taken can be outstanding: a worker that is slow to wake (the other cores
    // are busy) finds nothing left and is not waited for.
    done_.wait(lock, [&] { return job->done.load() == n; });
    if (job->error) std::rethrow_exception(job->error);
  }

 private:
  // Runs tasks of `job` until none is left. After a task throws, the rest are counted, not run.
  void drain(Job& job) {
    for (int64_t i; (i = job.next.fetch_add(1)) < job.n;) {
      if (!job.failed.load()) {
        try {
          (*job.fn)(i);
        } catch (...) {
          std::lock_guard<std::mutex> lock(job.error_mu);
          if (!job.error) job.error = std::current_exception();
          job.failed.store(true);
        }
      }
      if (job.done.fetch_add(1) + 1 == job.n) {
        std::lock_guard<std::mutex> lock(mu_);
        done_.notify_all();
      }
    }
  }

  void work() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || (job_ && generation_ != seen); });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      drain(*job);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable wake_, done_;
  std::shared_ptr<Job> job_;  // the call in progress, null between calls
  uint64_t generation_ = 0;
  bool stop_ = false;
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
