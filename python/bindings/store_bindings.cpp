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
#include <numpy/arrayscalars.h>

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
#include "tpf/record.h"
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
DType store_dtype(PyArrayObject* a, std::string_view key) {
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
  throw Error("record field '" + std::string(key) + "' has dtype " + got +
              "; expected bool, an integer, float16/32/64, bytes or str");
}

// ---- write path: Python values to ArrayRefs -----------------------------------------------------

// Encodes a numpy "U" array as fixed-width UTF-8 (width = the longest element, at least 1).
void encode_utf8(PyArrayObject* a, const std::string& key, std::vector<char>& text,
                 uint32_t& width) {
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
  text.assign(size_t(n) * w, '\0');
  for (npy_intp i = 0; i < n; ++i) {
    PyObject* b = encoded[size_t(i)].ptr();
    std::memcpy(text.data() + size_t(i) * w, PyBytes_AS_STRING(b), size_t(PyBytes_GET_SIZE(b)));
  }
  width = uint32_t(w);
}

std::string repr_of(PyObject* o) {
  nb::object r = nb::steal(PyObject_Repr(o));
  if (!r) {
    PyErr_Clear();
    return "?";
  }
  return nb::cast<std::string>(nb::handle(r.ptr()));
}

// One record's (or one batch's) values converted for the writer: the arrays the ArrayRefs point
// into stay referenced here until the append returns.
class Converter {
 public:
  // `batch` > 0: columns with a leading axis of `batch` records.
  Converter(int positions_type, npy_intp batch, size_t fields)
      : positions_type_(positions_type), batch_(batch) {
    refs_.reserve(fields);
    slots_.reserve(fields);
    held_.reserve(fields);
    scalars_.reserve(fields);
  }

  void add(PyObject* key_obj, PyObject* value) {
    if (!PyUnicode_Check(key_obj)) throw Error("record keys must be str, got " + repr_of(key_obj));
    Py_ssize_t len = 0;
    const char* k = PyUnicode_AsUTF8AndSize(key_obj, &len);
    if (!k) throw nb::python_error();
    const std::string_view key(k, size_t(len));  // kept alive by the caller's dict
    const store::KeyRule rule = store::key_rule(key);
    store::ArrayRef r;
    r.key = key;
    // A Python float (numpy's float64 too) is a float64 scalar, without making an array.
    if (batch_ == 0 && PyFloat_Check(value) &&
        (rule == store::KeyRule::any || rule == store::KeyRule::scalar)) {
      keys_.check_shape(key, rule, r.shape, 0);
      scalars_.push_back(PyFloat_AS_DOUBLE(value));
      r.dtype = DType::f64;
      r.itemsize = 8;
      refs_.push_back(r);
      slots_.push_back({int(scalars_.size()) - 1, -1});
      return;
    }
    if (rule == store::KeyRule::identifier && batch_ == 0 && !PyUnicode_Check(value))
      throw store::key_kind_error(key, Py_TYPE(value)->tp_name);
    PyObject* arr =
        PyArray_FromAny(value, nullptr, 0, 0,
                        NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_NOTSWAPPED, nullptr);
    if (!arr) {
      PyErr_Clear();
      throw Error("record field '" + std::string(key) + "' cannot be converted to a numpy array");
    }
    held_.push_back(nb::steal(arr));
    auto* a = reinterpret_cast<PyArrayObject*>(arr);
    const int type = PyArray_TYPE(a);
    if (type == NPY_OBJECT)
      throw Error("record field '" + std::string(key) +
                  "' has no numeric or text dtype (got object)");
    if (rule == store::KeyRule::identifier && batch_ > 0 &&
        (type != NPY_UNICODE || PyArray_NDIM(a) != 1 || PyArray_DIM(a, 0) != batch_))
      throw Error("batch column 'identifier' must be " + std::to_string(batch_) + " str, got " +
                  dtype_text(a) + " " + shape_text_of(a));
    if (!store::key_accepts_kind(key, PyArray_DESCR(a)->kind))
      throw store::key_kind_error(key, dtype_text(a));
    if (key == "positions" && type != positions_type_) a = cast(a, positions_type_);
    if (rule == store::KeyRule::pbc && type != NPY_BOOL) a = cast(a, NPY_BOOL);
    const int lead = batch_ > 0 ? 1 : 0;
    if (batch_ > 0 && (PyArray_NDIM(a) == 0 || PyArray_DIM(a, 0) != batch_))
      throw Error("batch column '" + std::string(key) + "' must have a leading axis of " +
                  std::to_string(batch_) + " records, got shape " + shape_text_of(a));
    const int ndim = PyArray_NDIM(a) - lead;
    if (ndim > store::kMaxFieldDims)
      throw Error("record field '" + std::string(key) + "' has " + std::to_string(ndim) +
                  " dims, at most 8");
    r.ndim = ndim;
    for (int d = 0; d < ndim; ++d) r.shape[d] = uint64_t(PyArray_DIM(a, d + lead));
    keys_.check_shape(key, rule, r.shape, ndim);
    int text = -1;
    if (PyArray_TYPE(a) == NPY_UNICODE) {
      texts_.emplace_back();
      encode_utf8(a, std::string(key), texts_.back(), r.itemsize);
      r.dtype = DType::utf8;
      text = int(texts_.size()) - 1;
    } else {
      r.dtype = store_dtype(a, key);
      r.itemsize = uint32_t(PyArray_ITEMSIZE(a));
      r.data = PyArray_DATA(a);
    }
    refs_.push_back(r);
    slots_.push_back({-1, text});
  }

