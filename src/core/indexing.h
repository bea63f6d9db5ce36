// Element offsets of strided views.
#pragma once
#include <cstdint>
#include "tpf/tensor.h"

namespace tpf {

inline int64_t offset_of(const TensorView& t, int64_t i0, int64_t i1) {
  return i0 * t.stride[0] + i1 * t.stride[1];
}
inline int64_t offset_of(const TensorView& t, int64_t i0, int64_t i1, int64_t i2) {
  return i0 * t.stride[0] + i1 * t.stride[1] + i2 * t.stride[2];
}
inline int64_t offset_of(const TensorView& t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  return i0 * t.stride[0] + i1 * t.stride[1] + i2 * t.stride[2] + i3 * t.stride[3];
}
inline int64_t offset_of(const TensorView& t, int64_t i0, int64_t i1, int64_t i2, int64_t i3,
                         int64_t i4) {
  return i0 * t.stride[0] + i1 * t.stride[1] + i2 * t.stride[2] + i3 * t.stride[3] +
         i4 * t.stride[4];
}

inline bool mask_at(const OptionalTensor& m, int64_t b, int64_t n, int64_t key) {
  if (!m.present) return true;
  return static_cast<const uint8_t*>(m.view.data)[offset_of(m.view, b, n, key)] != 0;
}

}  // namespace tpf
