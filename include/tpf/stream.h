// FoldPipe: streaming record-store shards from local files, HTTP(S) and S3 under a hard memory
// budget, with prefetch driven by the sampler's known order.
//
// Pieces, each usable alone:
//   open_source()   a tpf::ByteSource for a path, file://, http(s):// or s3:// location
//   read_manifest() a dataset manifest, checked (manifest_sha256) and read again when damaged
//   epoch_order()   the deterministic order of all records for (seed, epoch), then rank_slice() and
//                   worker_slice() cut it for one rank and one DataLoader worker (worker_plan():
//                   all three in one call)
//   Prefetcher      fetches the byte ranges of a plan of records ahead of the consumer, never
//                   holding more than its byte budget, and hands records out in plan order,
//                   each verified (a corrupt one is fetched again, with backoff)
//   ShardSet        store shards behind sources; open_dataset() opens manifests or shards in one
//                   call, stream() streams one worker's plan of an epoch
//
// Failure model: every call can throw tpf::Error (bad arguments: the message names the argument)
// or tpf::RuntimeError (I/O that failed after the retries the options allow: the message names the
// URL). Nothing waits without a bound: every request has timeouts, every retry loop a count and a
// deadline.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tpf/source.h"
#include "tpf/store.h"

namespace tpf::stream {

// ---------------------------------------------------------------------------------------------
// Sources

struct SourceOptions {
  // Requests one remote source runs at once; a further read waits for a free connection.
  int max_connections = 16;
  // HTTP event loops (threads, shared by all sources of the process) a remote source spreads its
  // requests and connections over: each loop receives, parses and copies the answers it runs on
  // one core. 0: one per 4 cores of the machine, 1 to 4. Never more than max_connections.
  int http_threads = 0;
  double connect_timeout_s = 10.0;
  // Whole-request limit, and the stall limit: a transfer slower than 1 KiB/s for this long fails.
  double request_timeout_s = 60.0;
  double stall_timeout_s = 15.0;
  // Retries of connection errors, 5xx, 429 and short reads: exponential backoff with jitter,
  // base * 2^attempt capped at backoff_max_s, at most max_attempts tries and retry_deadline_s.
  int max_attempts = 8;
  double backoff_base_s = 0.05;
  double backoff_max_s = 2.0;
  double retry_deadline_s = 120.0;
  // A server or proxy may answer a range request with 200 and the whole object. Its bytes are
  // then taken from that body when the bytes asked for end within its first full_body_max_bytes
  // (the transfer stops there); past that the request is asked again (with backoff, counted as a
  // retry), since reading that far would cost more than the round trip.
  uint64_t full_body_max_bytes = 64ull << 20;
  // Size the caller already knows (from the manifest); 0 asks the server (one HEAD request).
  uint64_t expected_size = 0;
};

// What one source's reads met on the way, counted as it happens (all the source's reads).
struct SourceStats {
  uint64_t retries = 0;  // attempts asked again after a retryable failure (5xx, 429, resets,
                         // timeouts, short or malformed answers, 200s taken too far in)
  uint64_t full_body_answers = 0;    // 200 answers to range requests whose bytes were used
  uint64_t multi_range_refused = 0;  // multi-range requests answered 200 (not multipart)
  uint64_t single_range_spells = 0;  // times the source went to one range per request after
                                     // several multi-range requests in a row were refused
  uint64_t multi_range_probes = 0;   // multi-range requests sent to try again after such a spell

  SourceStats& operator+=(const SourceStats& o);
  SourceStats operator-(const SourceStats& o) const;
};

// Set once to abandon work: whoever waits through wait_for() (a retry's backoff) wakes at once,
// and so does every event loop that asked to be told (on_cancel).
class CancelToken {
 public:
  void cancel();
  bool cancelled() const { return flag_.load(std::memory_order_acquire); }
  // Waits up to `seconds`; returns true when cancelled meanwhile.
  bool wait_for(double seconds) const;
  // Calls `wake` once cancel() is called (at once, here, when it already was). Registrations with
  // the same `key` after the first are ignored, so a loop may register on every request it starts.
  // `wake` runs on the cancelling thread and must not block.
  void on_cancel(uint64_t key, std::function<void()> wake) const;

