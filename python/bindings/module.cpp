// tpfkit._C: the library's entry points over DLPack arrays. No libtorch here.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cerrno>

#include "tpf/attention.h"
#include "tpf/cuda_info.h"
#include "tpf/error.h"
#include "tpf/parallel.h"

namespace nb = nanobind;

namespace tpf::py {
void bind_attention(nb::module_& m);
void bind_trimul(nb::module_& m);
void bind_glue(nb::module_& m);
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
    } catch (const tpf::FileNotFoundError& e) {
      PyObject* err = PyObject_CallFunction(PyExc_FileNotFoundError, "iss", ENOENT,
                                            e.reason().c_str(), e.path().c_str());
      if (err) {
        PyErr_SetObject(PyExc_FileNotFoundError, err);
        Py_DECREF(err);
      }
    } catch (const tpf::RuntimeError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  m.def("cuda_available", &tpf::cuda_available);
  // Build and runtime facts of the CUDA kernels (tpf/cuda_info.h) as a dict, for `tpf doctor`.
  m.def("cuda_info", [] {
    const tpf::CudaInfo i = tpf::cuda_info();
    nb::dict d;
    d["built"] = i.built;
    d["arch"] = i.arch;
    d["cuda_compiled"] = i.cuda_compiled;
    d["cuda_runtime"] = i.cuda_runtime;
    d["cuda_driver"] = i.cuda_driver;
    d["cublas_compiled"] = i.cublas_compiled;
    d["cublas_runtime"] = i.cublas_runtime;
    d["cutlass"] = i.cutlass;
    nb::list devices;
    for (const tpf::CudaDevice& dev : i.devices) {
      nb::dict e;
      e["name"] = dev.name;
      e["capability"] = nb::make_tuple(dev.major, dev.minor);
      devices.append(e);
    }
    d["devices"] = devices;
    d["error"] = i.error;
    return d;
  });
  m.def("num_threads", &tpf::num_threads);
  tpf::py::bind_attention(m);
  tpf::py::bind_trimul(m);
  tpf::py::bind_glue(m);
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
