// FoldPipe for Python: a dataset opened in one call (manifests read, checked and resolved here),
// and one call per epoch that makes a worker's plan and streams it, its records handed out as dicts
// of numpy arrays. Options travel as keyword arguments by their C++ names; their defaults are the
// C++ structs' (include/tpf/stream.h), the only place they are written.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "store_records.h"
#include "tpf/error.h"
#include "tpf/record.h"
#include "tpf/stream.h"

namespace tpf::py {

namespace nb = nanobind;
using namespace tpf::stream;
using U64Array = nb::ndarray<nb::numpy, uint64_t, nb::ndim<1>>;

namespace {

U64Array to_numpy(std::vector<uint64_t>&& v) {
  auto* owned = new std::vector<uint64_t>(std::move(v));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<uint64_t>*>(p); });
  return U64Array(owned->data(), {owned->size()}, owner);
}

// Keeps `bytes` alive for as long as numpy arrays view them.
nb::object keep_alive(std::shared_ptr<const std::byte[]> bytes) {
  auto* held = new std::shared_ptr<const std::byte[]>(std::move(bytes));
  return nb::capsule(
      held, [](void* p) noexcept { delete static_cast<std::shared_ptr<const std::byte[]>*>(p); });
}

// The options each struct takes from Python, by name: f(name, field) for each.
template <class F>
void source_fields(SourceOptions& o, F&& f) {
  f("max_connections", o.max_connections);
  f("http_threads", o.http_threads);
  f("connect_timeout_s", o.connect_timeout_s);
  f("request_timeout_s", o.request_timeout_s);
  f("stall_timeout_s", o.stall_timeout_s);
  f("max_attempts", o.max_attempts);
  f("backoff_base_s", o.backoff_base_s);
  f("backoff_max_s", o.backoff_max_s);
  f("retry_deadline_s", o.retry_deadline_s);
  f("full_body_max_bytes", o.full_body_max_bytes);
}

template <class F>
void prefetch_fields(PrefetchOptions& o, F&& f) {
  f("memory_budget", o.memory_budget);
  f("max_inflight", o.max_inflight);
  f("coalesce_gap", o.coalesce_gap);
  f("max_request_bytes", o.max_request_bytes);
  f("group_records", o.group_records);
  f("verify_attempts", o.verify_attempts);
  f("verify_backoff_base_s", o.verify_backoff_base_s);
  f("verify_backoff_max_s", o.verify_backoff_max_s);
}

template <class F>
void plan_fields(PlanOptions& o, F&& f) {
  f("seed", o.seed);
  f("epoch", o.epoch);
  f("shuffle", o.shuffle);
  f("block_size", o.block_size);
  f("rank", o.rank);
  f("world_size", o.world_size);
  f("worker", o.worker);
  f("num_workers", o.num_workers);
  f("batch_size", o.batch_size);
  f("consumed", o.consumed);
  f("drop_last", o.drop_last);
}

// Sets the fields `kwargs` names; throws tpf::Error naming an option that is unknown or of the
// wrong type.
struct Options {
  SourceOptions source;
  PrefetchOptions prefetch;
};

Options options_from(const nb::kwargs& kwargs) {
  Options o;
  for (auto [key, value] : kwargs) {
    const std::string name = nb::cast<std::string>(key);
    bool found = false;
    auto set = [&](const char* field_name, auto& field) {
      if (found || name != field_name) return;
      found = true;
      using T = std::remove_reference_t<decltype(field)>;
      if (!nb::try_cast<T>(value, field))
        throw Error(name + ": expected a " +
                    (std::is_floating_point_v<T> ? "number"
                     : std::is_same_v<T, bool>   ? "bool"
                                                 : "int") +
                    " (>= 0 where unsigned), got " + nb::cast<std::string>(nb::repr(value)));
    };
    source_fields(o.source, set);
    prefetch_fields(o.prefetch, set);
    if (!found) {
      std::string known;
      auto list = [&](const char* field_name, auto&) {
        known += std::string(known.empty() ? "" : ", ") + field_name;
      };
      source_fields(o.source, list);
      prefetch_fields(o.prefetch, list);
      throw Error("unknown option '" + name + "': expected one of " + known);
    }
  }
  return o;
}

