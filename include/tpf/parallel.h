// A small persistent thread pool. parallel_for runs fn(i) for i in [0, n); tasks must write disjoint
// outputs, so results never depend on which thread ran which task (determinism by construction).
#pragma once
#include <cstdint>
#include <functional>

namespace tpf {

// Number of worker threads: TPF_NUM_THREADS if set, else the hardware concurrency.
int num_threads();

// Runs fn over [0, n) on the pool and waits. The first exception thrown by a task is rethrown here.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

}  // namespace tpf
