// The thread pool: every task runs exactly once, calls return once their tasks are done (workers
// that wake late are not waited for, and must not run a finished call's tasks), and the first
// error of a call reaches its caller while later calls still work.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tpf/parallel.h"

namespace tpf {
namespace {

TEST(ThreadPool, EveryTaskRunsExactlyOnceAcrossManyCalls) {
  std::mt19937_64 rng(11);
  for (int call = 0; call < 3000; ++call) {
    const int64_t n = int64_t(1 + rng() % 70);
    std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
    // Uneven tasks, so calls end while a worker may still be waking up for them.
    parallel_for(n, [&](int64_t i) {
      if (i % 7 == 3) std::this_thread::sleep_for(std::chrono::microseconds(20));
      runs[size_t(i)].fetch_add(1);
    });
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(runs[size_t(i)].load(), 1) << "call " << call << " task " << i;
  }
}

TEST(ThreadPool, FirstErrorReachesTheCallerAndThePoolKeepsWorking) {
  for (int call = 0; call < 200; ++call) {
    std::atomic<int> ran{0};
    try {
      parallel_for(64, [&](int64_t i) {
        ran.fetch_add(1);
        if (i == 17) throw std::runtime_error("task 17 failed");
      });
      FAIL() << "no error reached the caller";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "task 17 failed");
    }
    EXPECT_GE(ran.load(), 1);
    std::atomic<int64_t> sum{0};
    parallel_for(100, [&](int64_t i) { sum.fetch_add(i); });
    ASSERT_EQ(sum.load(), 99 * 100 / 2) << "call " << call;
  }
}

TEST(ThreadPool, CallsFromManyThreadsAtOnce) {
  std::vector<std::thread> callers;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t)
    callers.emplace_back([&] {
      for (int call = 0; call < 300; ++call) {
        std::vector<std::atomic<int>> runs(33);
        parallel_for(33, [&](int64_t i) { runs[size_t(i)].fetch_add(1); });
        for (auto& r : runs) bad += r.load() != 1;
      }
    });
  for (auto& c : callers) c.join();
  EXPECT_EQ(bad.load(), 0);
}

}  // namespace
}  // namespace tpf