 private:
  std::atomic<bool> flag_{false};
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  mutable std::vector<std::pair<uint64_t, std::function<void()>>> listeners_;
};

// A ByteSource whose reads can be abandoned: the read throws tpf::RuntimeError soon after `cancel`
// is cancelled (at once during a retry's backoff, within about a second during a transfer).
struct ByteRange {
  uint64_t offset = 0;
  uint64_t length = 0;
  void* dst = nullptr;
};

class CancellableSource : public ByteSource {
 public:
  // The end of an asynchronous read: nullptr, or the exception read_ranges would have thrown.
  using Done = std::function<void(std::exception_ptr)>;

  virtual void read_cancellable(uint64_t offset, size_t length, void* dst,
                                const CancelToken* cancel) const = 0;
  void read(uint64_t offset, size_t length, void* dst) const override {
    read_cancellable(offset, length, dst, nullptr);
  }
  // Reads disjoint ranges sorted by offset, all or nothing (throws like read). An HTTP source asks
  // for them in one multi-range request when the server answers those; others read them in turn.
  virtual void read_ranges(const std::vector<ByteRange>& ranges, const CancelToken* cancel) const {
    for (const ByteRange& r : ranges) read_cancellable(r.offset, r.length, r.dst, cancel);
  }
  // How many ranges one read_ranges call should carry: 1 where they are not fetched together.
  virtual size_t ranges_per_request() const { return 1; }