PlanOptions plan_from(const nb::dict& d) {
  PlanOptions p;
  size_t used = 0;
  plan_fields(p, [&](const char* name, auto& field) {
    if (!d.contains(name)) return;
    ++used;
    using T = std::remove_reference_t<decltype(field)>;
    if (!nb::try_cast<T>(d[name], field))
      throw Error(std::string(name) + ": expected a non-negative " +
                  (std::is_same_v<T, bool> ? "bool" : "int") + ", got " +
                  nb::cast<std::string>(nb::repr(d[name])));
  });
  TPF_CHECK(used == d.size(), "plan: unknown keys among " + nb::cast<std::string>(nb::repr(d)));
  return p;
}

nb::dict defaults() {
  Options o;
  nb::dict d;
  auto put = [&](const char* name, auto& field) { d[name] = field; };
  source_fields(o.source, put);
  prefetch_fields(o.prefetch, put);
  return d;
}

nb::dict manifest_dict(const Manifest& m) {
  nb::dict d;
  d["location"] = m.location;
  d["text"] = m.text;
  d["verified"] = m.verified;
  d["downloads"] = m.downloads;
  nb::list locations;
  for (const ShardSpec& s : m.shards) locations.append(s.location);
  d["shard_locations"] = locations;
  return d;
}

void put_source_stats(nb::dict& d, const SourceStats& s) {
  d["retries"] = s.retries;
  d["full_body_answers"] = s.full_body_answers;
  d["multi_range_refused"] = s.multi_range_refused;
  d["single_range_spells"] = s.single_range_spells;
  d["multi_range_probes"] = s.multi_range_probes;
}

// A prefetcher and the shard set it reads, kept alive together.
struct Stream {
  std::shared_ptr<const ShardSet> shards;
  std::unique_ptr<Prefetcher> prefetcher;
  std::vector<std::unique_ptr<RecordDicts>> dicts;  // per shard, made on first use

  nb::object next() {
    RecordView view;
    bool more;
    {
      nb::gil_scoped_release release;
      more = prefetcher->next(view);
    }
    if (!more) throw nb::stop_iteration();
    const auto [shard, local] = shards->locate(view.record);
    const store::Index& index = shards->index(shard);
    if (dicts.size() <= shard) dicts.resize(size_t(shard) + 1);
    if (!dicts[shard]) dicts[shard] = std::make_unique<RecordDicts>(index);
    const store::RecordEntry e = index.entry(local);
    const std::span<const std::byte> stored(reinterpret_cast<const std::byte*>(view.data),
                                            view.length);
    const std::string& name = shards->shard_name(shard);
    // Arrays must not view the prefetch buffer, which is reused as the stream moves on. A
    // compressed record decodes into a buffer of its own, which its arrays view; an uncompressed
    // one's arrays are copied straight from the prefetch buffer into memory of their own (its
    // scalars and text are read from there), so each byte is copied once.
    if (e.codec != store::Codec::none) {
      const store::Record rec = store::decode_record(index, local, stored, false);
      return dicts[shard]->dict(e.layout_id, rec, keep_alive(rec.owned()), name, view.record);
    }
    const store::Record rec = store::decode_record_into(index, local, stored, {}, false);
    return dicts[shard]->dict(e.layout_id, rec, nb::handle(), name, view.record);
  }