  // The ArrayRefs of everything added, in order (valid while this Converter lives).
  std::span<const store::ArrayRef> refs() {
    for (size_t f = 0; f < refs_.size(); ++f) {
      if (slots_[f].scalar >= 0) refs_[f].data = &scalars_[size_t(slots_[f].scalar)];
      if (slots_[f].text >= 0) refs_[f].data = texts_[size_t(slots_[f].text)].data();
    }
    return refs_;
  }

 private:
  // Where an ArrayRef's bytes are when not in a numpy array: scalars_ or texts_ (their
  // addresses are taken in refs(), once the vectors stop growing).
  struct Slot {
    int scalar, text;
  };

  static std::string dtype_text(PyArrayObject* a) {
    return nb::cast<std::string>(
        nb::str(nb::handle(reinterpret_cast<PyObject*>(PyArray_DESCR(a)))));
  }
  static std::string shape_text_of(PyArrayObject* a) {
    std::string t = "(";
    for (int d = 0; d < PyArray_NDIM(a); ++d)
      t += std::to_string(PyArray_DIM(a, d)) +
           (PyArray_NDIM(a) == 1 || d + 1 < PyArray_NDIM(a) ? "," : "");
    return t + ")";
  }
  PyArrayObject* cast(PyArrayObject* a, int type) {
    PyObject* c =
        PyArray_FromAny(reinterpret_cast<PyObject*>(a), PyArray_DescrFromType(type), 0, 0,
                        NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_FORCECAST, nullptr);
    if (!c) throw nb::python_error();
    held_.push_back(nb::steal(c));
    return reinterpret_cast<PyArrayObject*>(c);
  }
  int positions_type_;
  npy_intp batch_;
  std::vector<store::ArrayRef> refs_;
  std::vector<nb::object> held_;
  std::vector<std::vector<char>> texts_;
  std::vector<Slot> slots_;
  std::vector<double> scalars_;
  store::KeyChecker keys_;  // FORMAT.md's well-known keys, checked field by field
};

