// DLPack arrays (through nanobind) to tpf::TensorView: the only place that knows both.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "tpf/tensor.h"

namespace tpf::py {

namespace nb = nanobind;
using Array = nb::ndarray<>;
using OptArray = std::optional<nb::ndarray<>>;

// A view of `a`; `name` appears in the error for an unsupported dtype or device.
TensorView view_of(const Array& a, const char* name);
OptionalTensor optional_view_of(const OptArray& a, const char* name);

inline void* stream_ptr(uintptr_t stream) { return reinterpret_cast<void*>(stream); }

// The caller's allocator, a Python callable (bytes -> a uint8 array on the tensors' device), as an
// op's Allocator (None: none, for CPU calls). It takes the GIL to call; the arrays it returns go to
// `keep`, which must outlive the op call and be released with the GIL held.
Allocator allocator_of(const std::optional<nb::callable>& fn, std::vector<Array>& keep);

}  // namespace tpf::py
