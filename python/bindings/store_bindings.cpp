// The record store for Python: StoreWriter and StoreReader over numpy arrays.
// Records are dicts {key: ndarray}. The read path builds numpy arrays with numpy's C API directly:
// one array per field, zero-copy into the mapping (or into the record's decompressed buffer), with a
// capsule owning that memory as the array's base, so views outlive neither the mapping nor the
// buffer. Arrays handed out are read-only (the mapping is).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "store_records.h"
#include "tpf/error.h"
#include "tpf/parallel.h"
#include "tpf/store.h"

namespace nb = nanobind;

namespace tpf::py {
namespace {

using store::DType;

// ---- dtype mapping -------------------------------------------------------------------------

int numpy_type(DType d) {
  switch (d) {
    case DType::boolean: return NPY_BOOL;
    case DType::u8: return NPY_UINT8;
    case DType::i8: return NPY_INT8;
    case DType::u16: return NPY_UINT16;
    case DType::i16: return NPY_INT16;
    case DType::u32: return NPY_UINT32;
    case DType::i32: return NPY_INT32;
    case DType::u64: return NPY_UINT64;
    case DType::i64: return NPY_INT64;
    case DType::f16: return NPY_FLOAT16;
    case DType::f32: return NPY_FLOAT32;
    case DType::f64: return NPY_FLOAT64;
    case DType::bytes: return NPY_STRING;
    case DType::utf8: return NPY_UNICODE;
  }
  return NPY_NOTYPE;
}

// The store dtype of a numpy array, or throws naming the key.
DType store_dtype(PyArrayObject* a, const std::string& key) {
  const int t = PyArray_TYPE(a);
  const int size = int(PyArray_ITEMSIZE(a));
  if (t == NPY_BOOL) return DType::boolean;
  if (t == NPY_HALF) return DType::f16;
  if (t == NPY_FLOAT) return DType::f32;
  if (t == NPY_DOUBLE) return DType::f64;
  if (t == NPY_STRING) return DType::bytes;
  if (PyTypeNum_ISINTEGER(t)) {
    const bool is_signed = PyTypeNum_ISSIGNED(t);
    switch (size) {
      case 1: return is_signed ? DType::i8 : DType::u8;
      case 2: return is_signed ? DType::i16 : DType::u16;
      case 4: return is_signed ? DType::i32 : DType::u32;
      case 8: return is_signed ? DType::i64 : DType::u64;
      default: break;
    }
  }
  const std::string got = nb::cast<std::string>(nb::str(nb::handle((PyObject*)PyArray_DESCR(a))));
  throw Error("record field '" + key + "' has dtype " + got +
              "; expected bool, an integer, float16/32/64, bytes or str");
}

// ---- write path: Python values to ArrayRefs -----------------------------------------------------

// Holds what an ArrayRef points into: the contiguous numpy array, or UTF-8 bytes encoded here.
struct Held {
  nb::object array;
  std::vector<char> text;
};

// Encodes a numpy "U" array as fixed-width UTF-8 (width = the longest element, at least 1).
void encode_utf8(PyArrayObject* a, const std::string& key, Held& held, uint32_t& width) {
  const npy_intp n = PyArray_SIZE(a);
  const size_t chars = size_t(PyArray_ITEMSIZE(a)) / 4;
  const auto* src = static_cast<const Py_UCS4*>(PyArray_DATA(a));
  std::vector<nb::object> encoded(static_cast<size_t>(n));
  size_t w = 1;
  for (npy_intp i = 0; i < n; ++i) {
    const Py_UCS4* s = src + size_t(i) * chars;
    size_t len = chars;
    while (len > 0 && s[len - 1] == 0) --len;
    nb::object u = nb::steal(PyUnicode_FromKindAndData(PyUnicode_4BYTE_KIND, s, Py_ssize_t(len)));
    if (!u) throw nb::python_error();
    encoded[size_t(i)] = nb::steal(PyUnicode_AsUTF8String(u.ptr()));
    if (!encoded[size_t(i)])
      throw Error("record field '" + key + "' holds text that is not valid Unicode");
    w = std::max(w, size_t(PyBytes_GET_SIZE(encoded[size_t(i)].ptr())));
  }
  held.text.assign(size_t(n) * w, '\0');
  for (npy_intp i = 0; i < n; ++i) {
    PyObject* b = encoded[size_t(i)].ptr();
    std::memcpy(held.text.data() + size_t(i) * w, PyBytes_AS_STRING(b),
                size_t(PyBytes_GET_SIZE(b)));
  }
  width = uint32_t(w);
}

// Converts one value to a contiguous native-order array and describes it. With `batch`, the first
// axis is the record axis and is left out of the shape.
store::ArrayRef array_ref(const std::string& key, PyObject* value, Held& held, bool batch,
                          npy_intp count) {
  PyObject* arr =
      PyArray_FromAny(value, nullptr, 0, 0,
                      NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_NOTSWAPPED, nullptr);
  if (!arr) {
    PyErr_Clear();
    throw Error("record field '" + key + "' cannot be converted to a numpy array");
  }
  held.array = nb::steal(arr);
  auto* a = reinterpret_cast<PyArrayObject*>(arr);
  const int ndim = PyArray_NDIM(a) - (batch ? 1 : 0);
  if (batch && (PyArray_NDIM(a) == 0 || PyArray_DIM(a, 0) != count))
    throw Error("batch column '" + key + "' must have a leading axis of " + std::to_string(count) +
                " records");
  if (ndim > store::kMaxFieldDims)
    throw Error("record field '" + key + "' has " + std::to_string(ndim) + " dims, at most 8");
  store::ArrayRef r;
  r.ndim = ndim;
  for (int d = 0; d < ndim; ++d) r.shape[d] = uint64_t(PyArray_DIM(a, d + (batch ? 1 : 0)));
  if (PyArray_TYPE(a) == NPY_UNICODE) {
    encode_utf8(a, key, held, r.itemsize);
    r.dtype = DType::utf8;
    r.data = held.text.data();
  } else {
    r.dtype = store_dtype(a, key);
    r.itemsize = uint32_t(PyArray_ITEMSIZE(a));
    r.data = PyArray_DATA(a);
  }
  return r;
}

std::string key_of(PyObject* k) {
  if (!PyUnicode_Check(k)) throw Error("record keys must be str");
  Py_ssize_t n = 0;
  const char* s = PyUnicode_AsUTF8AndSize(k, &n);
  if (!s) throw nb::python_error();
  return std::string(s, size_t(n));
}

class PyWriter {
 public:
  PyWriter(const std::string& path, const std::string& compression, int level, bool overwrite) {
    store::WriterOptions o;
    o.codec = store::parse_codec(compression);
    o.level = level;
    o.overwrite = overwrite;
    w_ = std::make_unique<store::Writer>(path, o);
  }