class PyWriter {
 public:
  PyWriter(const std::string& path, const std::string& compression, int level, bool overwrite,
           bool recover, const std::string& positions_dtype) {
    if (positions_dtype != "float32" && positions_dtype != "float64")
      throw Error("positions_dtype must be 'float32' or 'float64', got '" + positions_dtype + "'");
    positions_type_ = positions_dtype == "float32" ? NPY_FLOAT32 : NPY_FLOAT64;
    store::WriterOptions o;
    o.codec = store::parse_codec(compression);
    o.level = level;
    o.overwrite = overwrite;
    o.recover = recover;
    w_ = std::make_unique<store::Writer>(path, o);
  }

  // record: {key: value}, checked against the well-known keys' conventions.
  void append(nb::dict record) {
    Converter c(positions_type_, 0, size_t(PyDict_GET_SIZE(record.ptr())));
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(record.ptr(), &pos, &k, &v)) c.add(k, v);
    writer().append(c.refs());
  }

  // columns: {key: array with a leading axis of `count` records}; every record has the same shapes.
  void append_batch(nb::dict columns, int64_t count) {
    TPF_CHECK(count >= 0, "count must be >= 0, got " + std::to_string(count));
    Converter c(positions_type_, npy_intp(count), size_t(PyDict_GET_SIZE(columns.ptr())));
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(columns.ptr(), &pos, &k, &v)) c.add(k, v);
    const std::span<const store::ArrayRef> added = c.refs();
    std::vector<store::ArrayRef> refs(added.begin(), added.end());
    std::vector<size_t> row_bytes(refs.size());
    std::vector<const char*> base(refs.size());
    for (size_t f = 0; f < refs.size(); ++f) {
      uint64_t n = refs[f].itemsize;
      for (int d = 0; d < refs[f].ndim; ++d) n *= refs[f].shape[d];
      row_bytes[f] = size_t(n);
      base[f] = static_cast<const char*>(refs[f].data);
    }
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
  int positions_type_ = NPY_FLOAT32;
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

// A numpy scalar of type `type` holding the `itemsize` bytes at `data`, made directly (numpy's
// PyArray_Scalar looks the type up and checks it again for every call).
PyObject* numeric_scalar(int type, const std::byte* data) {
  PyTypeObject* cls = nullptr;
  switch (type) {
    case NPY_BOOL: return PyArrayScalar_FromLong(uint8_t(*data) != 0);  // the two singletons
    case NPY_UINT8: cls = &PyUByteArrType_Type; break;
    case NPY_INT8: cls = &PyByteArrType_Type; break;
    case NPY_UINT16: cls = &PyUShortArrType_Type; break;
    case NPY_INT16: cls = &PyShortArrType_Type; break;
    case NPY_UINT32: cls = &PyUIntArrType_Type; break;
    case NPY_INT32: cls = &PyIntArrType_Type; break;
    case NPY_UINT64: cls = &PyULongLongArrType_Type; break;
    case NPY_INT64: cls = &PyLongLongArrType_Type; break;
    case NPY_FLOAT16: cls = &PyHalfArrType_Type; break;
    case NPY_FLOAT32: cls = &PyFloatArrType_Type; break;
    case NPY_FLOAT64: cls = &PyDoubleArrType_Type; break;
    default: throw Error("no numpy scalar for type " + std::to_string(type));
  }
  PyObject* s = cls->tp_alloc(cls, 0);
  if (!s) throw nb::python_error();
  // Every numeric scalar object is PyObject_HEAD followed by its value (see numpy's arrayscalars.h).
  switch (type) {
    case NPY_UINT8:
    case NPY_INT8: std::memcpy(&PyArrayScalar_VAL(s, UByte), data, 1); break;
    case NPY_UINT16:
    case NPY_INT16:
    case NPY_FLOAT16: std::memcpy(&PyArrayScalar_VAL(s, UShort), data, 2); break;
    case NPY_UINT32:
    case NPY_INT32:
    case NPY_FLOAT32: std::memcpy(&PyArrayScalar_VAL(s, UInt), data, 4); break;
    default: std::memcpy(&PyArrayScalar_VAL(s, ULongLong), data, 8); break;
  }
  return s;
}

