// FoldPipe entry points: the sampler's orders as numpy arrays, and shard sets streamed through a
// prefetcher whose records come back as dicts of numpy arrays (copies: the prefetched bytes are
// released as the stream moves on).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <vector>

#include "tpf/error.h"
#include "tpf/stream.h"

namespace tpf::py {

namespace nb = nanobind;
using namespace tpf::stream;
using U64Array = nb::ndarray<nb::numpy, uint64_t, nb::ndim<1>>;
using U64In = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

namespace {

U64Array to_numpy(std::vector<uint64_t>&& v) {
  auto* owned = new std::vector<uint64_t>(std::move(v));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<uint64_t>*>(p); });
  return U64Array(owned->data(), {owned->size()}, owner);
}

std::vector<uint64_t> from_numpy(const U64In& a) {
  return std::vector<uint64_t>(a.data(), a.data() + a.shape(0));
}

nb::dlpack::dtype numeric_dtype(store::DType d) {
  using code = nb::dlpack::dtype_code;
  auto t = [](code c, int bits) { return nb::dlpack::dtype{uint8_t(c), uint8_t(bits), 1}; };
  switch (d) {
    case store::DType::boolean: return t(code::Bool, 8);
    case store::DType::u8: return t(code::UInt, 8);
    case store::DType::i8: return t(code::Int, 8);
    case store::DType::u16: return t(code::UInt, 16);
    case store::DType::i16: return t(code::Int, 16);
    case store::DType::u32: return t(code::UInt, 32);
    case store::DType::i32: return t(code::Int, 32);
    case store::DType::u64: return t(code::UInt, 64);
    case store::DType::i64: return t(code::Int, 64);
    case store::DType::f16: return t(code::Float, 16);
    case store::DType::f32: return t(code::Float, 32);
    case store::DType::f64: return t(code::Float, 64);
    case store::DType::bytes: break;
  }
  throw Error(std::string("record field dtype ") + store::dtype_name(d) + " has no DLPack form");
}

// One decoded record as {key: numpy array}, every array a copy that owns its memory.
nb::dict record_to_dict(const store::Record& rec) {
  nb::dict out;
  for (size_t i = 0; i < rec.num_fields(); ++i) {
    const store::Field& f = rec.field(i);
    size_t shape[store::kMaxFieldDims];
    for (int d = 0; d < f.ndim; ++d) shape[d] = size_t(f.shape[d]);
    nb::object value;
    if (f.dtype == store::DType::bytes) {
      // Fixed-width byte strings have no DLPack dtype: numpy builds them from the raw bytes.
      nb::module_ np = nb::module_::import_("numpy");
      nb::bytes raw(reinterpret_cast<const char*>(rec.data(i)), size_t(f.nbytes));
      nb::tuple shp = nb::steal<nb::tuple>(PyTuple_New(f.ndim));
      for (int d = 0; d < f.ndim; ++d)
        PyTuple_SET_ITEM(shp.ptr(), d, PyLong_FromUnsignedLongLong(f.shape[d]));
      value = np.attr("frombuffer")(raw, "S" + std::to_string(f.itemsize)).attr("reshape")(shp).attr("copy")();
    } else {
      auto* copy = new uint8_t[std::max<uint64_t>(f.nbytes, 1)];
      std::memcpy(copy, rec.data(i), f.nbytes);
      nb::capsule owner(copy, [](void* p) noexcept { delete[] static_cast<uint8_t*>(p); });
      value = nb::cast(nb::ndarray<nb::numpy>(copy, size_t(f.ndim), shape, owner, nullptr,
                                              numeric_dtype(f.dtype)));
    }
    out[nb::str(rec.key(i).c_str())] = value;
  }
  return out;
}

// A prefetcher and the shard set it reads, kept alive together.
struct Stream {
  std::shared_ptr<const ShardSet> shards;
  std::unique_ptr<Prefetcher> prefetcher;

  nb::object next() {
    RecordView view;
    bool more;
    {
      nb::gil_scoped_release release;
      more = prefetcher->next(view);
    }
    if (!more) throw nb::stop_iteration();
    return record_to_dict(shards->decode(view));
  }

  nb::dict stats() const {
    const PrefetchStats s = prefetcher->stats();
    nb::dict d;
    d["requests"] = s.requests;
    d["bytes_fetched"] = s.bytes_fetched;
    d["refetches"] = s.refetches;
    d["peak_reserved"] = s.peak_reserved;
    d["consumer_waits"] = s.consumer_waits;
    d["reserved"] = prefetcher->reserved_bytes();
    return d;
  }
};

struct Shards {
  std::shared_ptr<const ShardSet> set;
};

}  // namespace

