// Scalar conversions between float and the 16-bit formats, round to nearest even, plus strided
// row loads and stores that dispatch on dtype once per row.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include "tpf/error.h"
#include "tpf/tensor.h"

namespace tpf {

inline float bf16_bits_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float round_to_bf16(float f) { return bf16_bits_to_float(float_to_bf16_bits(f)); }

inline float f16_bits_to_float(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return float(x);
}

inline uint16_t float_to_f16_bits(float f) {
  _Float16 x = _Float16(f);
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}

// Rounds f to the representable value of dtype (identity for f32/f64).
inline float round_to(DType d, float f) {
  switch (d) {
    case DType::bf16: return round_to_bf16(f);
    case DType::f16: return f16_bits_to_float(float_to_f16_bits(f));
    default: return f;
  }
}

// Element pointer arithmetic in bytes.
inline char* element_ptr(const TensorView& t, int64_t element_offset) {
  return static_cast<char*>(t.data) + element_offset * dtype_size(t.dtype);
}

// Loads n contiguous elements starting at element_offset into dst as T (float or double).
template <typename T>
inline void load_row(const TensorView& t, int64_t element_offset, int64_t n, T* dst) {
  const char* p = element_ptr(t, element_offset);
  switch (t.dtype) {
    case DType::f32: {
      const float* s = reinterpret_cast<const float*>(p);
      for (int64_t i = 0; i < n; ++i) dst[i] = T(s[i]);
      break;
    }
    case DType::f64: {
      const double* s = reinterpret_cast<const double*>(p);
      for (int64_t i = 0; i < n; ++i) dst[i] = T(s[i]);
      break;
    }
    case DType::bf16: {
      const uint16_t* s = reinterpret_cast<const uint16_t*>(p);
      for (int64_t i = 0; i < n; ++i) dst[i] = T(bf16_bits_to_float(s[i]));
      break;
    }
    case DType::f16: {
      const uint16_t* s = reinterpret_cast<const uint16_t*>(p);
      for (int64_t i = 0; i < n; ++i) dst[i] = T(f16_bits_to_float(s[i]));
      break;
    }
    default: throw Error(std::string("unsupported dtype ") + dtype_name(t.dtype));
  }
}

// Stores n values (rounding to the tensor's dtype) at element_offset.
template <typename T>
inline void store_row(const TensorView& t, int64_t element_offset, int64_t n, const T* src) {
  char* p = element_ptr(t, element_offset);
  switch (t.dtype) {
    case DType::f32: {
      float* d = reinterpret_cast<float*>(p);
      for (int64_t i = 0; i < n; ++i) d[i] = float(src[i]);
      break;
    }
    case DType::f64: {
      double* d = reinterpret_cast<double*>(p);
      for (int64_t i = 0; i < n; ++i) d[i] = double(src[i]);
      break;
    }
    case DType::bf16: {
      uint16_t* d = reinterpret_cast<uint16_t*>(p);
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16_bits(float(src[i]));
      break;
    }
    case DType::f16: {
      uint16_t* d = reinterpret_cast<uint16_t*>(p);
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_f16_bits(float(src[i]));
      break;
    }
    default: throw Error(std::string("unsupported dtype ") + dtype_name(t.dtype));
  }
}

}  // namespace tpf