class PyReader {
 public:
  PyReader(const std::string& path, bool verify_checksums, bool recover) {
    store::ReaderOptions o;
    o.verify_checksums = verify_checksums;
    o.recover = recover;
    recover_ = recover;
    r_ = store::Reader::open(path, o);
    mapping_ = owner_capsule(r_);
    dicts_ = std::make_unique<RecordDicts>(r_->index());
  }

  uint64_t size() const { return r_->size(); }

  // Record i as {key: value}. With `copy`, every array is a new, writable numpy array of its own;
  // without, the arrays of an uncompressed record are read-only views into the mapping (those of
  // a compressed one are its own, also read-only). One call builds the whole record from a
  // per-layout plan made once (dtype objects, dims, keys), and the record's bytes are loaded while
  // the Python objects are made: its lines are requested first and first needed by the checksum.
  nb::object get(int64_t i, bool copy) const {
    const uint64_t n = r_->size();
    if (i < 0) i += int64_t(n);
    if (i < 0 || uint64_t(i) >= n)
      throw nb::index_error(
          ("record index out of range for " + std::to_string(n) + " records").c_str());
    return get_at(uint64_t(i), copy);
  }

  // `indices` (a 1-d sequence of integers, negative ones counting from the end) as record
  // numbers; IndexError names the first one out of range.
  std::vector<uint64_t> indices_of(nb::handle indices) const {
    nb::object arr = nb::steal(
        PyArray_FromAny(indices.ptr(), PyArray_DescrFromType(NPY_INT64), 1, 1,
                        NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_FORCECAST, nullptr));
    if (!arr) {
      PyErr_Clear();
      throw Error("indices must be a 1-d sequence of integers");
    }
    auto* a = reinterpret_cast<PyArrayObject*>(arr.ptr());
    const npy_intp count = PyArray_DIM(a, 0);
    std::vector<uint64_t> out(static_cast<size_t>(count));
    const auto* raw = static_cast<const int64_t*>(PyArray_DATA(a));
    const int64_t n = int64_t(r_->size());
    for (npy_intp b = 0; b < count; ++b) {
      int64_t i = raw[b];
      if (i < 0) i += n;
      if (i < 0 || i >= n)
        throw nb::index_error(("indices[" + std::to_string(b) + "] = " + std::to_string(raw[b]) +
                               " is out of range for " + std::to_string(n) + " records")
                                  .c_str());
      out[size_t(b)] = uint64_t(i);
    }
    return out;
  }

  // Starts loading record i's entry (`entry_only`) or its stored bytes into the CPU's caches, for
  // a read of it soon (records() works ahead of the reads this way).
  void prefetch(uint64_t i, bool entry_only) const {
    const store::Index& ix = r_->index();
    if (entry_only) return ix.prefetch(i);
    const store::RecordEntry e = ix.entry(i);
    const std::byte* p = r_->bytes().data() + e.offset;
    for (uint64_t line = 0; line < e.stored_length; line += 64) __builtin_prefetch(p + line);
  }

  // get() of a record number known to be in range.
  nb::object get_at(uint64_t i, bool copy) const {
    const store::Index& ix = r_->index();
    const store::RecordEntry e = ix.entry(i);
    const std::span<const std::byte> stored = r_->bytes().subspan(e.offset, e.stored_length);
    for (uint64_t line = 0; line < stored.size(); line += 64)
      __builtin_prefetch(stored.data() + line);
    const bool compressed = e.codec != store::Codec::none;
    RecordDicts::Arrays arrays;
    nb::object d =
        dicts_->begin(e.layout_id, copy || compressed ? nullptr : stored.data(), mapping_, arrays);
    // A compressed record decodes into per-thread scratch (kept up to 1 MiB), whose bytes are
    // then copied into the arrays: nothing is allocated or shared per record.
    thread_local std::vector<uint64_t> scratch;
    std::vector<uint64_t> large;
    std::span<std::byte> raw;
    if (compressed) {
      const uint64_t raw_size = ix.layout(e.layout_id).raw_size;
      std::vector<uint64_t>& words = raw_size <= (uint64_t(1) << 20) ? scratch : large;
      if (words.size() < raw_size / 8 + 1) words.resize(raw_size / 8 + 1);
      raw = std::span<std::byte>(reinterpret_cast<std::byte*>(words.data()), raw_size);
    }
    const store::Record rec = store::decode_record_into(ix, i, stored, raw, r_->verify_checksums());
    dicts_->finish(d, arrays, rec, copy, r_->path(), i);
    return d;
  }

