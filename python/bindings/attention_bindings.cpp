// Triangle attention entry points. Outputs are allocated by the caller (the torch layer) and
// passed in, the kernels' scratch through the allocator `workspace`; `stream` is the caller's
// cudaStream_t as an integer (0 on the CPU).
#include "arrays.h"
#include "tpf/attention.h"

namespace tpf::py {

namespace {

AttentionForwardArgs forward_args(const Array& q, const Array& k, const Array& v, const Array& bias,
                                  const OptArray& mask, const Array& o, const Array& lse,
                                  const OptArray& residual, double scale) {
  AttentionForwardArgs a;
  a.q = view_of(q, "q");
  a.k = view_of(k, "k");
  a.v = view_of(v, "v");
  a.bias = view_of(bias, "bias");
  a.mask = optional_view_of(mask, "mask");
  a.o = view_of(o, "o");
  a.lse = view_of(lse, "lse");
  a.residual = optional_view_of(residual, "residual");
  a.scale = scale;
  return a;
}

AttentionBackwardArgs backward_args(const Array& q, const Array& k, const Array& v,
                                    const Array& bias, const OptArray& mask, const Array& o,
                                    const Array& lse, const Array& dout, const OptArray& residual,
                                    const Array& dq, const Array& dk, const Array& dv,
                                    const Array& dbias, double scale) {
  AttentionBackwardArgs a =
      backward_args_of(forward_args(q, k, v, bias, mask, o, lse, residual, scale));
  a.dout = view_of(dout, "grad_out");
  a.dq = view_of(dq, "dq");
  a.dk = view_of(dk, "dk");
  a.dv = view_of(dv, "dv");
  a.dbias = view_of(dbias, "dbias");
  return a;
}

}  // namespace

void bind_attention(nb::module_& m) {
  m.def(
      "attention_forward",
      [](const Array& q, const Array& k, const Array& v, const Array& bias, const OptArray& mask,
         const Array& o, const Array& lse, const OptArray& residual, double scale,
         const std::optional<nb::callable>& workspace, uintptr_t stream) {
        AttentionForwardArgs a = forward_args(q, k, v, bias, mask, o, lse, residual, scale);
        std::vector<Array> keep;
        a.workspace = allocator_of(workspace, keep);
        nb::gil_scoped_release release;
        attention_forward(a, stream_ptr(stream));
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("bias"), nb::arg("mask").none(),
      nb::arg("o"), nb::arg("lse"), nb::arg("residual").none(), nb::arg("scale"),
      nb::arg("workspace").none() = nb::none(), nb::arg("stream") = 0);

  m.def(
      "attention_backward",
      [](const Array& q, const Array& k, const Array& v, const Array& bias, const OptArray& mask,
         const Array& o, const Array& lse, const Array& dout, const OptArray& residual,
         const Array& dq, const Array& dk, const Array& dv, const Array& dbias, double scale,
         const std::optional<nb::callable>& workspace, uintptr_t stream) {
        AttentionBackwardArgs a =
            backward_args(q, k, v, bias, mask, o, lse, dout, residual, dq, dk, dv, dbias, scale);
        std::vector<Array> keep;
        a.workspace = allocator_of(workspace, keep);
        nb::gil_scoped_release release;
        attention_backward(a, stream_ptr(stream));
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("bias"), nb::arg("mask").none(),
      nb::arg("o"), nb::arg("lse"), nb::arg("grad_out"), nb::arg("residual").none(), nb::arg("dq"),
      nb::arg("dk"), nb::arg("dv"), nb::arg("dbias"), nb::arg("scale"),
      nb::arg("workspace").none() = nb::none(), nb::arg("stream") = 0);

  m.def(
      "attention_check_inputs",
      [](const Array& q, const Array& k, const Array& v, const Array& bias, const OptArray& mask,
         double scale) {
        check_attention_inputs(view_of(q, "q"), view_of(k, "k"), view_of(v, "v"),
                               view_of(bias, "bias"), optional_view_of(mask, "mask"), scale);
      },
      "attention_forward's validation of its inputs alone (for the torch layer's own paths).",
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("bias"), nb::arg("mask").none(),
      nb::arg("scale"));

  m.def(
      "attention_forward_reference",
      [](const Array& q, const Array& k, const Array& v, const Array& bias, const OptArray& mask,
         const Array& o, const Array& lse, double scale) {
        AttentionForwardArgs a = forward_args(q, k, v, bias, mask, o, lse, std::nullopt, scale);
        nb::gil_scoped_release release;
        reference::attention_forward_f64(a);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("bias"), nb::arg("mask").none(),
      nb::arg("o"), nb::arg("lse"), nb::arg("scale"));

  m.def(
      "attention_backward_reference",
      [](const Array& q, const Array& k, const Array& v, const Array& bias, const OptArray& mask,
         const Array& o, const Array& lse, const Array& dout, const Array& dq, const Array& dk,
         const Array& dv, const Array& dbias, double scale) {
        AttentionBackwardArgs a = backward_args(q, k, v, bias, mask, o, lse, dout, std::nullopt, dq,
                                                dk, dv, dbias, scale);
        nb::gil_scoped_release release;
        reference::attention_backward_f64(a);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("bias"), nb::arg("mask").none(),
      nb::arg("o"), nb::arg("lse"), nb::arg("grad_out"), nb::arg("dq"), nb::arg("dk"),
      nb::arg("dv"), nb::arg("dbias"), nb::arg("scale"));
}

}  // namespace tpf::py
