// DLPack arrays (through nanobind) to tpf::TensorView: the only place that knows both.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>

#include "tpf/tensor.h"

namespace tpf::py {

namespace nb = nanobind;
using Array = nb::ndarray<>;
using OptArray = std::optional<nb::ndarray<>>;

// A view of `a`; `name` appears in the error for an unsupported dtype or device.
TensorView view_of(const Array& a, const char* name);
OptionalTensor optional_view_of(const OptArray& a, const char* name);

inline void* stream_ptr(uintptr_t stream) { return reinterpret_cast<void*>(stream); }

}  // namespace tpf::py