  // Copies records `indices` into one array per key (store::BatchPlan says how): 0-d fields become
  // [B]; with stack every field becomes [B, *shape]; otherwise fields of 1 or more dims are
  // concatenated along their first axis, with "_len_<key>" (int64 [B]) giving each record's share.
  nb::object read_batch(nb::object indices_obj, bool stack) const {
    const std::vector<uint64_t> idx = indices_of(indices_obj);
    const npy_intp B = npy_intp(idx.size());
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
        if (PyDict_SetItem(out.ptr(), dicts_->key(o.key_id), arr) != 0) throw nb::python_error();
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
      if (PyDict_SetItem(out.ptr(), dicts_->key(o.key_id), text.ptr()) != 0)
        throw nb::python_error();
    }
    return out;
  }

  std::vector<std::string> keys() const { return r_->index().keys(); }
  uint64_t generation() const { return r_->index().generation(); }
  std::string path() const { return r_->path(); }
  uint64_t file_size() const { return r_->file_size(); }
  bool verify_checksums() const { return r_->verify_checksums(); }
  bool recover() const { return recover_; }

  // Non-empty when an older commit is being read because the newer header slot is damaged
  // (opened with recover).
  std::string header_warning() const {
    const store::Headers& h = r_->headers();
    if (!h.fallback) return {};
    return store::fallback_message(h, r_->path()) + "; reading generation " +
           std::to_string(h.slot[h.current].generation) + " (recover=True)";
  }

 private:
  std::shared_ptr<const store::Reader> r_;
  bool recover_ = false;
  nb::object mapping_;
  std::unique_ptr<RecordDicts> dicts_;
};

// Records of a reader in a given order, one dict per step. The order is known ahead, so while one
// record is handed out the next ones are already loading: each step asks for the entry of the
// record 2 * kAhead steps on and the bytes of the one kAhead steps on (whose entry is by then in
// cache), and a read at random then finds its record in cache instead of waiting on memory.
class PyRecordIter {
 public:
  static constexpr size_t kAhead = 4;

  PyRecordIter(nb::object reader, std::vector<uint64_t> indices, bool copy)
      : reader_obj_(std::move(reader)),
        reader_(&nb::cast<const PyReader&>(reader_obj_)),
        indices_(std::move(indices)),
        copy_(copy) {
    for (size_t k = 0; k < indices_.size() && k < 2 * kAhead; ++k)
      reader_->prefetch(indices_[k], /*entry_only=*/k >= kAhead);
  }

  nb::object next() {
    if (pos_ >= indices_.size()) throw nb::stop_iteration();
    if (pos_ + 2 * kAhead < indices_.size()) reader_->prefetch(indices_[pos_ + 2 * kAhead], true);
    if (pos_ + kAhead < indices_.size()) reader_->prefetch(indices_[pos_ + kAhead], false);
    return reader_->get_at(indices_[pos_++], copy_);
  }
  size_t remaining() const { return indices_.size() - pos_; }

 private:
  nb::object reader_obj_;  // keeps the reader (and its mapping) alive
  const PyReader* reader_;
  std::vector<uint64_t> indices_;
  bool copy_;
  size_t pos_ = 0;
};

}  // namespace

// What making one field's value takes, fixed by its layout.
struct RecordDicts::FieldPlan {
  PyObject* key = nullptr;  // interned, owned by keys_
  nb::object descr;         // the array's dtype (null for utf8)
  int type = NPY_NOTYPE;
  int ndim = 0;
  bool scalar = false;  // a 0-d numeric field: a numpy scalar
  npy_intp dims[store::kMaxFieldDims] = {};
  const store::Field* field = nullptr;
};

