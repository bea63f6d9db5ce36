// A non-owning view of a strided N-d array: what crosses from the bindings into the library.
// Strides are in elements. Nothing here knows about PyTorch or Python.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace tpf {

enum class DType : uint8_t { f32, f16, bf16, f64, boolean, u8, i32, i64 };
enum class Device : uint8_t { cpu, cuda };

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::f64: return "float64";
    case DType::boolean: return "bool";
    case DType::u8: return "uint8";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
  }
  return "unknown";
}

inline int dtype_size(DType d) {
  switch (d) {
    case DType::f16:
    case DType::bf16: return 2;
    case DType::f32:
    case DType::i32: return 4;
    case DType::f64:
    case DType::i64: return 8;
    case DType::boolean:
    case DType::u8: return 1;
  }
  return 0;
}

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

// Device scratch of a CUDA op call, from the caller's allocator: the op asks once, for the size it
// computed after validating its arguments. The memory must stay valid for the work the op enqueues
// on its stream; a stream-ordered allocator (PyTorch's caching allocator) may hand it out again
// once the call has returned. CPU calls never ask.
using Allocator = std::function<void*(size_t bytes)>;

}  // namespace tpf
