// FoldPipe entry points: the sampler's orders as numpy arrays, and shard sets streamed through a
// prefetcher whose records come back as dicts of numpy arrays (copies: the prefetched bytes are
// released as the stream moves on).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "store_records.h"
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

// Keeps `bytes` alive for as long as numpy arrays view them.
nb::object keep_alive(std::shared_ptr<const std::byte[]> bytes) {
  auto* held = new std::shared_ptr<const std::byte[]>(std::move(bytes));
  return nb::capsule(
      held, [](void* p) noexcept { delete static_cast<std::shared_ptr<const std::byte[]>*>(p); });
}

// A prefetcher and the shard set it reads, kept alive together.
struct Stream {
  std::shared_ptr<const ShardSet> shards;
  std::unique_ptr<Prefetcher> prefetcher;
  std::vector<std::vector<nb::object>> keys;  // per shard: its interned keys, by key id

  nb::object next() {
    RecordView view;
    bool more;
    {
      nb::gil_scoped_release release;
      more = prefetcher->next(view);
    }
    if (!more) throw nb::stop_iteration();
    const uint32_t shard = shards->locate(view.record).first;
    const std::string& name = shards->shard_name(shard);
    // Arrays must not view the prefetch buffer, which is reused as the stream moves on: decode a
    // copy, which an uncompressed record's arrays then view (a compressed one decodes into a
    // buffer of its own and the copy goes).
    std::shared_ptr<std::byte[]> copy(new std::byte[std::max<uint64_t>(view.length, 1)]);
    std::memcpy(copy.get(), view.data, view.length);
    RecordView copied = view;
    copied.data = reinterpret_cast<const uint8_t*>(copy.get());
    const store::Record rec = shards->decode(copied);
    if (keys.size() <= shard) keys.resize(size_t(shard) + 1);
    if (rec.owns_data())
      return record_to_dict(rec, keep_alive(rec.owned()), name, view.record, keys[shard]);
    return record_to_dict(rec, keep_alive(std::move(copy)), name, view.record, keys[shard]);
  }

  nb::dict stats() const {
    const PrefetchStats s = prefetcher->stats();
    nb::dict d;
    d["requests"] = s.requests;
    d["bytes_fetched"] = s.bytes_fetched;
    d["refetches"] = s.refetches;
    d["peak_reserved"] = s.peak_reserved;
    d["consumer_waits"] = s.consumer_waits;
    d["consumer_wait_s"] = double(s.consumer_wait_ns) * 1e-9;
    d["ranges"] = s.ranges;
    d["request_s"] = double(s.request_ns) * 1e-9;
    d["inflight"] = s.inflight;
    d["peak_inflight"] = s.peak_inflight;
    d["reserved"] = prefetcher->reserved_bytes();
    return d;
  }
};

struct Shards {
  std::shared_ptr<const ShardSet> set;
  std::shared_ptr<DiskCache> disk_cache;
};

SourceOptions source_options(int max_connections, int http_threads, double connect_timeout_s,
                             double request_timeout_s, double stall_timeout_s, int max_attempts,
                             double backoff_base_s, double backoff_max_s, double retry_deadline_s) {
  SourceOptions o;
  o.max_connections = max_connections;
  o.http_threads = http_threads;
  o.connect_timeout_s = connect_timeout_s;
  o.request_timeout_s = request_timeout_s;
  o.stall_timeout_s = stall_timeout_s;
  o.max_attempts = max_attempts;
  o.backoff_base_s = backoff_base_s;
  o.backoff_max_s = backoff_max_s;
  o.retry_deadline_s = retry_deadline_s;
  return o;
}