RecordDicts::RecordDicts(const store::Index& index) : index_(&index) {
  for (const std::string& k : index.keys()) {
    PyObject* s = PyUnicode_FromStringAndSize(k.data(), Py_ssize_t(k.size()));
    if (!s) throw nb::python_error();
    PyUnicode_InternInPlace(&s);
    keys_.push_back(nb::steal(s));
  }
  plans_.resize(index.layouts().size());
}

RecordDicts::~RecordDicts() = default;

const RecordDicts::LayoutPlan& RecordDicts::plan(uint32_t layout_id) const {
  std::shared_ptr<const LayoutPlan>& slot = plans_.at(layout_id);
  if (slot) return *slot;
  auto p = std::make_shared<LayoutPlan>();
  for (const store::Field& f : index_->layout(layout_id).fields) {
    FieldPlan fp;
    fp.key = keys_[f.key_id].ptr();
    fp.field = &f;
    fp.ndim = f.ndim;
    for (int d = 0; d < f.ndim; ++d) fp.dims[d] = npy_intp(f.shape[d]);
    if (f.dtype != DType::utf8) {
      fp.type = numpy_type(f.dtype);
      fp.descr = nb::steal(reinterpret_cast<PyObject*>(
          f.dtype == DType::bytes ? text_descr('S', f.itemsize) : PyArray_DescrFromType(fp.type)));
      fp.scalar = f.ndim == 0 && f.dtype != DType::bytes;
    }
    p->push_back(std::move(fp));
  }
  slot = std::move(p);
  return *slot;
}

nb::object RecordDicts::begin(uint32_t layout_id, const std::byte* view, nb::handle owner,
                              Arrays& arrays) const {
  const LayoutPlan& fields = plan(layout_id);
  arrays.plan_ = &fields;
  if (fields.size() > 16) {
    arrays.more_.assign(fields.size(), nullptr);
    arrays.at_ = arrays.more_.data();
  }
  arrays.own_ = view == nullptr;
  nb::object d = nb::steal(PyDict_New());
  if (!d) throw nb::python_error();
  for (size_t k = 0; k < fields.size(); ++k) {
    const FieldPlan& fp = fields[k];
    PyObject* v = Py_None;
    if (!fp.scalar && fp.field->dtype != DType::utf8) {
      const std::byte* at = view ? view + fp.field->offset : nullptr;
      Py_INCREF(fp.descr.ptr());
      v = PyArray_NewFromDescr(&PyArray_Type, reinterpret_cast<PyArray_Descr*>(fp.descr.ptr()),
                               fp.ndim, const_cast<npy_intp*>(fp.dims), nullptr,
                               const_cast<std::byte*>(at),
                               at ? NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED : 0, nullptr);
      if (!v) throw nb::python_error();
      arrays.at_[k] = v;
      if (view) {
        Py_INCREF(owner.ptr());
        if (PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(v), owner.ptr()) != 0) {
          Py_DECREF(v);
          throw nb::python_error();
        }
      }
    } else {
      Py_INCREF(v);
    }
    const int rc = PyDict_SetItem(d.ptr(), fp.key, v);
    Py_DECREF(v);
    if (rc != 0) throw nb::python_error();
  }
  return d;
}

