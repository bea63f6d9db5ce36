#include "tpf/tensor.h"

#include <sstream>

#include "tpf/error.h"

namespace tpf {

const char* dtype_name(DType d) {
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

int dtype_size(DType d) {
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

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
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