  void append(nb::dict record) {
    std::vector<std::string> keys;
    std::vector<Held> held(record.size());
    std::vector<store::ArrayRef> refs;
    keys.reserve(record.size());
    size_t i = 0;
    for (auto [k, v] : record) {
      keys.push_back(key_of(k.ptr()));
      refs.push_back(array_ref(keys.back(), v.ptr(), held[i++], false, 0));
    }
    for (size_t f = 0; f < refs.size(); ++f) refs[f].key = keys[f];
    writer().append(refs);
  }

  // columns: {key: array with a leading axis of `count` records}; every record has the same shapes.
  void append_batch(nb::dict columns, int64_t count) {
    TPF_CHECK(count >= 0, "count must be >= 0, got " + std::to_string(count));
    std::vector<std::string> keys;
    std::vector<Held> held(columns.size());
    std::vector<store::ArrayRef> refs;
    std::vector<size_t> row_bytes;
    size_t i = 0;
    for (auto [k, v] : columns) {
      keys.push_back(key_of(k.ptr()));
      store::ArrayRef r = array_ref(keys.back(), v.ptr(), held[i++], true, npy_intp(count));
      uint64_t n = r.itemsize;
      for (int d = 0; d < r.ndim; ++d) n *= r.shape[d];
      row_bytes.push_back(size_t(n));
      refs.push_back(r);
    }
    for (size_t f = 0; f < refs.size(); ++f) refs[f].key = keys[f];
    std::vector<const char*> base(refs.size());
    for (size_t f = 0; f < refs.size(); ++f) base[f] = static_cast<const char*>(refs[f].data);
    store::Writer& w = writer();
    nb::gil_scoped_release release;
    for (int64_t b = 0; b < count; ++b) {
      for (size_t f = 0; f < refs.size(); ++f) refs[f].data = base[f] + size_t(b) * row_bytes[f];
      w.append(refs);
    }
  }

