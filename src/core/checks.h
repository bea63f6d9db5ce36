// Argument checks shared by the ops' validation (src/ops): each throws tpf::Error with a message
// that names the argument and what was expected.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>

#include "tpf/tensor.h"

namespace tpf {

// float32, bfloat16 or float16.
bool is_float16_or_32(DType d);

// t has exactly the shape `expected`; `layout` names the dimensions in the message ("[B, S, S, D]").
// `given`, when not null, is the view as the caller passed it (t being a reshaped view of it),
// whose shape the message shows.
void check_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> expected,
                 const char* layout, const TensorView* given = nullptr);
void check_inner_contiguous(const TensorView& t, const char* name);
void check_contiguous(const TensorView& t, const char* name);
void check_same_device(const TensorView& t, const TensorView& ref, const char* name,
                       const char* ref_name);
// t has ref's dtype.
void check_same_dtype(const TensorView& t, const TensorView& ref, const char* name,
                      const char* ref_name);
// float32, bfloat16 or float16; with `f64`, float64 too (the FP64 references take it).
void check_float_tensor(const TensorView& t, const char* name, bool f64 = false);

// x as a message shows it: "0", "1e-05", "nan".
std::string number(double x);

// "cpu" or "cuda:N".
std::string device_name(const TensorView& t);

}  // namespace tpf