  // read_ranges without waiting: `done` runs exactly once, with any error read_ranges would have
  // thrown, when the bytes are in place or the read failed. Asynchronous sources return at once and
  // call `done` from their own I/O thread, which `done` must not block; the others read here and
  // call `done` before returning. The destination buffers must stay valid and the source alive
  // until `done` has run.
  virtual void start_ranges(std::vector<ByteRange> ranges, const CancelToken* cancel,
                            Done done) const {
    std::exception_ptr error;
    try {
      read_ranges(ranges, cancel);
    } catch (...) {
      error = std::current_exception();
    }
    done(error);
  }
  // True when start_ranges returns at once, so a caller needs no thread of its own per read.
  virtual bool asynchronous() const { return false; }
  // The counters of this source's reads so far (zero for sources that never retry).
  virtual SourceStats stats() const { return {}; }
};

// True for a location read over the network (http://, https://, s3://); false for a path or a
// file:// URL. The one test every layer uses (disk cache, manifests, Python).
bool is_remote(const std::string& location);

// `name` relative to the folder of `base` (a path or URL), as a manifest names its shards: names
// that are URLs or absolute paths are kept.
std::string resolve_location(const std::string& base, const std::string& name);

// Counters of the process's HTTP requests since it started (all sources, all event loops), for
// measurements: attempts (one per try of a request), the time requests waited for a free
// connection of their source, and the time from each attempt's start to its first byte of body
// and to its end.
struct HttpStats {
  uint64_t attempts = 0;
  uint64_t slot_wait_ns = 0;
  uint64_t first_byte_ns = 0;
  uint64_t attempt_ns = 0;
};
HttpStats http_stats();

// A source for `location`: a path or file:// URL, http:// or https:// (range requests), or
// s3://bucket/key (SigV4; AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, optional AWS_SESSION_TOKEN,
// AWS_REGION or AWS_DEFAULT_REGION (default us-east-1), AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL
// for a non-AWS endpoint, which is then addressed path-style).
// Throws tpf::Error for an unsupported scheme or missing credentials, tpf::RuntimeError when the
// size cannot be learned, and tpf::RuntimeError when expected_size is set and differs.
std::unique_ptr<CancellableSource> open_source(const std::string& location,
                                               const SourceOptions& options = {});

// ---------------------------------------------------------------------------------------------
// Sampler

struct SamplerOptions {
  uint64_t num_records = 0;
  uint64_t seed = 0;
  bool shuffle = true;
  // 0: a uniform permutation of all records. B > 0: records are cut into blocks of B neighbours,
  // the blocks are permuted and each block is shuffled inside, so a run of B consecutive samples
  // reads one contiguous byte range (locality, at a measurable cost in shuffle quality).
  uint64_t block_size = 0;
};

// The order of all records for (seed, epoch): a permutation of [0, num_records), identical on every
// platform for the same options and epoch.
std::vector<uint64_t> epoch_order(const SamplerOptions& options, uint64_t epoch);

// One rank's share of `order` after the first `consumed` entries (consumed by all ranks together):
// entries consumed + rank, + world_size, ... The remaining length is made a multiple of world_size
// by dropping the tail (drop_last) or by repeating entries from the start of `order` (pad), so every
// rank gets the same count. Throws tpf::Error for rank >= world_size or world_size == 0.
std::vector<uint64_t> rank_slice(const std::vector<uint64_t>& order, uint64_t consumed,
                                 uint32_t rank, uint32_t world_size, bool drop_last);

// One DataLoader worker's share of a rank's list: batches of batch_size consecutive entries go to
// workers round-robin (batch b to worker b % num_workers), which is the order in which DataLoader
// hands them back, so the rank's consumed samples are always a prefix of `rank_list`.
std::vector<uint64_t> worker_slice(const std::vector<uint64_t>& rank_list, uint32_t worker,
                                   uint32_t num_workers, uint64_t batch_size);

// Everything that fixes which records one DataLoader worker of one rank reads in one epoch.
struct PlanOptions {
  uint64_t seed = 0;
  uint64_t epoch = 0;
  bool shuffle = true;
  uint64_t block_size = 0;  // as SamplerOptions::block_size
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint32_t worker = 0;
  uint32_t num_workers = 1;
  uint64_t batch_size = 1;  // the DataLoader's: workers take whole batches in turn
  uint64_t consumed = 0;    // records of this epoch all ranks consumed before (a resume point)
  bool drop_last = false;
};

// epoch_order, then rank_slice, then worker_slice, in one call: the worker's records in the order
// it reads them. Throws tpf::Error as those do.
std::vector<uint64_t> worker_plan(uint64_t num_records, const PlanOptions& options);
// How many records the rank reads (all its workers together) after `consumed`.
uint64_t rank_count(uint64_t num_records, const PlanOptions& options);

// ---------------------------------------------------------------------------------------------
// Prefetcher

// Where one record's bytes live.
struct RecordLocation {
  uint32_t shard = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct PrefetchOptions {
  // Hard limit on the bytes of fetched data held at once (in flight, ready, and the record being
  // consumed). A single record larger than this is an error.
  uint64_t memory_budget = 256ull << 20;
  // Range requests in flight at once. Enough must be in flight to cover the source's latency at
  // the rate the consumer reads: records/s x round trip / ranges per request (at 150,000
  // records/s, 5 ms plus the server's queue and ~20 ranges per request, over 40). An HTTP or S3
  // request in flight costs a connection, no thread; sources that read synchronously (files) are
  // read by min(max_inflight, 32) threads.
  int max_inflight = 256;
  // Neighbouring ranges of one group of plan entries are merged into one request when the gap
  // between them is at most coalesce_gap bytes and the merged request stays under max_request_bytes.
  // The gap's bytes are fetched, held and thrown away: worth it only where a separate range costs
  // more than fetching them. For nginx's multi-range answers and for files an extra range costs
  // about as much as a few KiB; for S3, where each range is a request of its own, far more.
  uint64_t coalesce_gap = 4 << 10;
  uint64_t max_request_bytes = 8ull << 20;
  // Consecutive plan entries fetched, held and released together; the ranges of one shard in a
  // group share requests, so larger groups mean fewer requests for a shuffled plan. 0: automatic,
  // enough that a uniformly shuffled group gives each source about as many ranges as one request
  // of it carries (up to 64): 64 per HTTP or file source, so a request's fixed costs (at the
  // server, in a proxy, in the event loop) are shared by about 64 records; at least 256, at most
  // 16384. Either way a group holds at most memory_budget / 8 bytes of records.
  uint32_t group_records = 0;
  // A record whose bytes fail verification (its checksum) is fetched again, after a backoff of
  // verify_backoff_base_s * 2^attempt (jittered, capped at verify_backoff_max_s), until it has
  // been fetched verify_attempts times in all; then it is an error that says what was checked.
  // Bytes corrupted in transit come right on a later fetch; bytes corrupt at the source never do.
  int verify_attempts = 8;
  double verify_backoff_base_s = 0.05;
  double verify_backoff_max_s = 2.0;
};

// A record handed to the consumer: valid until the next call to next() or the Prefetcher's end.
struct RecordView {
  const uint8_t* data = nullptr;
  uint64_t length = 0;
  uint64_t plan_index = 0;  // the record's position in the plan
  uint64_t record = 0;      // plan[plan_index]
};

// Checks a record's bytes (e.g. its checksum); false means "corrupt in transit, fetch it again".
// Called on the threads that fetch (event loops, fetch threads), several at once: must be
// thread-safe. `what` names what check compares, for the error that ends the retries.
struct RecordVerifier {
  std::function<bool(uint64_t record, const uint8_t* data, uint64_t length)> check;
  std::string what = "the checksum";
  explicit operator bool() const { return bool(check); }
};
// Told of records a few plan entries before the consumer reaches them (on the consumer's thread)
// and before a fetched request's records are checked (on the fetching thread), so what checking
// and decoding them reads (their index entries) can be loaded into the CPU's cache meanwhile: a
// shuffled plan's records lie far apart in every table. Must be thread-safe and not block.
using RecordHint = std::function<void(uint64_t record)>;

struct PrefetchStats {
  uint64_t requests = 0;          // range requests issued
  uint64_t bytes_fetched = 0;     // bytes those requests returned
  uint64_t refetches = 0;         // records fetched again after failing verification
  uint64_t refetch_requests = 0;  // the reads that fetched them (one per shard per round)
  uint64_t peak_reserved = 0;     // most bytes held at once (never above memory_budget)
  uint64_t consumer_waits = 0;    // next() calls that found their record not yet fetched
  uint64_t consumer_wait_ns = 0;  // time those calls waited, in all
  uint64_t ranges = 0;            // byte ranges those requests carried (after coalescing)
  uint64_t request_ns = 0;        // time from each request's start to its end, summed
  uint64_t inflight = 0;          // requests running now
  uint64_t peak_inflight = 0;     // most requests running at once (at most max_inflight)
  // The sources' own counters (SourceStats) over the prefetcher's life: sources shared with other
  // prefetchers running at the same time count their reads too.
  SourceStats sources;
};

class Prefetcher {
 public:
  // Streams plan (indices into `locations`) from `sources` (indexed by RecordLocation::shard).
  // Fetching starts at once on background threads. Throws tpf::Error for an index out of range, a
  // shard without a source, a record larger than the budget or options out of range.
  Prefetcher(std::vector<std::shared_ptr<CancellableSource>> sources,
             std::shared_ptr<const std::vector<RecordLocation>> locations,
             std::vector<uint64_t> plan, PrefetchOptions options = {}, RecordVerifier verify = {},
             RecordHint will_need = nullptr);
  // Stops fetching (in-flight requests are abandoned) and joins the threads.
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // The next record in plan order, or false at the end of the plan. Blocks (on a condition
  // variable) until it is fetched and verified. Throws tpf::RuntimeError naming the URL when its
  // shard stayed unreachable through every retry, or when it failed verification on each of
  // verify_attempts fetches.
  bool next(RecordView& out);