  void commit() {
    store::Writer& w = writer();
    nb::gil_scoped_release release;
    w.commit();
  }
  void close() { w_.reset(); }
  bool closed() const { return !w_; }
  uint64_t size() { return writer().size(); }
  uint64_t committed() { return writer().committed_size(); }
  uint64_t generation() { return writer().generation(); }

 private:
  store::Writer& writer() {
    TPF_CHECK(w_ != nullptr, "the writer is closed");
    return *w_;
  }
  std::unique_ptr<store::Writer> w_;
};

// ---- read path ----------------------------------------------------------------------------------

template <typename T>
void destroy_capsule(PyObject* cap) {
  delete static_cast<T*>(PyCapsule_GetPointer(cap, "tpf.store.memory"));
}

template <typename T>
nb::object owner_capsule(T value) {
  auto* p = new T(std::move(value));
  PyObject* cap = PyCapsule_New(p, "tpf.store.memory", &destroy_capsule<T>);
  if (!cap) {
    delete p;
    throw nb::python_error();
  }
  return nb::steal(cap);
}

PyArray_Descr* text_descr(char kind, uint64_t width) {
  const std::string spec = std::string(1, kind) + std::to_string(width);
  nb::object s = nb::steal(PyUnicode_FromString(spec.c_str()));
  PyArray_Descr* d = nullptr;
  if (!PyArray_DescrConverter(s.ptr(), &d)) throw nb::python_error();
  return d;
}

// A numpy "U" array (or a str when ndim is 0) from n fixed-width, zero-padded UTF-8 elements.
PyObject* utf8_object(const char* chars, uint64_t width, int ndim, const npy_intp* dims,
                      const std::function<std::string()>& where) {
  uint64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= uint64_t(dims[d]);
  auto decode = [&](uint64_t i) {
    const char* s = chars + i * width;
    PyObject* u = PyUnicode_DecodeUTF8(s, Py_ssize_t(strnlen(s, width)), "strict");
    if (!u) {
      PyErr_Clear();
      throw Error(where() + " holds text that is not valid UTF-8");
    }
    return u;
  };
  if (ndim == 0) return decode(0);
  PyObject* arr = PyArray_NewFromDescr(&PyArray_Type, text_descr('U', width), ndim,
                                       const_cast<npy_intp*>(dims), nullptr, nullptr, 0, nullptr);
  if (!arr) throw nb::python_error();
  nb::object owner = nb::steal(arr);
  auto* out = static_cast<Py_UCS4*>(PyArray_DATA(reinterpret_cast<PyArrayObject*>(arr)));
  std::memset(out, 0, size_t(n * width * 4));
  for (uint64_t i = 0; i < n; ++i) {
    PyObject* u = decode(i);
    PyUnicode_AsUCS4(u, out + i * width, Py_ssize_t(width), 0);
    Py_DECREF(u);
  }
  return owner.release().ptr();
}

// A numpy object for one field: a read-only view on `data` (owned by `base`), a numpy scalar for
// a 0-d numeric field, str / a "U" array for utf8 text.
PyObject* field_object(const store::Field& f, const std::byte* data, PyObject* base,
                       const std::string& source_name, uint64_t record) {
  npy_intp dims[store::kMaxFieldDims];
  for (int d = 0; d < f.ndim; ++d) dims[d] = npy_intp(f.shape[d]);
  if (f.dtype == DType::utf8)
    return utf8_object(reinterpret_cast<const char*>(data), f.itemsize, f.ndim, dims,
                       [&] { return source_name + ": record " + std::to_string(record); });
  PyArray_Descr* descr = f.dtype == DType::bytes ? text_descr('S', f.itemsize)
                                                 : PyArray_DescrFromType(numpy_type(f.dtype));
  if (f.ndim == 0 && f.dtype != DType::bytes) {
    PyObject* s = PyArray_Scalar(const_cast<std::byte*>(data), descr, nullptr);
    Py_DECREF(descr);
    return s;
  }
  PyObject* arr = PyArray_NewFromDescr(&PyArray_Type, descr, f.ndim, dims, nullptr,
                                       const_cast<std::byte*>(data),
                                       NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED, nullptr);
  if (!arr) throw nb::python_error();
  Py_INCREF(base);
  if (PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(arr), base) != 0) {
    Py_DECREF(arr);
    throw nb::python_error();
  }
  return arr;
}

class PyReader {
 public:
  PyReader(const std::string& path, bool verify_checksums) {
    store::ReaderOptions o;
    o.verify_checksums = verify_checksums;
    r_ = store::Reader::open(path, o);
    mapping_ = owner_capsule(r_);
    for (const std::string& k : r_->index().keys()) {
      PyObject* s = PyUnicode_FromStringAndSize(k.data(), Py_ssize_t(k.size()));
      if (!s) throw nb::python_error();
      PyUnicode_InternInPlace(&s);
      keys_.push_back(nb::steal(s));
    }
  }