void bind_stream(nb::module_& m) {
  m.def(
      "stream_epoch_order",
      [](uint64_t num_records, uint64_t seed, uint64_t epoch, bool shuffle, uint64_t block_size) {
        SamplerOptions o{num_records, seed, shuffle, block_size};
        std::vector<uint64_t> order;
        {
          nb::gil_scoped_release release;
          order = epoch_order(o, epoch);
        }
        return to_numpy(std::move(order));
      },
      nb::arg("num_records"), nb::arg("seed"), nb::arg("epoch"), nb::arg("shuffle"),
      nb::arg("block_size"));
  m.def(
      "stream_rank_slice",
      [](const U64In& order, uint64_t consumed, uint32_t rank, uint32_t world_size,
         bool drop_last) {
        return to_numpy(rank_slice(from_numpy(order), consumed, rank, world_size, drop_last));
      },
      nb::arg("order"), nb::arg("consumed"), nb::arg("rank"), nb::arg("world_size"),
      nb::arg("drop_last"));
  m.def(
      "stream_worker_slice",
      [](const U64In& rank_list, uint32_t worker, uint32_t num_workers, uint64_t batch_size) {
        return to_numpy(worker_slice(from_numpy(rank_list), worker, num_workers, batch_size));
      },
      nb::arg("rank_list"), nb::arg("worker"), nb::arg("num_workers"), nb::arg("batch_size"));

  nb::class_<Stream>(m, "StreamIterator")
      .def("__iter__", [](nb::handle self) { return self; })
      .def("__next__", &Stream::next)
      .def("__len__", [](const Stream& s) { return s.prefetcher->size(); })
      .def("stats", &Stream::stats);

  nb::class_<Shards>(m, "StreamShards")
      .def(
          "__init__",
          [](Shards* self, const std::vector<std::string>& locations,
             const std::vector<uint64_t>& records, const std::vector<uint64_t>& bytes,
             int max_connections, double connect_timeout_s, double request_timeout_s,
             double stall_timeout_s, int max_attempts, double backoff_base_s,
             double backoff_max_s, double retry_deadline_s) {
            TPF_CHECK(records.empty() || records.size() == locations.size(),
                      "records: expected one count per shard (" +
                          std::to_string(locations.size()) + "), got " +
                          std::to_string(records.size()));
            TPF_CHECK(bytes.empty() || bytes.size() == locations.size(),
                      "bytes: expected one size per shard (" + std::to_string(locations.size()) +
                          "), got " + std::to_string(bytes.size()));
            std::vector<ShardSpec> specs;
            for (size_t i = 0; i < locations.size(); ++i)
              specs.push_back({locations[i], records.empty() ? 0 : records[i],
                               bytes.empty() ? 0 : bytes[i]});
            SourceOptions o;
            o.max_connections = max_connections;
            o.connect_timeout_s = connect_timeout_s;
            o.request_timeout_s = request_timeout_s;
            o.stall_timeout_s = stall_timeout_s;
            o.max_attempts = max_attempts;
            o.backoff_base_s = backoff_base_s;
            o.backoff_max_s = backoff_max_s;
            o.retry_deadline_s = retry_deadline_s;
            std::shared_ptr<const ShardSet> set;
            {
              nb::gil_scoped_release release;
              set = ShardSet::open(specs, o);
            }
            new (self) Shards{std::move(set)};
          },
          nb::arg("locations"), nb::arg("records") = std::vector<uint64_t>(),
          nb::arg("bytes") = std::vector<uint64_t>(), nb::arg("max_connections") = 16,
          nb::arg("connect_timeout_s") = 10.0, nb::arg("request_timeout_s") = 60.0,
          nb::arg("stall_timeout_s") = 15.0, nb::arg("max_attempts") = 8,
          nb::arg("backoff_base_s") = 0.05, nb::arg("backoff_max_s") = 2.0,
          nb::arg("retry_deadline_s") = 120.0)
      .def("__len__", [](const Shards& s) { return s.set->size(); })
      .def_prop_ro("num_shards", [](const Shards& s) { return s.set->num_shards(); })
      .def("shard_name", [](const Shards& s, uint32_t i) { return s.set->shard_name(i); })
      .def(
          "stream",
          [](const Shards& s, const U64In& plan, uint64_t memory_budget, int max_inflight,
             uint64_t coalesce_gap, uint64_t max_request_bytes, uint32_t group_records,
             bool verify) {
            PrefetchOptions o;
            o.memory_budget = memory_budget;
            o.max_inflight = max_inflight;
            o.coalesce_gap = coalesce_gap;
            o.max_request_bytes = max_request_bytes;
            o.group_records = group_records;
            auto stream = std::make_unique<Stream>();
            stream->shards = s.set;
            std::vector<uint64_t> p = from_numpy(plan);
            {
              nb::gil_scoped_release release;
              stream->prefetcher = s.set->stream(std::move(p), o, verify);
            }
            return stream.release();
          },
          nb::arg("plan"), nb::arg("memory_budget"), nb::arg("max_inflight") = 32,
          nb::arg("coalesce_gap") = 64 << 10, nb::arg("max_request_bytes") = 8 << 20,
          nb::arg("group_records") = 64, nb::arg("verify") = true,
          nb::rv_policy::take_ownership);
}

}  // namespace tpf::py
