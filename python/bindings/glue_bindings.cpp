// The fused glue ops (tpf/glue.h): LayerNorm, SwiGLU and the attention's output gate. Outputs come
// from the caller, scratch through its allocator `workspace`; `stream` is its cudaStream_t as an
// integer (0 on the CPU).
#include <nanobind/nanobind.h>

#include "arrays.h"
#include "tpf/error.h"
#include "tpf/glue.h"

namespace tpf::py {

void bind_glue(nb::module_& m) {
  m.def(
      "layer_norm_forward",
      [](const Array& x, const Array& weight, const Array& bias, double eps, const Array& y,
         const Array& mean, const Array& rstd, uintptr_t stream) {
        LayerNormForwardArgs a;
        a.x = view_of(x, "x");
        a.weight = view_of(weight, "weight");
        a.bias = view_of(bias, "bias");
        a.eps = eps;
        a.y = view_of(y, "y");
        a.mean = view_of(mean, "mean");
        a.rstd = view_of(rstd, "rstd");
        nb::gil_scoped_release release;
        layer_norm_forward(a, stream_ptr(stream));
      },
      nb::arg("x"), nb::arg("weight"), nb::arg("bias"), nb::arg("eps"), nb::arg("y"),
      nb::arg("mean"), nb::arg("rstd"), nb::arg("stream") = 0);
  m.def(
      "layer_norm_backward",
      [](const Array& dy, const Array& x, const Array& weight, const Array& mean, const Array& rstd,
         const Array& dx, const Array& dweight, const Array& dbias,
         const std::optional<nb::callable>& workspace, uintptr_t stream) {
        LayerNormBackwardArgs a;
        a.dy = view_of(dy, "grad_y");
        a.x = view_of(x, "x");
        a.weight = view_of(weight, "weight");
        a.mean = view_of(mean, "mean");
        a.rstd = view_of(rstd, "rstd");
        a.dx = view_of(dx, "dx");
        a.dweight = view_of(dweight, "dweight");
        a.dbias = view_of(dbias, "dbias");
        std::vector<Array> keep;
        a.workspace = allocator_of(workspace, keep);
        nb::gil_scoped_release release;
        layer_norm_backward(a, stream_ptr(stream));
      },
      nb::arg("grad_y"), nb::arg("x"), nb::arg("weight"), nb::arg("mean"), nb::arg("rstd"),
      nb::arg("dx"), nb::arg("dweight"), nb::arg("dbias"), nb::arg("workspace").none() = nb::none(),
      nb::arg("stream") = 0);
  m.def(
      "swiglu",
      [](const Array& ab, const OptArray& grad_h, const Array& out, uintptr_t stream) {
        SwigluArgs a;
        a.ab = view_of(ab, "ab");
        if (grad_h) {
          a.dh = view_of(*grad_h, "grad_h");
          a.dab = view_of(out, "dab");
        } else {
          a.h = view_of(out, "h");
        }
        nb::gil_scoped_release release;
        if (grad_h)
          swiglu_backward(a, stream_ptr(stream));
        else
          swiglu_forward(a, stream_ptr(stream));
      },
      "Forward (grad_h None): out = h [M, H]; backward: out = d(ab) [M, 2H].", nb::arg("ab"),
      nb::arg("grad_h").none(), nb::arg("out"), nb::arg("stream") = 0);
  m.def(
      "gated_output",
      [](const Array& g, const Array& o, const OptArray& grad_y, const Array& out,
         const OptArray& grad_o, uintptr_t stream) {
        GatedOutputArgs a;
        a.g = view_of(g, "g");
        a.o = view_of(o, "o");
        const bool backward = grad_y.has_value();
        if (backward) {
          TPF_CHECK(grad_o.has_value(), "grad_o is required with grad_y (the backward)");
          a.dy = view_of(*grad_y, "grad_y");
          a.dg = view_of(out, "dg");
          a.do_ = view_of(*grad_o, "grad_o");
        } else {
          a.y = view_of(out, "y");
        }
        nb::gil_scoped_release release;
        if (backward)
          gated_output_backward(a, stream_ptr(stream));
        else
          gated_output_forward(a, stream_ptr(stream));
      },
      "Forward (grad_y None): out = y [R, H*D]; backward: out = dg [R, H*D], grad_o = do.",
      nb::arg("g"), nb::arg("o"), nb::arg("grad_y").none(), nb::arg("out"),
      nb::arg("grad_o").none() = nb::none(), nb::arg("stream") = 0);
}

}  // namespace tpf::py