  uint64_t size() const { return r_->size(); }

  nb::object get(int64_t i) const {
    const uint64_t n = r_->size();
    if (i < 0) i += int64_t(n);
    if (i < 0 || uint64_t(i) >= n)
      throw nb::index_error(
          ("record index out of range for " + std::to_string(n) + " records").c_str());
    const store::Record rec = r_->read(uint64_t(i));
    nb::object owner = rec.owns_data() ? owner_capsule(rec.owned()) : mapping_;
    nb::object d = nb::steal(PyDict_New());
    for (size_t f = 0; f < rec.num_fields(); ++f) {
      const store::Field& field = rec.field(f);
      nb::object v =
          nb::steal(field_object(field, rec.data(f), owner.ptr(), r_->path(), uint64_t(i)));
      if (PyDict_SetItem(d.ptr(), keys_[field.key_id].ptr(), v.ptr()) != 0)
        throw nb::python_error();
    }
    return d;
  }

  // Copies records `indices` into one array per key (store::BatchPlan says how): 0-d fields become
  // [B]; with stack every field becomes [B, *shape]; otherwise fields of 1 or more dims are
  // concatenated along their first axis, with "_len_<key>" (int64 [B]) giving each record's share.
  nb::object read_batch(nb::object indices_obj, bool stack) const {
    nb::object idx_arr = nb::steal(
        PyArray_FromAny(indices_obj.ptr(), PyArray_DescrFromType(NPY_INT64), 1, 1,
                        NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_FORCECAST, nullptr));
    if (!idx_arr) {
      PyErr_Clear();
      throw Error("indices must be a 1-d sequence of integers");
    }
    auto* ia = reinterpret_cast<PyArrayObject*>(idx_arr.ptr());
    const npy_intp B = PyArray_DIM(ia, 0);
    std::vector<uint64_t> idx(static_cast<size_t>(B));
    const auto* raw_idx = static_cast<const int64_t*>(PyArray_DATA(ia));
    const int64_t n = int64_t(r_->size());
    for (npy_intp b = 0; b < B; ++b) {
      int64_t i = raw_idx[b];
      if (i < 0) i += n;
      if (i < 0 || i >= n)
        throw nb::index_error(("indices[" + std::to_string(b) +
                               "] = " + std::to_string(raw_idx[b]) + " is out of range for " +
                               std::to_string(n) + " records")
                                  .c_str());
      idx[size_t(b)] = uint64_t(i);
    }
    if (B == 0) return nb::steal(PyDict_New());
    const store::Index& ix = r_->index();
    std::optional<store::BatchPlan> plan;
    {
      nb::gil_scoped_release release;
      plan.emplace(ix, idx, stack);
    }
    const std::vector<store::BatchOutput>& outputs = plan->outputs();
    const size_t F = outputs.size();

    // Text fields are copied into zeroed width-byte slots (utf8 ones into a scratch buffer that is
    // decoded to "U" afterwards); everything else straight into the numpy arrays returned.
    nb::object out = nb::steal(PyDict_New());
    std::vector<std::byte*> dst(F);
    std::vector<std::vector<std::byte>> scratch(F);
    std::vector<std::vector<npy_intp>> dims(F);
    for (size_t t = 0; t < F; ++t) {
      const store::BatchOutput& o = outputs[t];
      dims[t].assign(o.shape.begin(), o.shape.end());
      if (o.dtype == DType::utf8) {
        scratch[t].assign(size_t(o.nbytes), std::byte{0});
        dst[t] = scratch[t].data();
      } else {
        PyArray_Descr* descr = o.dtype == DType::bytes ? text_descr('S', o.itemsize)
                                                       : PyArray_DescrFromType(numpy_type(o.dtype));
        PyObject* arr = PyArray_NewFromDescr(&PyArray_Type, descr, int(dims[t].size()),
                                             dims[t].data(), nullptr, nullptr, 0, nullptr);
        if (!arr) throw nb::python_error();
        nb::object holder = nb::steal(arr);
        dst[t] = static_cast<std::byte*>(PyArray_DATA(reinterpret_cast<PyArrayObject*>(arr)));
        if (o.dtype == DType::bytes) std::memset(dst[t], 0, size_t(o.nbytes));
        if (PyDict_SetItem(out.ptr(), keys_[o.key_id].ptr(), arr) != 0) throw nb::python_error();
      }
      if (o.concatenated) {
        npy_intp bd[1] = {B};
        PyObject* la = PyArray_SimpleNew(1, bd, NPY_INT64);
        if (!la) throw nb::python_error();
        nb::object holder = nb::steal(la);
        std::memcpy(PyArray_DATA(reinterpret_cast<PyArrayObject*>(la)), o.lengths.data(),
                    size_t(B) * sizeof(int64_t));
        const std::string& key = ix.keys()[o.key_id];
        if (PyDict_SetItemString(out.ptr(), ("_len_" + key).c_str(), la) != 0)
          throw nb::python_error();
      }
    }
    {
      nb::gil_scoped_release release;
      // Chunks of the file-ordered records go to the pool's threads as each takes the next, so a
      // thread that the shared machine delays leaves its part to the others; a batch of one chunk
      // wakes no thread at all. The outputs do not depend on which thread decodes what.
      constexpr int64_t kChunk = 32;
      const std::span<const std::byte> file = r_->bytes();
      const bool verify = r_->verify_checksums();
      const int64_t chunks = (B + kChunk - 1) / kChunk;
      parallel_for(chunks, [&](int64_t c) {
        plan->decode(file, size_t(c * kChunk), size_t(std::min<int64_t>(B, (c + 1) * kChunk)), dst,
                     verify);
      });
    }
    for (size_t t = 0; t < F; ++t) {
      const store::BatchOutput& o = outputs[t];
      if (o.dtype != DType::utf8) continue;
      nb::object text = nb::steal(utf8_object(reinterpret_cast<const char*>(scratch[t].data()),
                                              o.itemsize, int(dims[t].size()), dims[t].data(),
                                              [&] { return r_->path() + ": read_batch"; }));
      if (PyDict_SetItem(out.ptr(), keys_[o.key_id].ptr(), text.ptr()) != 0)
        throw nb::python_error();
    }
    return out;
  }

