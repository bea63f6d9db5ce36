// turbopairformer._C: the library's entry points over DLPack arrays. No libtorch here.
#include <nanobind/nanobind.h>

#include "tpf/attention.h"
#include "tpf/error.h"
#include "tpf/parallel.h"

namespace nb = nanobind;

namespace tpf::py {
void bind_attention(nb::module_& m);
void bind_trimul(nb::module_& m);
void bind_fused(nb::module_& m);
#ifdef TPF_WITH_DATA
void bind_store(nb::module_& m);
void bind_stream(nb::module_& m);
#endif
}  // namespace tpf::py

NB_MODULE(_C, m) {
  m.doc() = "TurboPairFormer core: kernels, CPU path and FP64 references over DLPack arrays";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const tpf::RuntimeError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  m.def("cuda_available", &tpf::cuda_available);
  m.def("num_threads", &tpf::num_threads);
  tpf::py::bind_attention(m);
  tpf::py::bind_trimul(m);
  tpf::py::bind_fused(m);
#ifdef TPF_WITH_DATA
  tpf::py::bind_store(m);
  tpf::py::bind_stream(m);
#endif
  m.attr("with_data") = nb::bool_(
#ifdef TPF_WITH_DATA
      true
#else
      false
#endif
  );
}
