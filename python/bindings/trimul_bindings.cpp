// Triangle multiplicative update entry points. Outputs are allocated by the caller (the torch
// layer) and passed in, scratch through its allocator `workspace`; `stream` is the caller's
// cudaStream_t as an integer (0 on the CPU).
// Weights (and their gradients) travel as one sequence of 12 arrays in TrimulWeights order:
//   norm_in_weight, norm_in_bias, p_in_weight, p_in_bias, g_in_weight, g_in_bias,
//   norm_out_weight, norm_out_bias, p_out_weight, p_out_bias, g_out_weight, g_out_bias
// where the four projection biases may be None or empty (absent: zero).
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "arrays.h"
#include "tpf/error.h"
#include "tpf/trimul.h"

namespace tpf::py {

namespace {

using ArrayList = std::vector<OptArray>;

constexpr const char* kWeightNames[12] = {
    "norm_in_weight",  "norm_in_bias",  "p_in_weight",  "p_in_bias",  "g_in_weight",  "g_in_bias",
    "norm_out_weight", "norm_out_bias", "p_out_weight", "p_out_bias", "g_out_weight", "g_out_bias"};

TrimulWeights weights_of(const ArrayList& w, const std::string& prefix) {
  TPF_CHECK(w.size() == 12,
            prefix + "weights must be a sequence of 12 arrays, got " + std::to_string(w.size()));
  auto required = [&](int k) {
    const std::string name = prefix + kWeightNames[k];
    TPF_CHECK(w[k].has_value(), name + " is required");
    return view_of(*w[k], name.c_str());
  };
  auto optional = [&](int k) {
    if (w[k] && w[k]->size() == 0) return OptionalTensor{};
    return optional_view_of(w[k], (prefix + kWeightNames[k]).c_str());
  };
  TrimulWeights t;
  t.norm_in_weight = required(0);
  t.norm_in_bias = required(1);
  t.p_in_weight = required(2);
  t.p_in_bias = optional(3);
  t.g_in_weight = required(4);
  t.g_in_bias = optional(5);
  t.norm_out_weight = required(6);
  t.norm_out_bias = required(7);
  t.p_out_weight = required(8);
  t.p_out_bias = optional(9);
  t.g_out_weight = required(10);
  t.g_out_bias = optional(11);
  return t;
}

TrimulSaved saved_of(const Array& a, const Array& b, const Array& z, const Array& go) {
  return TrimulSaved{view_of(a, "a"), view_of(b, "b"), view_of(z, "z"), view_of(go, "go")};
}

// The forward's arguments less y (and the saved tensors): the backward's are built over them.
TrimulForwardArgs shared_args(const Array& x, const OptArray& mask, const ArrayList& weights,
                              bool outgoing, double eps) {
  TrimulForwardArgs a;
  a.x = view_of(x, "x");
  a.mask = optional_view_of(mask, "mask");
  a.w = weights_of(weights, "");
  a.outgoing = outgoing;
  a.eps = eps;
  return a;
}

TrimulForwardArgs forward_args(const Array& x, const OptArray& mask, const ArrayList& weights,
                               bool outgoing, double eps, const Array& y) {
  TrimulForwardArgs a = shared_args(x, mask, weights, outgoing, eps);
  a.y = view_of(y, "y");
  return a;
}

TrimulBackwardArgs backward_args(const Array& x, const OptArray& mask, const ArrayList& weights,
                                 bool outgoing, double eps, const Array& dy, const Array& dx,
                                 const ArrayList& grads) {
  TrimulBackwardArgs a = backward_args_of(shared_args(x, mask, weights, outgoing, eps));
  a.dy = view_of(dy, "grad_out");
  a.dx = view_of(dx, "dx");
  a.dw = weights_of(grads, "d_");
  return a;
}

}  // namespace

void bind_trimul(nb::module_& m) {
  m.def(
      "trimul_forward",
      [](const Array& x, const OptArray& mask, const ArrayList& weights, bool outgoing, double eps,
         const Array& y, const Array& a, const Array& b, const Array& z, const Array& go,
         const std::optional<nb::callable>& workspace, uintptr_t stream) {
        TrimulForwardArgs args = forward_args(x, mask, weights, outgoing, eps, y);
        args.saved = saved_of(a, b, z, go);
        std::vector<Array> keep;
        args.workspace = allocator_of(workspace, keep);
        nb::gil_scoped_release release;
        trimul_forward(args, stream_ptr(stream));
      },
      nb::arg("x"), nb::arg("mask").none(), nb::arg("weights"), nb::arg("outgoing"), nb::arg("eps"),
      nb::arg("y"), nb::arg("a"), nb::arg("b"), nb::arg("z"), nb::arg("go"),
      nb::arg("workspace").none() = nb::none(), nb::arg("stream") = 0);

  m.def(
      "trimul_backward",
      [](const Array& x, const OptArray& mask, const ArrayList& weights, bool outgoing, double eps,
         const Array& a, const Array& b, const Array& z, const Array& go, const Array& dy,
         const Array& dx, const ArrayList& grads, const std::optional<nb::callable>& workspace,
         uintptr_t stream) {
        TrimulBackwardArgs args = backward_args(x, mask, weights, outgoing, eps, dy, dx, grads);
        args.saved = saved_of(a, b, z, go);
        std::vector<Array> keep;
        args.workspace = allocator_of(workspace, keep);
        nb::gil_scoped_release release;
        trimul_backward(args, stream_ptr(stream));
      },
      nb::arg("x"), nb::arg("mask").none(), nb::arg("weights"), nb::arg("outgoing"), nb::arg("eps"),
      nb::arg("a"), nb::arg("b"), nb::arg("z"), nb::arg("go"), nb::arg("grad_out"), nb::arg("dx"),
      nb::arg("grads"), nb::arg("workspace").none() = nb::none(), nb::arg("stream") = 0);

  m.def(
      "trimul_forward_reference",
      [](const Array& x, const OptArray& mask, const ArrayList& weights, bool outgoing, double eps,
         const Array& y) {
        TrimulForwardArgs args = forward_args(x, mask, weights, outgoing, eps, y);
        nb::gil_scoped_release release;
        reference::trimul_forward_f64(args);
      },
      nb::arg("x"), nb::arg("mask").none(), nb::arg("weights"), nb::arg("outgoing"), nb::arg("eps"),
      nb::arg("y"));

  m.def(
      "trimul_backward_reference",
      [](const Array& x, const OptArray& mask, const ArrayList& weights, bool outgoing, double eps,
         const Array& dy, const Array& dx, const ArrayList& grads) {
        TrimulBackwardArgs args = backward_args(x, mask, weights, outgoing, eps, dy, dx, grads);
        nb::gil_scoped_release release;
        reference::trimul_backward_f64(args);
      },
      nb::arg("x"), nb::arg("mask").none(), nb::arg("weights"), nb::arg("outgoing"), nb::arg("eps"),
      nb::arg("grad_out"), nb::arg("dx"), nb::arg("grads"));
}

}  // namespace tpf::py