  std::vector<std::string> keys() const { return r_->index().keys(); }
  uint64_t generation() const { return r_->index().generation(); }
  std::string path() const { return r_->path(); }
  uint64_t file_size() const { return r_->file_size(); }
  bool verify_checksums() const { return r_->verify_checksums(); }

  // Non-empty when the other header slot is damaged, i.e. an older commit is being read.
  std::string header_warning() const {
    const store::Headers& h = r_->headers();
    const store::HeaderSlot& other = h.slot[1 - h.current];
    if (other.valid || other.problem.rfind("never written", 0) == 0) return {};
    return r_->path() + ": header slot " + std::to_string(1 - h.current) + " is " + other.problem +
           "; reading generation " + std::to_string(h.slot[h.current].generation) +
           ", the last intact commit";
  }

 private:
  std::shared_ptr<const store::Reader> r_;
  nb::object mapping_;
  std::vector<nb::object> keys_;
};

}  // namespace

nb::object record_to_dict(const store::Record& rec, nb::object owner,
                          const std::string& source_name, uint64_t record) {
  nb::object d = nb::steal(PyDict_New());
  for (size_t f = 0; f < rec.num_fields(); ++f) {
    nb::object v =
        nb::steal(field_object(rec.field(f), rec.data(f), owner.ptr(), source_name, record));
    if (PyDict_SetItemString(d.ptr(), rec.key(f).c_str(), v.ptr()) != 0) throw nb::python_error();
  }
  return d;
}