  nb::dict stats() const {
    const PrefetchStats s = prefetcher->stats();
    nb::dict d;
    d["requests"] = s.requests;
    d["bytes_fetched"] = s.bytes_fetched;
    d["refetches"] = s.refetches;
    d["refetch_requests"] = s.refetch_requests;
    put_source_stats(d, s.sources);
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

struct Dataset {
  std::shared_ptr<const ShardSet> set;
  std::shared_ptr<DiskCache> disk_cache;
  PrefetchOptions prefetch;
};

}  // namespace

void bind_stream(nb::module_& m) {
  m.def("stream_defaults", &defaults,
        "The loader's options (sources and prefetcher) and their defaults, by name.");
  m.def("stream_is_remote", &is_remote, nb::arg("location"));
  m.def("stream_manifest_digest", &manifest_digest, nb::arg("text"));
  m.def(
      "stream_read_manifest",
      [](const std::string& location, const nb::kwargs& kwargs) {
        const SourceOptions o = options_from(kwargs).source;
        Manifest manifest;
        {
          nb::gil_scoped_release release;
          manifest = read_manifest(location, o);
        }
        return manifest_dict(manifest);
      },
      nb::arg("location"), nb::arg("kwargs"));
  m.def(
      "stream_plan",
      [](uint64_t num_records, const nb::dict& plan) {
        const PlanOptions p = plan_from(plan);
        std::vector<uint64_t> out;
        {
          nb::gil_scoped_release release;
          out = worker_plan(num_records, p);
        }
        return to_numpy(std::move(out));
      },
      nb::arg("num_records"), nb::arg("plan"));
  m.def("stream_http_stats", [] {
    const HttpStats h = http_stats();
    nb::dict d;
    d["attempts"] = h.attempts;
    d["slot_wait_s"] = double(h.slot_wait_ns) * 1e-9;
    d["first_byte_s"] = double(h.first_byte_ns) * 1e-9;
    d["attempt_s"] = double(h.attempt_ns) * 1e-9;
    return d;
  });

  nb::class_<Stream>(m, "StreamIterator")
      .def("__iter__", [](nb::handle self) { return self; })
      .def("__next__", &Stream::next)
      .def("__len__", [](const Stream& s) { return s.prefetcher->size(); })
      .def("stats", &Stream::stats);

  nb::class_<Dataset>(m, "StreamDataset")
      .def(
          "__init__",
          [](Dataset* self, const std::vector<std::string>& locations,
             const std::string& disk_cache_dir, uint64_t disk_cache_bytes,
             const nb::kwargs& kwargs) {
            const Options o = options_from(kwargs);
            std::shared_ptr<DiskCache> cache;
            if (!disk_cache_dir.empty())
              cache = DiskCache::create(disk_cache_dir, disk_cache_bytes);
            std::shared_ptr<const ShardSet> set;
            {
              nb::gil_scoped_release release;
              set = ShardSet::open_dataset(locations, o.source, cache);
            }
            new (self) Dataset{std::move(set), std::move(cache), o.prefetch};
          },
          nb::arg("locations"), nb::arg("disk_cache_dir") = "", nb::arg("disk_cache_bytes") = 0,
          nb::arg("kwargs"))
      .def_prop_ro("disk_cache_stats",
                   [](const Dataset& s) {
                     nb::dict d;
                     if (s.disk_cache) {
                       d["used_bytes"] = s.disk_cache->used_bytes();
                       d["budget"] = s.disk_cache->budget();
                       d["hit_bytes"] = s.disk_cache->hit_bytes();
                       d["miss_bytes"] = s.disk_cache->miss_bytes();
                     }
                     return d;
                   })
      .def("__len__", [](const Dataset& s) { return s.set->size(); })
      .def_prop_ro("num_shards", [](const Dataset& s) { return s.set->num_shards(); })
      .def("shard_name", [](const Dataset& s, uint32_t i) { return s.set->shard_name(i); })
      .def_prop_ro("source_stats",
                   [](const Dataset& s) {
                     nb::dict d;
                     put_source_stats(d, s.set->source_stats());
                     return d;
                   })
      .def_prop_ro("manifests",
                   [](const Dataset& s) {
                     nb::list out;
                     for (const Manifest& m : s.set->manifests()) out.append(manifest_dict(m));
                     return out;
                   })
      .def(
          "rank_count",
          [](const Dataset& s, const nb::dict& plan) {
            return rank_count(s.set->size(), plan_from(plan));
          },
          nb::arg("plan"))
      .def(
          "stream",
          [](const Dataset& s, const nb::dict& plan, uint64_t memory_budget, bool verify) {
            const PlanOptions p = plan_from(plan);
            PrefetchOptions o = s.prefetch;
            if (memory_budget) o.memory_budget = memory_budget;
            auto stream = std::make_unique<Stream>();
            stream->shards = s.set;
            {
              nb::gil_scoped_release release;
              stream->prefetcher = s.set->stream(p, o, verify);
            }
            return stream.release();
          },
          nb::arg("plan"), nb::arg("memory_budget") = 0, nb::arg("verify") = true,
          nb::rv_policy::take_ownership);
}

}  // namespace tpf::py