void RecordDicts::finish(nb::handle dict, const Arrays& arrays, const store::Record& rec,
                         bool writable, const std::string& source_name, uint64_t record) const {
  const LayoutPlan& fields = *arrays.plan_;
  for (size_t k = 0; k < fields.size(); ++k) {
    const FieldPlan& fp = fields[k];
    const std::byte* data = rec.data(k);
    if (PyObject* a = arrays.at_[k]) {
      auto* arr = reinterpret_cast<PyArrayObject*>(a);
      if (arrays.own_ && fp.field->nbytes)
        std::memcpy(PyArray_DATA(arr), data, size_t(fp.field->nbytes));
      if (arrays.own_ && !writable) PyArray_CLEARFLAGS(arr, NPY_ARRAY_WRITEABLE);
      continue;
    }
    const store::Field& f = *fp.field;
    nb::object v = nb::steal(
        fp.scalar
            ? numeric_scalar(fp.type, data)
            : utf8_object(reinterpret_cast<const char*>(data), f.itemsize, f.ndim, fp.dims,
                          [&] { return source_name + ": record " + std::to_string(record); }));
    if (PyDict_SetItem(dict.ptr(), fp.key, v.ptr()) != 0) throw nb::python_error();
  }
}

nb::object RecordDicts::dict(uint32_t layout_id, const store::Record& rec, nb::handle owner,
                             const std::string& source_name, uint64_t record) const {
  Arrays arrays;
  nb::object d = begin(layout_id, owner.is_valid() ? rec.bytes() : nullptr, owner, arrays);
  finish(d, arrays, rec, /*writable=*/false, source_name, record);
  return d;
}

void bind_store(nb::module_& m) {
  if (_import_array() < 0) throw nb::python_error();

  nb::class_<PyWriter>(m, "StoreWriter")
      .def(nb::init<const std::string&, const std::string&, int, bool, bool, const std::string&>(),
           nb::arg("path"), nb::arg("compression") = "none", nb::arg("level") = 3,
           nb::arg("overwrite") = false, nb::arg("recover") = false,
           nb::arg("positions_dtype") = "float32")
      .def("append", &PyWriter::append, nb::arg("record"))
      .def("append_batch", &PyWriter::append_batch, nb::arg("columns"), nb::arg("count"))
      .def("commit", &PyWriter::commit)
      .def("close", &PyWriter::close)
      .def_prop_ro("closed", &PyWriter::closed)
      .def("__len__", &PyWriter::size)
      .def_prop_ro("committed", &PyWriter::committed)
      .def_prop_ro("generation", &PyWriter::generation);

  nb::class_<PyRecordIter>(m, "StoreRecordIterator")
      .def("__iter__", [](nb::handle self) { return nb::borrow(self); })
      .def("__next__", &PyRecordIter::next)
      .def("__length_hint__", &PyRecordIter::remaining);

  nb::class_<PyReader>(m, "StoreReader")
      .def(nb::init<const std::string&, bool, bool>(), nb::arg("path"),
           nb::arg("verify_checksums") = true, nb::arg("recover") = false)
      .def("__len__", &PyReader::size)
      .def(
          "__getitem__", [](const PyReader& r, int64_t i) { return r.get(i, false); },
          nb::arg("index"))
      .def("read", &PyReader::get, nb::arg("index"), nb::arg("copy") = true)
      .def(
          "records",
          [](nb::object self, nb::object indices, bool copy) {
            const PyReader& r = nb::cast<const PyReader&>(self);
            std::vector<uint64_t> idx;
            if (indices.is_none()) {
              idx.resize(r.size());
              for (uint64_t i = 0; i < idx.size(); ++i) idx[i] = i;
            } else {
              idx = r.indices_of(indices);
            }
            return PyRecordIter(self, std::move(idx), copy);
          },
          nb::arg("indices") = nb::none(), nb::arg("copy") = true)
      .def("read_batch", &PyReader::read_batch, nb::arg("indices"), nb::arg("stack") = false)
      .def_prop_ro("keys", &PyReader::keys)
      .def_prop_ro("generation", &PyReader::generation)
      .def_prop_ro("path", &PyReader::path)
      .def_prop_ro("file_size", &PyReader::file_size)
      .def_prop_ro("verify_checksums", &PyReader::verify_checksums)
      .def_prop_ro("recover", &PyReader::recover)
      .def_prop_ro("header_warning", &PyReader::header_warning);

  m.def("store_describe", &store::describe, nb::arg("path"));
}

}  // namespace tpf::py