nb::object record_to_dict(const store::Record& rec, nb::object owner,
                          const std::string& source_name, uint64_t record,
                          std::vector<nb::object>& keys) {
  nb::object d = nb::steal(PyDict_New());
  for (size_t f = 0; f < rec.num_fields(); ++f) {
    nb::object v =
        nb::steal(field_object(rec.field(f), rec.data(f), owner.ptr(), source_name, record));
    const uint32_t id = rec.field(f).key_id;
    if (keys.size() <= id) keys.resize(size_t(id) + 1);
    if (!keys[id].is_valid()) {
      const std::string& k = rec.key(f);
      PyObject* s = PyUnicode_FromStringAndSize(k.data(), Py_ssize_t(k.size()));
      if (!s) throw nb::python_error();
      PyUnicode_InternInPlace(&s);
      keys[id] = nb::steal(s);
    }
    if (PyDict_SetItem(d.ptr(), keys[id].ptr(), v.ptr()) != 0) throw nb::python_error();
  }
  return d;
}

void bind_store(nb::module_& m) {
  if (_import_array() < 0) throw nb::python_error();

  nb::class_<PyWriter>(m, "StoreWriter")
      .def(nb::init<const std::string&, const std::string&, int, bool>(), nb::arg("path"),
           nb::arg("compression") = "none", nb::arg("level") = 3, nb::arg("overwrite") = false)
      .def("append", &PyWriter::append, nb::arg("record"))
      .def("append_batch", &PyWriter::append_batch, nb::arg("columns"), nb::arg("count"))
      .def("commit", &PyWriter::commit)
      .def("close", &PyWriter::close)
      .def_prop_ro("closed", &PyWriter::closed)
      .def("__len__", &PyWriter::size)
      .def_prop_ro("committed", &PyWriter::committed)
      .def_prop_ro("generation", &PyWriter::generation);

  nb::class_<PyReader>(m, "StoreReader")
      .def(nb::init<const std::string&, bool>(), nb::arg("path"),
           nb::arg("verify_checksums") = true)
      .def("__len__", &PyReader::size)
      .def("__getitem__", &PyReader::get, nb::arg("index"))
      .def("read_batch", &PyReader::read_batch, nb::arg("indices"), nb::arg("stack") = false)
      .def_prop_ro("keys", &PyReader::keys)
      .def_prop_ro("generation", &PyReader::generation)
      .def_prop_ro("path", &PyReader::path)
      .def_prop_ro("file_size", &PyReader::file_size)
      .def_prop_ro("verify_checksums", &PyReader::verify_checksums)
      .def_prop_ro("header_warning", &PyReader::header_warning);

  m.def("store_describe", &store::describe, nb::arg("path"));
}

}  // namespace tpf::py
