// Record-store shards behind sources: their indexes give every record's byte range, so the
// prefetcher can fetch records without knowing the format; decoding goes back to the store.
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <optional>
#include <thread>

#include "tpf/error.h"
#include "tpf/stream.h"

namespace tpf::stream {

namespace {

constexpr int kIndexAttempts = 3;

// Before the last attempt a damaged slot is taken for damage in transit and fetched again; on the
// last one the store's own check decides (a damaged older slot is harmless, a damaged newest one an
// error: it may hold a commit the older one lacks), and the manifest's record count must match.
store::Index open_checked_index(const CancellableSource& source, const ShardSpec& spec,
                                bool last_attempt) {
  std::byte region[store::kHeaderRegionBytes];
  const size_t head = size_t(std::min<uint64_t>(source.size(), sizeof region));
  source.read(0, head, region);
  const store::Headers headers =
      store::parse_headers(std::span<const std::byte>(region, head), source.size(), source.name());
  for (const store::HeaderSlot& slot : headers.slot) {
    if (!last_attempt && !slot.valid && slot.problem.find("all zero") == std::string::npos)
      throw Error("shard '" + source.name() + "' has a damaged header slot: " + slot.problem);
  }
  store::Index index = store::open_index(source);
  if (spec.records != 0 && index.size() != spec.records)
    throw Error("shard '" + spec.location + "' holds " + std::to_string(index.size()) +
                " records, the manifest says " + std::to_string(spec.records));
  if (spec.generation != 0 && index.generation() != spec.generation)
    throw Error("shard '" + spec.location + "' is at commit generation " +
                std::to_string(index.generation()) + ", the manifest says " +
                std::to_string(spec.generation) +
                " (the shard was written again after the manifest)");
  return index;
}

}  // namespace

std::shared_ptr<const ShardSet> ShardSet::open(const std::vector<ShardSpec>& shards,
                                               const SourceOptions& options,
                                               std::shared_ptr<DiskCache> disk_cache) {
  TPF_CHECK(!shards.empty(), "shards: expected at least one shard, got none");
  const size_t n = shards.size();
  std::vector<std::shared_ptr<CancellableSource>> sources(n);
  std::vector<std::optional<store::Index>> indexes(n);
  std::vector<std::exception_ptr> errors(n);
  std::atomic<size_t> next{0};
  // Opening is latency-bound (a HEAD and two range reads per remote shard): overlap the shards.
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        SourceOptions o = options;
        o.expected_size = shards[i].bytes;
        sources[i] = open_source(shards[i].location, o);
        if (disk_cache && is_remote(shards[i].location)) sources[i] = disk_cache->wrap(sources[i]);
        // A header or index that fails its checksum may have been damaged in transit, and so may
        // a newer header slot, which would make the store fall back to an older commit: read them
        // again before believing the shard is corrupt or old.
        for (int attempt = 1;; ++attempt) {
          try {
            indexes[i] = open_checked_index(*sources[i], shards[i], attempt == kIndexAttempts);
            break;
          } catch (const Error&) {
            if (attempt >= kIndexAttempts) throw;
          }
        }
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
  };
  std::vector<std::thread> threads;
  for (size_t t = 0; t < std::min<size_t>(n, 16); ++t) threads.emplace_back(work);
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);

  std::shared_ptr<ShardSet> set(new ShardSet());
  auto locations = std::make_shared<std::vector<RecordLocation>>();
  for (size_t s = 0; s < n; ++s) {
    set->first_record_.push_back(locations->size());
    const store::Index& index = *indexes[s];
    for (uint64_t i = 0; i < index.size(); ++i) {
      const store::RecordEntry e = index.entry(i);
      locations->push_back({static_cast<uint32_t>(s), e.offset, e.stored_length});
    }
    set->names_.push_back(sources[s]->name());
    set->indexes_.push_back(std::move(*indexes[s]));
  }
  set->first_record_.push_back(locations->size());
  set->sources_ = std::move(sources);
  set->locations_ = std::move(locations);
  return set;
}

std::shared_ptr<const ShardSet> ShardSet::open_dataset(const std::vector<std::string>& locations,
                                                       const SourceOptions& options,
                                                       std::shared_ptr<DiskCache> disk_cache) {
  TPF_CHECK(!locations.empty(), "source: expected a manifest or shard location, got none");
  std::vector<ShardSpec> specs;
  std::vector<Manifest> manifests;
  for (const std::string& location : locations) {
    if (is_manifest(location)) {
      manifests.push_back(read_manifest(location, options));
      const auto& shards = manifests.back().shards;
      specs.insert(specs.end(), shards.begin(), shards.end());
    } else {
      specs.push_back({location});
    }
  }
  auto set = std::const_pointer_cast<ShardSet>(open(specs, options, std::move(disk_cache)));
  set->manifests_ = std::move(manifests);
  return set;
}

std::pair<uint32_t, uint64_t> ShardSet::locate(uint64_t record) const {
  TPF_CHECK(record < size(),
            "record: expected < " + std::to_string(size()) + ", got " + std::to_string(record));
  const auto it = std::upper_bound(first_record_.begin(), first_record_.end(), record);
  const auto shard = static_cast<uint32_t>(it - first_record_.begin() - 1);
  return {shard, record - first_record_[shard]};
}

std::unique_ptr<Prefetcher> ShardSet::stream(std::vector<uint64_t> plan,
                                             const PrefetchOptions& options, bool verify) const {
  RecordVerifier verifier;
  if (verify) {
    // The store's per-record checksum (FORMAT.md: XXH3-64, seed 0, over the stored bytes), checked
    // here rather than by decode_record so a mismatch can be fetched again.
    verifier.check = [this](uint64_t record, const uint8_t* data, uint64_t length) {
      const auto [shard, local] = locate(record);
      return XXH3_64bits(data, length) == indexes_[shard].entry(local).checksum;
    };
    verifier.what = "the XXH3-64 checksum in the shard's index";
  }
  // Checking and decoding a record read its index entry: far apart in a shuffled plan.
  RecordHint will_need = [this](uint64_t record) {
    if (record >= size()) return;
    const auto [shard, local] = locate(record);
    indexes_[shard].prefetch(local);
  };
  return std::make_unique<Prefetcher>(sources_, locations_, std::move(plan), options,
                                      std::move(verifier), std::move(will_need));
}

std::unique_ptr<Prefetcher> ShardSet::stream(const PlanOptions& plan,
                                             const PrefetchOptions& options, bool verify) const {
  return stream(worker_plan(size(), plan), options, verify);
}

SourceStats ShardSet::source_stats() const {
  SourceStats sum;
  for (const auto& source : sources_) sum += source->stats();
  return sum;
}

store::Record ShardSet::decode(const RecordView& view) const {
  const auto [shard, local] = locate(view.record);
  return store::decode_record(
      indexes_[shard], local,
      std::span<const std::byte>(reinterpret_cast<const std::byte*>(view.data), view.length),
      /*verify_checksum=*/false);
}

}  // namespace tpf::stream
