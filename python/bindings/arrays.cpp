#include "arrays.h"

#include <string>

#include "tpf/error.h"

namespace tpf::py {
namespace {

DType dtype_of(const Array& a, const char* name) {
  const nb::dlpack::dtype t = a.dtype();
  using code = nb::dlpack::dtype_code;
  if (t.lanes == 1) {
    if (t.code == uint8_t(code::Float) && t.bits == 32) return DType::f32;
    if (t.code == uint8_t(code::Float) && t.bits == 16) return DType::f16;
    if (t.code == uint8_t(code::Float) && t.bits == 64) return DType::f64;
    if (t.code == uint8_t(code::Bfloat) && t.bits == 16) return DType::bf16;
    if (t.code == uint8_t(code::Bool) && t.bits == 8) return DType::boolean;
    if (t.code == uint8_t(code::UInt) && t.bits == 8) return DType::u8;
    if (t.code == uint8_t(code::Int) && t.bits == 32) return DType::i32;
    if (t.code == uint8_t(code::Int) && t.bits == 64) return DType::i64;
  }
  throw Error(std::string(name) + " has an unsupported dtype (DLPack code " +
              std::to_string(t.code) + ", " + std::to_string(t.bits) + " bits)");
}

}  // namespace

TensorView view_of(const Array& a, const char* name) {
  TPF_CHECK(a.ndim() <= size_t(kMaxDims), std::string(name) + " has more than 8 dimensions");
  TensorView t;
  t.data = a.data();
  t.dtype = dtype_of(a, name);
  const int dev = a.device_type();
  if (dev == nb::device::cpu::value) {
    t.device = Device::cpu;
  } else if (dev == nb::device::cuda::value) {
    t.device = Device::cuda;
  } else {
    throw Error(std::string(name) + " must be a CPU or CUDA array");
  }
  t.device_index = a.device_id();
  t.ndim = int(a.ndim());
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[i] = int64_t(a.shape(i));
    t.stride[i] = int64_t(a.stride(i));
  }
  return t;
}

Allocator allocator_of(const std::optional<nb::callable>& fn, std::vector<Array>& keep) {
  if (!fn) return {};
  // Pointers only: the ops copy the Allocator without the GIL, which a copied callable would need.
  return [f = &*fn, keep = &keep](size_t bytes) -> void* {
    nb::gil_scoped_acquire gil;
    keep->push_back(nb::cast<Array>((*f)(bytes)));
    const Array& a = keep->back();
    TPF_CHECK(a.nbytes() >= bytes, "workspace: the allocator returned " +
                                       std::to_string(a.nbytes()) + " bytes, asked for " +
                                       std::to_string(bytes));
    return a.data();
  };
}

OptionalTensor optional_view_of(const OptArray& a, const char* name) {
  OptionalTensor o;
  if (a) {
    o.present = true;
    o.view = view_of(*a, name);
  }
  return o;
}

}  // namespace tpf::py
