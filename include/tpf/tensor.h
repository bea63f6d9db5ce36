// A non-owning view of a strided N-d array: what crosses from the bindings into the library.
// Strides are in elements. Nothing here knows about PyTorch or Python.
#pragma once
#include <array>
#include <cstdint>
#include <string>

namespace tpf {

enum class DType : uint8_t { f32, f16, bf16, f64, boolean, u8, i32, i64 };
enum class Device : uint8_t { cpu, cuda };

const char* dtype_name(DType d);
int dtype_size(DType d);

constexpr int kMaxDims = 8;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int device_index = 0;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> stride{};

  bool defined() const { return data != nullptr || numel() == 0; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  int64_t size(int i) const { return shape[i < 0 ? i + ndim : i]; }
  bool is_contiguous() const;
  std::string shape_string() const;
};

// Builds a contiguous view (used by C++ callers and tests).
TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                     Device device = Device::cpu);

// An optional tensor argument: absent when `present` is false.
struct OptionalTensor {
  bool present = false;
  TensorView view;
};

}  // namespace tpf
