// The ops' workspace allocator for the GPU programs: each request a cudaMalloc'd block, all freed
// together when the DeviceWorkspace goes (after the work that uses them has finished).
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "tpf/tensor.h"

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
