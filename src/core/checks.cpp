#include "core/checks.h"

#include <charconv>
#include <string>

#include "tpf/error.h"

namespace tpf {

bool is_float16_or_32(DType d) { return d == DType::f32 || d == DType::f16 || d == DType::bf16; }

void check_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> expected,
                 const char* layout, const TensorView* given) {
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
                (given ? given : &t)->shape_string());
  }
}

void check_inner_contiguous(const TensorView& t, const char* name) {
  TPF_CHECK(t.ndim == 0 || t.shape[t.ndim - 1] <= 1 || t.stride[t.ndim - 1] == 1,
            std::string(name) + " must have stride 1 in its last dimension, got stride " +
                std::to_string(t.stride[t.ndim - 1]));
}

void check_contiguous(const TensorView& t, const char* name) {
  TPF_CHECK(t.is_contiguous(), std::string(name) + " must be contiguous");
}

std::string number(double x) {  // as %g writes it, without a stream (see shape_string)
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::general, 6);
  return std::string(buf, r.ptr);
}

std::string device_name(const TensorView& t) {
  return t.device == Device::cpu ? "cpu" : "cuda:" + std::to_string(t.device_index);
}

void check_same_device(const TensorView& t, const TensorView& ref, const char* name,
                       const char* ref_name) {
  TPF_CHECK(
      t.device == ref.device && (t.device == Device::cpu || t.device_index == ref.device_index),
      std::string(name) + " must be on " + ref_name + "'s device " + device_name(ref) + ", got " +
          device_name(t));
}

void check_same_dtype(const TensorView& t, const TensorView& ref, const char* name,
                      const char* ref_name) {
  TPF_CHECK(t.dtype == ref.dtype, std::string(name) + " must have " + ref_name + "'s dtype " +
                                      dtype_name(ref.dtype) + ", got " + dtype_name(t.dtype));
}

void check_float_tensor(const TensorView& t, const char* name, bool f64) {
  TPF_CHECK(is_float16_or_32(t.dtype) || (f64 && t.dtype == DType::f64),
            std::string(name) + " must be float32, bfloat16 or float16" +
                (f64 ? " (or float64)" : "") + ", got " + dtype_name(t.dtype));
}

}  // namespace tpf
