#include "tpf/tensor.h"

#include "tpf/error.h"

namespace tpf {

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

// No iostreams in messages: a module built where the compiler links part of libstdc++ statically
// (e.g. a devtoolset GCC) crashed formatting an integer through a stream on the GPU machine,
// inside the very error it was reporting.
std::string TensorView::shape_string() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  TPF_CHECK(shape.size() <= size_t(kMaxDims), "make_view: at most 8 dimensions are supported");
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = int(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t st = 1;
  for (int j = t.ndim - 1; j >= 0; --j) {
    t.stride[j] = st;
    st *= t.shape[j];
  }
  return t;
}

}  // namespace tpf
