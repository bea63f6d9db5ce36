// Argument checks shared by the ops' validation (attention_checks.cpp, trimul_checks.cpp): each
// throws tpf::Error with a message that names the argument and what was expected.
#pragma once
#include <cstdint>
#include <initializer_list>

#include "tpf/tensor.h"

namespace tpf {

bool is_float(DType d);

// t has exactly the shape `expected`; `layout` names the dimensions in the message ("[B, S, S, D]").
void check_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> expected,
                 const char* layout);
void check_inner_contiguous(const TensorView& t, const char* name);
void check_same_device(const TensorView& t, const TensorView& ref, const char* name,
                       const char* ref_name);
// float32, bfloat16 or float16 (float64 for the reference).
void check_float_tensor(const TensorView& t, const char* name);

}  // namespace tpf