  uint64_t size() const;
  uint64_t reserved_bytes() const;
  PrefetchStats stats() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// ---------------------------------------------------------------------------------------------
// Disk cache

// Bytes of remote sources kept in local files under `directory`, at most `budget` bytes in all.
// Each cached source writes what it fetches into a sparse file of the source's size and serves
// later reads that fall inside what it holds from there; when the budget is full, whole sources
// are dropped least recently used first. The cache lives as long as its sources (it is not
// reused across processes: each process gets its own files).
class DiskCache {
 public:
  // Throws tpf::Error for budget == 0 and tpf::RuntimeError when `directory` cannot be created.
  static std::shared_ptr<DiskCache> create(const std::string& directory, uint64_t budget);
  virtual ~DiskCache() = default;
  // `inner` read through this cache.
  virtual std::shared_ptr<CancellableSource> wrap(std::shared_ptr<CancellableSource> inner) = 0;
  virtual uint64_t used_bytes() const = 0;
  virtual uint64_t budget() const = 0;
  // Bytes served from disk, and bytes that went to the inner sources.
  virtual uint64_t hit_bytes() const = 0;
  virtual uint64_t miss_bytes() const = 0;
};

// ---------------------------------------------------------------------------------------------
// A dataset: record-store shards read through sources

struct ShardSpec {
  std::string location;     // path or URL, as open_source takes it
  uint64_t records = 0;     // from the manifest; 0: not known (not checked)
  uint64_t bytes = 0;       // from the manifest; 0: not known (the server is asked)
  uint64_t generation = 0;  // from the manifest; 0: not known (not checked)
};

// A dataset manifest (FORMAT.md) as read: its text and its shards, their locations resolved
// against the manifest's own (`url` when present, else `path`).
struct Manifest {
  std::string location;
  std::string text;       // the JSON, as verified
  bool verified = false;  // it carried manifest_sha256 and its bytes matched it
  int downloads = 0;      // reads it took (more than 1: a download failed its checks)
  std::vector<ShardSpec> shards;
};

// True for a location that names a manifest (it ends in ".json") rather than a shard.
bool is_manifest(const std::string& location);

// Reads and checks a manifest: valid JSON, format "tpfkit-manifest" (or "turbopairformer-manifest",
// the name written before the package was renamed), a version this reader knows, a non-empty list
// of shards each with `path` or `url`, and (version 2, which `tpf pack` writes) its
// manifest_sha256. A download that fails these checks may have been damaged
// in transit: it is read again, with the source's backoff, up to options.max_attempts times in
// all. Throws tpf::Error naming the manifest and what was checked when every download failed, and
// tpf::RuntimeError when it cannot be read.
Manifest read_manifest(const std::string& location, const SourceOptions& options = {});

// The SHA-256 (hex) a manifest's manifest_sha256 holds: of its bytes with the 64 hex digits of
// that value replaced by '0's. `tpf pack` writes it; read_manifest checks it.
std::string manifest_digest(std::string text);

// Shards opened for streaming: one source per shard and each shard's committed index, read through
// the source (a header read and an index read). Records are numbered across shards in order.
class ShardSet {
 public:
  // Opens the shards, up to 16 at once. Throws tpf::RuntimeError naming the URL of a shard that
  // cannot be reached, and tpf::Error for one that is not a valid store or whose record count or
  // size differs from its spec.
  // `disk_cache`, when given, holds the bytes of the remote shards (not of local files).
  static std::shared_ptr<const ShardSet> open(const std::vector<ShardSpec>& shards,
                                              const SourceOptions& options = {},
                                              std::shared_ptr<DiskCache> disk_cache = nullptr);
  // A dataset in one call: each of `locations` is a manifest (read_manifest; its shards are
  // added in order) or a shard (records and size not known beforehand).
  static std::shared_ptr<const ShardSet> open_dataset(
      const std::vector<std::string>& locations, const SourceOptions& options = {},
      std::shared_ptr<DiskCache> disk_cache = nullptr);

