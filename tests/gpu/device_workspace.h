// What the GPU programs (the sanitizer cases) share: their main(), a CUDA error check that ends the
// program with the call's name, device copies of host vectors, and the ops' workspace allocator (each
// request a cudaMalloc'd block, all freed together when the DeviceWorkspace goes, after the work
// that uses them has finished).
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <vector>

#include "tpf/tensor.h"

// A program's main(): run()'s exit code, or a tpf::Error (bad arguments, a failed launch) as a
// message under the program's name and exit 1, not an uncaught exception.
inline int program_main(const char* name, int (*run)()) {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
}

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* d = nullptr;
  check(cudaMalloc(&d, host.size() * sizeof(T)), "cudaMalloc");
  check(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "copy");
  return d;
}

class DeviceWorkspace {
 public:
  DeviceWorkspace() = default;
  DeviceWorkspace(const DeviceWorkspace&) = delete;
  DeviceWorkspace& operator=(const DeviceWorkspace&) = delete;
  ~DeviceWorkspace() {
    cudaDeviceSynchronize();
    for (void* p : *blocks_) cudaFree(p);
  }
  tpf::Allocator allocator() {
    return [blocks = blocks_.get()](size_t bytes) -> void* {
      void* p = nullptr;
      if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        std::fprintf(stderr, "workspace: cudaMalloc of %zu bytes failed\n", bytes);
        std::exit(1);
      }
      blocks->push_back(p);
      return p;
    };
  }

 private:
  std::unique_ptr<std::vector<void*>> blocks_ = std::make_unique<std::vector<void*>>();
};
