#include "core/checks.h"

#include <string>

#include "tpf/error.h"

namespace tpf {

bool is_float(DType d) {
  return d == DType::f32 || d == DType::f16 || d == DType::bf16 || d == DType::f64;
}

void check_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> expected,
                 const char* layout) {
  bool ok = t.ndim == int(expected.size());
  int i = 0;
  for (int64_t e : expected) {
    if (ok && t.shape[i] != e) ok = false;
    ++i;
  }
  if (!ok) {
    std::string want = "[";
    i = 0;
    for (int64_t e : expected) want += (i++ ? ", " : "") + std::to_string(e);
    want += "]";
    throw Error(std::string(name) + " must have shape " + layout + " = " + want + ", got " +
                t.shape_string());
  }
}

void check_inner_contiguous(const TensorView& t, const char* name) {
  TPF_CHECK(t.shape[t.ndim - 1] <= 1 || t.stride[t.ndim - 1] == 1,
            std::string(name) + " must have stride 1 in its last dimension, got stride " +
                std::to_string(t.stride[t.ndim - 1]));
}

void check_same_device(const TensorView& t, const TensorView& ref, const char* name,
                       const char* ref_name) {
  TPF_CHECK(t.device == ref.device && t.device_index == ref.device_index,
            std::string(name) + " must be on the same device as " + ref_name);
}

void check_float_tensor(const TensorView& t, const char* name) {
  TPF_CHECK(is_float(t.dtype), std::string(name) +
                                   " must be float32, bfloat16 or float16 (float64 for the "
                                   "reference), got " +
                                   dtype_name(t.dtype));
}

}  // namespace tpf