  uint64_t size() const { return locations_->size(); }
  size_t num_shards() const { return sources_.size(); }
  const std::string& shard_name(uint32_t shard) const { return names_.at(shard); }
  // (shard, record inside the shard) of a record. Throws tpf::Error naming `record` when out of range.
  std::pair<uint32_t, uint64_t> locate(uint64_t record) const;

  // A prefetcher over `plan` (record numbers) that checks each record's checksum (when `verify`)
  // and fetches it again on a mismatch.
  std::unique_ptr<Prefetcher> stream(std::vector<uint64_t> plan, const PrefetchOptions& options,
                                     bool verify = true) const;
  // The same over one worker's plan for an epoch (worker_plan(size(), plan)).
  std::unique_ptr<Prefetcher> stream(const PlanOptions& plan, const PrefetchOptions& options,
                                     bool verify = true) const;
  // Its sources' counters since they were opened (opening included), all shards together.
  SourceStats source_stats() const;
  // The manifests it was opened from (open_dataset), in order.
  const std::vector<Manifest>& manifests() const { return manifests_; }
  // The committed index of a shard (its keys, layouts and entries).
  const store::Index& index(uint32_t shard) const { return indexes_.at(shard); }
  // Decodes a record the prefetcher handed out (its checksum was already checked). The Record may
  // point into view.data: valid as long as the view is.
  store::Record decode(const RecordView& view) const;

 private:
  ShardSet() = default;
  std::vector<std::shared_ptr<CancellableSource>> sources_;
  std::vector<std::string> names_;
  std::vector<store::Index> indexes_;
  std::vector<uint64_t> first_record_;  // per shard, then the total
  std::shared_ptr<const std::vector<RecordLocation>> locations_;
  std::vector<Manifest> manifests_;
};

}  // namespace tpf::stream