#define TPF_SOURCE_OPTION_ARGS                                              \
  nb::arg("max_connections") = 16, nb::arg("http_threads") = 0,             \
  nb::arg("connect_timeout_s") = 10.0, nb::arg("request_timeout_s") = 60.0, \
  nb::arg("stall_timeout_s") = 15.0, nb::arg("max_attempts") = 8,           \
  nb::arg("backoff_base_s") = 0.05, nb::arg("backoff_max_s") = 2.0,         \
  nb::arg("retry_deadline_s") = 120.0

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

  m.def("stream_http_stats", [] {
    const HttpStats h = http_stats();
    nb::dict d;
    d["attempts"] = h.attempts;
    d["slot_wait_s"] = double(h.slot_wait_ns) * 1e-9;
    d["first_byte_s"] = double(h.first_byte_ns) * 1e-9;
    d["attempt_s"] = double(h.attempt_ns) * 1e-9;
    return d;
  });
  m.def(
      "stream_read_all",
      [](const std::string& location, int max_connections, int http_threads,
         double connect_timeout_s, double request_timeout_s, double stall_timeout_s,
         int max_attempts, double backoff_base_s, double backoff_max_s, double retry_deadline_s) {
        const SourceOptions o = source_options(max_connections, http_threads, connect_timeout_s,
                                               request_timeout_s, stall_timeout_s, max_attempts,
                                               backoff_base_s, backoff_max_s, retry_deadline_s);
        std::string bytes;
        {
          nb::gil_scoped_release release;
          auto source = open_source(location, o);
          bytes.resize(source->size());
          source->read(0, bytes.size(), bytes.data());
        }
        return nb::bytes(bytes.data(), bytes.size());
      },
      nb::arg("location"), TPF_SOURCE_OPTION_ARGS);

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
             const std::string& disk_cache_dir, uint64_t disk_cache_bytes, int max_connections,
             int http_threads, double connect_timeout_s, double request_timeout_s,
             double stall_timeout_s, int max_attempts, double backoff_base_s, double backoff_max_s,
             double retry_deadline_s) {
            TPF_CHECK(records.empty() || records.size() == locations.size(),
                      "records: expected one count per shard (" + std::to_string(locations.size()) +
                          "), got " + std::to_string(records.size()));
            TPF_CHECK(bytes.empty() || bytes.size() == locations.size(),
                      "bytes: expected one size per shard (" + std::to_string(locations.size()) +
                          "), got " + std::to_string(bytes.size()));
            std::vector<ShardSpec> specs;
            for (size_t i = 0; i < locations.size(); ++i)
              specs.push_back(
                  {locations[i], records.empty() ? 0 : records[i], bytes.empty() ? 0 : bytes[i]});
            const SourceOptions o = source_options(max_connections, http_threads, connect_timeout_s,
                                                   request_timeout_s, stall_timeout_s, max_attempts,
                                                   backoff_base_s, backoff_max_s, retry_deadline_s);
            std::shared_ptr<DiskCache> cache;
            if (!disk_cache_dir.empty())
              cache = DiskCache::create(disk_cache_dir, disk_cache_bytes);
            std::shared_ptr<const ShardSet> set;
            {
              nb::gil_scoped_release release;
              set = ShardSet::open(specs, o, cache);
            }
            new (self) Shards{std::move(set), std::move(cache)};
          },
          nb::arg("locations"), nb::arg("records") = std::vector<uint64_t>(),
          nb::arg("bytes") = std::vector<uint64_t>(), nb::arg("disk_cache_dir") = "",
          nb::arg("disk_cache_bytes") = 0, TPF_SOURCE_OPTION_ARGS)
      .def_prop_ro("disk_cache_stats",
                   [](const Shards& s) {
                     nb::dict d;
                     if (s.disk_cache) {
                       d["used_bytes"] = s.disk_cache->used_bytes();
                       d["budget"] = s.disk_cache->budget();
                       d["hit_bytes"] = s.disk_cache->hit_bytes();
                       d["miss_bytes"] = s.disk_cache->miss_bytes();
                     }
                     return d;
                   })
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
          nb::arg("plan"), nb::arg("memory_budget"), nb::arg("max_inflight") = 256,
          nb::arg("coalesce_gap") = 4 << 10, nb::arg("max_request_bytes") = 8 << 20,
          nb::arg("group_records") = 0, nb::arg("verify") = true, nb::rv_policy::take_ownership);
}

}  // namespace tpf::py
