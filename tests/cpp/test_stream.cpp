// FoldPipe without a network: SigV4 against AWS's published example, the sampler's guarantees,
// the prefetcher over an in-memory source that delays, corrupts and fails on demand, and a shard
// set over real store files. The HTTP, S3 and fault-server tests are in tests/python.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "stream/sources.h"
#include "tpf/error.h"
#include "tpf/store.h"
#include "tpf/stream.h"

namespace tpf::stream {
namespace {

uint32_t fresh_seed() { return std::random_device{}(); }

// ---------------------------------------------------------------------------------------------
// SigV4

TEST(StreamSigV4, MatchesTheAwsGetObjectExample) {
  // "GET Object" example of the S3 SigV4 header-based authentication documentation.
  AwsCredentials creds{"AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "",
                       "us-east-1"};
  const auto headers = sigv4_headers(creds, "GET", "examplebucket.s3.amazonaws.com", "/test.txt",
                                     {{"Range", "bytes=0-9"}}, "20130524T000000Z");
  std::map<std::string, std::string> h(headers.begin(), headers.end());
  EXPECT_EQ(h["x-amz-date"], "20130524T000000Z");
  EXPECT_EQ(h["x-amz-content-sha256"],
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(h["Authorization"],
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
            "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
            "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
}

TEST(StreamSigV4, SessionTokenIsSignedAndKeysAreEncoded) {
  AwsCredentials creds{"AK", "SK", "TOKEN", "eu-west-1"};
  const auto headers = sigv4_headers(creds, "HEAD", "h:9000", "/b/k", {}, "20240101T000000Z");
  std::map<std::string, std::string> h(headers.begin(), headers.end());
  EXPECT_EQ(h["x-amz-security-token"], "TOKEN");
  EXPECT_NE(h["Authorization"].find("SignedHeaders=host;x-amz-content-sha256;x-amz-date;"
                                    "x-amz-security-token,"),
            std::string::npos);
  EXPECT_EQ(uri_encode_path("a b/c+d~e.f_g-h"), "a%20b/c%2Bd~e.f_g-h");
  EXPECT_THROW(sigv4_headers(creds, "GET", "h", "/", {}, "2024"), Error);
}

TEST(StreamSources, SchemesAndErrors) {
  EXPECT_THROW(open_source(""), Error);
  EXPECT_THROW(open_source("ftp://host/x"), Error);
  EXPECT_THROW(open_source("s3://bucket-only"), Error);
  EXPECT_THROW(open_source("/nonexistent/dir/file.tpf"), RuntimeError);
  const std::string path = ::testing::TempDir() + "/stream_file_source.bin";
  {
    FILE* f = std::fopen(path.c_str(), "wb");
    for (int i = 0; i < 1000; ++i) std::fputc(i % 251, f);
    std::fclose(f);
  }
  auto src = open_source("file://" + path);
  EXPECT_EQ(src->size(), 1000u);
  std::vector<uint8_t> buf(100);
  src->read(900, 100, buf.data());
  for (int i = 0; i < 100; ++i) EXPECT_EQ(buf[i], (900 + i) % 251);
  EXPECT_THROW(src->read(950, 100, buf.data()), Error);
  SourceOptions wrong;
  wrong.expected_size = 999;
  EXPECT_THROW(open_source(path, wrong), RuntimeError);
}

TEST(StreamSources, RemoteLocationsAndNamesRelativeToAManifest) {
  EXPECT_TRUE(is_remote("http://h/x") && is_remote("https://h/x") && is_remote("s3://b/k"));
  EXPECT_FALSE(is_remote("/a/b") || is_remote("file:///a/b") || is_remote("rel/path"));
  EXPECT_EQ(resolve_location("/a/b/manifest.json", "s.tpf"), "/a/b/s.tpf");
  EXPECT_EQ(resolve_location("manifest.json", "s.tpf"), "s.tpf");
  EXPECT_EQ(resolve_location("d/manifest.json", "s.tpf"), "d/s.tpf");
  EXPECT_EQ(resolve_location("file:///a/m.json", "s.tpf"), "/a/s.tpf");
  EXPECT_EQ(resolve_location("http://h:8/x/m.json", "s.tpf"), "http://h:8/x/s.tpf");
  EXPECT_EQ(resolve_location("http://h:8/m.json", "s.tpf"), "http://h:8/s.tpf");
  EXPECT_EQ(resolve_location("s3://b/p/m.json", "s.tpf"), "s3://b/p/s.tpf");
  EXPECT_EQ(resolve_location("http://h/x/m.json", "/abs.tpf"), "/abs.tpf");
  EXPECT_EQ(resolve_location("/a/m.json", "https://o/s.tpf"), "https://o/s.tpf");
  // The digest ignores its own value, whatever it holds, and nothing else.
  const std::string a = R"({"manifest_sha256": ")" + std::string(64, 'f') + R"(", "x": 1})";
  std::string b = a;
  b.replace(b.find(std::string(64, 'f')), 64, std::string(64, '0'));
  EXPECT_EQ(manifest_digest(a), manifest_digest(b));
  std::string c = a;
  c[c.size() - 2] = '2';
  EXPECT_NE(manifest_digest(a), manifest_digest(c));
  EXPECT_THROW(manifest_digest(R"({"x": 1})"), Error);
}

TEST(StreamSources, CancelTokenWakesEachListenerOnce) {
  CancelToken token;
  int a = 0, b = 0;
  token.on_cancel(1, [&] { ++a; });
  token.on_cancel(1, [&] { ++a; });  // the same key: ignored
  token.on_cancel(2, [&] { ++b; });
  EXPECT_EQ(a + b, 0);
  token.cancel();
  EXPECT_EQ(a, 1);
  EXPECT_EQ(b, 1);
  token.on_cancel(3, [&] { ++b; });  // already cancelled: at once
  EXPECT_EQ(b, 2);
  token.cancel();
  EXPECT_EQ(a, 1);
  EXPECT_EQ(b, 2);
}

// ---------------------------------------------------------------------------------------------
// Sampler

void expect_permutation(const std::vector<uint64_t>& order, uint64_t n, uint32_t seed) {
  ASSERT_EQ(order.size(), n) << "seed " << seed;
  std::vector<uint64_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[i], i) << "seed " << seed;
}

TEST(StreamSampler, EpochOrderIsADeterministicPermutation) {
  const uint32_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (uint64_t n : {0ull, 1ull, 2ull, 7ull, 1000ull, 4099ull}) {
    for (uint64_t block : {0ull, 1ull, 3ull, 64ull}) {
      SamplerOptions o{n, rng(), true, block};
      const auto a = epoch_order(o, 5);
      expect_permutation(a, n, seed);
      EXPECT_EQ(a, epoch_order(o, 5)) << "seed " << seed;
      if (n >= 1000) {
        EXPECT_NE(a, epoch_order(o, 6)) << "seed " << seed;
        SamplerOptions other = o;
        other.seed += 1;
        EXPECT_NE(a, epoch_order(other, 5)) << "seed " << seed;
      }
      if (block > 1) {
        // Every aligned block of neighbours appears as one contiguous run.
        for (uint64_t pos = 0; pos < n;) {
          const uint64_t blk = a[pos] / block, len = std::min(n, (blk + 1) * block) - blk * block;
          for (uint64_t j = 0; j < len; ++j) ASSERT_EQ(a[pos + j] / block, blk) << "seed " << seed;
          pos += len;
        }
      }
    }
  }
  SamplerOptions sequential{10, 1, false, 0};
  const auto seq = epoch_order(sequential, 3);
  for (uint64_t i = 0; i < 10; ++i) EXPECT_EQ(seq[i], i);
}

TEST(StreamSampler, RanksAndWorkersCoverEveryRecordOnce) {
  const uint32_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 20; ++trial) {
    const uint64_t n = 1 + rng() % 500;
    const uint32_t world = 1 + rng() % 5, workers = 1 + rng() % 4;
    const uint64_t batch = 1 + rng() % 7;
    const bool drop_last = rng() % 2;
    const auto order = epoch_order({n, rng(), true, rng() % 2 ? 0u : 8u}, trial);
    std::map<uint64_t, int> seen;
    size_t per_rank = 0;
    for (uint32_t r = 0; r < world; ++r) {
      const auto mine = rank_slice(order, 0, r, world, drop_last);
      if (r == 0) per_rank = mine.size();
      ASSERT_EQ(mine.size(), per_rank) << "seed " << seed;
      size_t total = 0;
      for (uint32_t w = 0; w < workers; ++w) {
        const auto part = worker_slice(mine, w, workers, batch);
        total += part.size();
        for (uint64_t x : part) ++seen[x];
      }
      ASSERT_EQ(total, mine.size()) << "seed " << seed;
    }
    if (drop_last) {
      EXPECT_EQ(per_rank, n / world) << "seed " << seed;
      for (auto& [k, c] : seen) EXPECT_EQ(c, 1) << "seed " << seed;
      EXPECT_EQ(seen.size(), n / world * world) << "seed " << seed;
    } else {
      EXPECT_EQ(per_rank, (n + world - 1) / world) << "seed " << seed;
      EXPECT_EQ(seen.size(), n) << "every record at least once, seed " << seed;
      uint64_t extra = 0;
      for (auto& [k, c] : seen) extra += c - 1;
      EXPECT_EQ(extra, per_rank * world - n) << "seed " << seed;
    }
  }
}

TEST(StreamSampler, WorkerBatchesInterleaveBackToTheRankOrder) {
  const uint32_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<uint64_t> rank_list(rng() % 300);
    for (auto& x : rank_list) x = rng();
    const uint32_t workers = 1 + rng() % 5;
    const uint64_t batch = 1 + rng() % 9;
    // DataLoader takes batch b from worker b % workers: replay that and expect the rank order back.
    std::vector<std::vector<uint64_t>> parts;
    for (uint32_t w = 0; w < workers; ++w)
      parts.push_back(worker_slice(rank_list, w, workers, batch));
    std::vector<size_t> pos(workers, 0);
    std::vector<uint64_t> replay;
    for (uint64_t b = 0; replay.size() < rank_list.size(); ++b) {
      const uint32_t w = b % workers;
      for (uint64_t i = 0; i < batch && pos[w] < parts[w].size(); ++i)
        replay.push_back(parts[w][pos[w]++]);
    }
    EXPECT_EQ(replay, rank_list) << "seed " << seed;
  }
}

TEST(StreamSampler, ResumeGivesExactlyTheRemainingRecords) {
  const uint32_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 20; ++trial) {
    const uint64_t n = 10 + rng() % 400;
    const uint32_t world = 1 + rng() % 4;
    const auto order = epoch_order({n, rng(), true, 0}, 1);
    const uint64_t per_rank = n / world;
    const uint64_t k = rng() % (per_rank + 1);  // samples each rank consumed before stopping
    std::multiset<uint64_t> all;
    for (uint32_t r = 0; r < world; ++r) {
      const auto full = rank_slice(order, 0, r, world, true);
      const auto rest = rank_slice(order, k * world, r, world, true);
      ASSERT_EQ(rest.size(), full.size() - k) << "seed " << seed;
      for (size_t i = 0; i < rest.size(); ++i) ASSERT_EQ(rest[i], full[k + i]) << "seed " << seed;
      all.insert(full.begin(), full.begin() + k);
      all.insert(rest.begin(), rest.end());
    }
    ASSERT_EQ(all.size(), per_rank * world) << "seed " << seed;
    EXPECT_EQ(std::set<uint64_t>(all.begin(), all.end()).size(), all.size()) << "seed " << seed;
  }
  EXPECT_THROW(rank_slice({1, 2}, 0, 2, 2, true), Error);
  EXPECT_THROW(rank_slice({1, 2}, 0, 0, 0, true), Error);
  EXPECT_THROW(worker_slice({1, 2}, 1, 1, 1), Error);
  EXPECT_THROW(worker_slice({1, 2}, 0, 1, 0), Error);
}

// ---------------------------------------------------------------------------------------------
// Prefetcher over an in-memory source

// Runs tasks on a few threads of its own, like an event loop calling back from elsewhere.
class TaskThreads {
 public:
  explicit TaskThreads(int n) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
  }
  ~TaskThreads() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

class MemorySource final : public CancellableSource {
 public:
  explicit MemorySource(std::vector<uint8_t> bytes, std::string name = "memory://test")
      : bytes_(std::move(bytes)), name_(std::move(name)) {}
  uint64_t size() const override { return bytes_.size(); }
  std::string name() const override { return name_; }
  void read_cancellable(uint64_t offset, size_t length, void* dst,
                        const CancelToken* cancel) const override {
    check_range(*this, offset, length);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++reads_;
      if (fail_all_) throw RuntimeError("'" + name_ + "' is unreachable");
    }
    if (delay_s_ > 0 && cancel && cancel->wait_for(delay_s_))
      throw RuntimeError("read of '" + name_ + "' cancelled");
    std::memcpy(dst, bytes_.data() + offset, length);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [at, times] : corrupt_)
      if (times > 0 && at >= offset && at < offset + length) {
        static_cast<uint8_t*>(dst)[at - offset] ^= 0x5A;
        --times;
      }
  }
  // Asynchronous (after make_asynchronous): reads run on the source's own threads, which call
  // `done`, as an HTTP source's event loop does.
  void start_ranges(std::vector<ByteRange> ranges, const CancelToken* cancel,
                    Done done) const override {
    if (!threads_)
      return CancellableSource::start_ranges(std::move(ranges), cancel, std::move(done));
    threads_->post([this, ranges = std::move(ranges), cancel, done = std::move(done)]() mutable {
      CancellableSource::start_ranges(std::move(ranges), cancel, std::move(done));
    });
  }
  bool asynchronous() const override { return threads_ != nullptr; }
  void make_asynchronous() { threads_ = std::make_unique<TaskThreads>(3); }
  size_t ranges_per_request() const override { return ranges_per_request_; }
  void set_ranges_per_request(size_t n) { ranges_per_request_ = n; }
  const std::vector<uint8_t>& bytes() const { return bytes_; }
  void corrupt(uint64_t at, int times) { corrupt_[at] = times; }
  void fail_all() { fail_all_ = true; }
  void delay(double s) { delay_s_ = s; }
  uint64_t reads() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return reads_;
  }

 private:
  std::vector<uint8_t> bytes_;
  std::string name_;
  mutable std::mutex mutex_;
  mutable std::map<uint64_t, int> corrupt_;
  mutable uint64_t reads_ = 0;
  bool fail_all_ = false;
  double delay_s_ = 0;
  size_t ranges_per_request_ = 1;
  std::unique_ptr<TaskThreads> threads_;  // last: its threads stop before the rest goes
};

struct Layout {
  std::vector<std::shared_ptr<MemorySource>> sources;
  std::shared_ptr<std::vector<RecordLocation>> locations =
      std::make_shared<std::vector<RecordLocation>>();
  std::vector<uint64_t> checksums;  // a sum per record, for the verifier
};

// Shards of random bytes cut into records of random lengths (some with gaps between them).
Layout random_layout(std::mt19937_64& rng, int shards, int records_per_shard, uint64_t max_len) {
  Layout l;
  for (int s = 0; s < shards; ++s) {
    std::vector<uint8_t> bytes;
    for (int r = 0; r < records_per_shard; ++r) {
      const uint64_t gap = rng() % 3 == 0 ? rng() % 100 : 0;
      bytes.resize(bytes.size() + gap);
      const uint64_t len = 1 + rng() % max_len;
      l.locations->push_back({uint32_t(s), bytes.size(), len});
      for (uint64_t i = 0; i < len; ++i) bytes.push_back(uint8_t(rng()));
    }
    l.sources.push_back(
        std::make_shared<MemorySource>(std::move(bytes), "memory://shard-" + std::to_string(s)));
  }
  for (const auto& loc : *l.locations) {
    uint64_t sum = 0;
    const auto& b = l.sources[loc.shard]->bytes();
    for (uint64_t i = 0; i < loc.length; ++i) sum = sum * 131 + b[loc.offset + i];
    l.checksums.push_back(sum);
  }
  return l;
}

std::vector<std::shared_ptr<CancellableSource>> as_sources(const Layout& l) {
  return {l.sources.begin(), l.sources.end()};
}

RecordVerifier verifier_for(const Layout& l) {
  return {[&l](uint64_t record, const uint8_t* data, uint64_t length) {
            uint64_t sum = 0;
            for (uint64_t i = 0; i < length; ++i) sum = sum * 131 + data[i];
            return sum == l.checksums[record];
          },
          "the test checksum"};
}

void expect_stream_matches(Prefetcher& p, const Layout& l, const std::vector<uint64_t>& plan,
                           uint32_t seed) {
  RecordView v;
  for (uint64_t i = 0; i < plan.size(); ++i) {
    ASSERT_TRUE(p.next(v)) << "seed " << seed;
    ASSERT_EQ(v.plan_index, i) << "seed " << seed;
    ASSERT_EQ(v.record, plan[i]) << "seed " << seed;
    const RecordLocation& loc = (*l.locations)[plan[i]];
    ASSERT_EQ(v.length, loc.length) << "seed " << seed;
    ASSERT_EQ(0, std::memcmp(v.data, l.sources[loc.shard]->bytes().data() + loc.offset, loc.length))
        << "record " << plan[i] << ", seed " << seed;
  }
  EXPECT_FALSE(p.next(v)) << "seed " << seed;
  EXPECT_FALSE(p.next(v)) << "seed " << seed;
}

TEST(StreamPrefetcher, HandsOutEveryPlannedRecordInOrderWithinTheBudget) {
  const uint32_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 18; ++trial) {
    const uint64_t budget = (4 + rng() % 200) * 4096;
    // Every other trial has records up to a third of the budget: spans often wrap around the
    // ring's end.
    const uint64_t max_len = trial % 2 ? 1 + rng() % 5000 : 1 + rng() % (budget / 3);
    Layout l = random_layout(rng, 1 + rng() % 4, 50 + rng() % 300, max_len);
    const uint64_t n = l.locations->size();
    std::vector<uint64_t> plan = epoch_order({n, rng(), true, trial % 4 < 2 ? 16u : 0u}, trial);
    if (trial % 3 == 0) plan.insert(plan.end(), plan.begin(), plan.begin() + n / 3);  // repeats
    PrefetchOptions o;
    o.memory_budget = budget;
    o.max_inflight = 1 + rng() % 16;
    o.group_records = 1 + rng() % 100;
    o.coalesce_gap = rng() % 2 ? 0 : 4096;
    o.max_request_bytes = 4096 + rng() % 100000;
    for (auto& src : l.sources) {
      src->set_ranges_per_request(1 + rng() % 8);  // bundled reads
      // Read by fetch threads, or asynchronously (the source's threads call back), or a mix.
      if (trial % 3 != 1 && rng() % 2) src->make_asynchronous();
    }
    Prefetcher p(as_sources(l), l.locations, plan, o, verifier_for(l));
    expect_stream_matches(p, l, plan, seed);
    const PrefetchStats s = p.stats();
    EXPECT_LE(s.peak_reserved, o.memory_budget) << "seed " << seed;
    EXPECT_GT(s.peak_reserved, 0u) << "seed " << seed;
    EXPECT_EQ(s.refetches, 0u) << "seed " << seed;
    EXPECT_LE(s.requests, plan.size()) << "seed " << seed;
  }
}

TEST(StreamPrefetcher, CoalescesNeighbouringRanges) {
  const uint32_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  Layout l = random_layout(rng, 1, 512, 300);
  const uint64_t n = l.locations->size();
  const std::vector<uint64_t> blocked = epoch_order({n, rng(), true, 64}, 0);
  PrefetchOptions o;
  o.group_records = 64;
  o.coalesce_gap = 128;
  Prefetcher p(as_sources(l), l.locations, blocked, o);
  expect_stream_matches(p, l, blocked, seed);
  // Blocks of 64 neighbours, groups of 64 entries: at most two requests per group (one per block
  // a misaligned group touches).
  EXPECT_LE(p.stats().requests, 2 * (n / 64 + 1)) << "seed " << seed;
}

TEST(StreamPrefetcher, BackpressureHoldsTheBudgetWhileTheConsumerIsSlow) {
  const uint32_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  Layout l = random_layout(rng, 2, 400, 3000);
  const uint64_t n = l.locations->size();
  const auto plan = epoch_order({n, rng(), true, 0}, 0);
  PrefetchOptions o;
  o.memory_budget = 64 * 1024;
  o.max_inflight = 8;
  o.group_records = 8;
  Prefetcher p(as_sources(l), l.locations, plan, o);
  RecordView v;
  uint64_t max_seen = 0;
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(p.next(v));
    if (i % 50 == 0) {
      // Give the fetchers time to run as far ahead as they can, then look at what they hold.
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      max_seen = std::max(max_seen, p.reserved_bytes());
    }
  }
  EXPECT_LE(max_seen, o.memory_budget) << "seed " << seed;
  EXPECT_GT(max_seen, o.memory_budget / 4) << "the prefetcher ran ahead, seed " << seed;
  EXPECT_LE(p.stats().peak_reserved, o.memory_budget) << "seed " << seed;
}

TEST(StreamPrefetcher, RefetchesCorruptRecordsAndReportsPersistentCorruption) {
  const uint32_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  Layout l = random_layout(rng, 1, 200, 500);
  const uint64_t n = l.locations->size();
  const auto plan = epoch_order({n, rng(), true, 0}, 0);
  std::set<uint64_t> hit;
  for (int i = 0; i < 10; ++i) {
    const uint64_t r = rng() % n;
    hit.insert(r);
    const auto& loc = (*l.locations)[r];
    l.sources[0]->corrupt(loc.offset + rng() % loc.length, 1);  // once: the refetch is clean
  }
  {
    // No gap bytes: each corrupted byte is then read once, by its own record's request.
    PrefetchOptions exact;
    exact.coalesce_gap = 0;
    Prefetcher p(as_sources(l), l.locations, plan, exact, verifier_for(l));
    expect_stream_matches(p, l, plan, seed);
    EXPECT_EQ(p.stats().refetches, hit.size()) << "seed " << seed;
  }
  PrefetchOptions quick;
  quick.coalesce_gap = 0;
  quick.verify_backoff_base_s = 0.001;
  quick.verify_backoff_max_s = 0.004;
  {
    // Damaged on several fetches in a row (transit corruption comes in bursts): the refetches
    // back off and go on until the bytes come right, within verify_attempts.
    const uint64_t r = plan[rng() % n];
    const auto& loc = (*l.locations)[r];
    l.sources[0]->corrupt(loc.offset + rng() % loc.length, quick.verify_attempts - 1);
    Prefetcher p(as_sources(l), l.locations, plan, quick, verifier_for(l));
    expect_stream_matches(p, l, plan, seed);
    EXPECT_EQ(p.stats().refetches, uint64_t(quick.verify_attempts - 1)) << "seed " << seed;
    EXPECT_EQ(p.stats().refetch_requests, uint64_t(quick.verify_attempts - 1)) << "seed " << seed;
  }
  const uint64_t bad = plan[n / 2];
  const auto& loc = (*l.locations)[bad];
  l.sources[0]->corrupt(loc.offset, 1000);  // corrupt at the source: every fetch is bad
  Prefetcher p(as_sources(l), l.locations, plan, quick, verifier_for(l));
  RecordView v;
  for (uint64_t i = 0; i < n / 2; ++i) ASSERT_TRUE(p.next(v));
  try {
    p.next(v);
    FAIL() << "a record that never matches its checksum must raise, seed " << seed;
  } catch (const RuntimeError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("memory://shard-0"), std::string::npos) << what;
    EXPECT_NE(what.find("did not match the test checksum on each of 8 fetches"), std::string::npos)
        << what;
    EXPECT_NE(what.find("record " + std::to_string(bad)), std::string::npos) << what;
  }
}

// Each with synchronous sources (fetch threads) and asynchronous ones (their own threads call back).
TEST(StreamPrefetcher, AnUnreachableShardRaisesItsNameAndNeverHangs) {
  const uint32_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (const bool asynchronous : {false, true}) {
    Layout l = random_layout(rng, 3, 100, 200);
    if (asynchronous)
      for (auto& src : l.sources) src->make_asynchronous();
    l.sources[1]->fail_all();
    std::vector<uint64_t> plan(l.locations->size());
    for (uint64_t i = 0; i < plan.size(); ++i) plan[i] = i;
    Prefetcher p(as_sources(l), l.locations, plan);
    RecordView v;
    uint64_t delivered = 0;
    try {
      while (p.next(v)) {
        ASSERT_EQ(v.record, delivered);
        ASSERT_EQ((*l.locations)[v.record].shard, 0u) << "a record of the failing shard came out";
        ++delivered;
      }
      FAIL() << "expected an error for shard 1 (asynchronous " << asynchronous << ")";
    } catch (const RuntimeError& e) {
      EXPECT_NE(std::string(e.what()).find("memory://shard-1"), std::string::npos) << e.what();
    }
  }
}

TEST(StreamPrefetcher, StopsPromptlyWithSlowReadsInFlight) {
  const uint32_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (const bool asynchronous : {false, true}) {
    Layout l = random_layout(rng, 1, 300, 100);
    if (asynchronous) l.sources[0]->make_asynchronous();
    l.sources[0]->delay(30.0);  // every read would take 30 s
    std::vector<uint64_t> plan(l.locations->size());
    for (uint64_t i = 0; i < plan.size(); ++i) plan[i] = i;
    const auto start = std::chrono::steady_clock::now();
    {
      Prefetcher p(as_sources(l), l.locations, plan);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5))
        << "asynchronous " << asynchronous;
  }
}

TEST(StreamPrefetcher, RejectsBadArguments) {
  std::mt19937_64 rng(1);
  Layout l = random_layout(rng, 1, 10, 100);
  PrefetchOptions tiny;
  tiny.memory_budget = 4096;
  auto big = std::make_shared<std::vector<RecordLocation>>(*l.locations);
  (*big)[3].length = 5000;
  big->back().offset = 0;
  auto src = std::make_shared<MemorySource>(std::vector<uint8_t>(10000));
  try {
    Prefetcher p({src}, big, {0, 3}, tiny);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("memory_budget"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Prefetcher({src}, l.locations, {10}), Error);
  PrefetchOptions no_threads;
  no_threads.max_inflight = 0;
  EXPECT_THROW(Prefetcher({src}, l.locations, {0}, no_threads), Error);
  auto other_shard = std::make_shared<std::vector<RecordLocation>>(1, RecordLocation{1, 0, 10});
  EXPECT_THROW(Prefetcher({src}, other_shard, {0}), Error);
}

// ---------------------------------------------------------------------------------------------
// Disk cache

TEST(StreamDiskCache, ServesRepeatReadsFromDiskWithinItsBudget) {
  const uint32_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const std::string dir = ::testing::TempDir() + "/stream_disk_cache_" + std::to_string(::getpid());
  for (uint64_t budget : {uint64_t(1) << 30, uint64_t(20000)}) {
    Layout l = random_layout(rng, 3, 100, 300);
    auto cache = DiskCache::create(dir, budget);
    std::vector<std::shared_ptr<CancellableSource>> cached;
    for (auto& src : l.sources) {
      src->set_ranges_per_request(1 + rng() % 4);
      cached.push_back(cache->wrap(src));
    }
    const uint64_t n = l.locations->size();
    uint64_t first_epoch_reads = 0;
    for (uint64_t epoch = 0; epoch < 3; ++epoch) {
      uint64_t before = 0;
      for (auto& src : l.sources) before += src->reads();
      const auto plan = epoch_order({n, rng(), true, 0}, epoch);
      // Where everything fits, no coalescing: a request merged across the bytes between two
      // records fetches those bytes too, and a gap that no request of epoch 0 spanned is then
      // fetched once in a later epoch (one read in ~200 seeds), though every record is on disk.
      PrefetchOptions o;
      if (budget > (uint64_t(1) << 20)) o.coalesce_gap = 0;
      Prefetcher p(cached, l.locations, plan, o, verifier_for(l));
      expect_stream_matches(p, l, plan, seed);
      uint64_t after = 0;
      for (auto& src : l.sources) after += src->reads();
      EXPECT_LE(cache->used_bytes(), budget) << "seed " << seed;
      if (epoch == 0) first_epoch_reads = after - before;
      if (epoch > 0 && budget > (uint64_t(1) << 20)) {
        EXPECT_EQ(after - before, 0u)
            << "everything fits: later epochs read only the disk (seed " << seed << ")";
      }
      if (epoch > 0 && budget < 100000) {
        EXPECT_GT(after - before, 0u) << "seed " << seed;
      }
    }
    EXPECT_GT(first_epoch_reads, 0u);
    if (budget > (uint64_t(1) << 20)) {
      EXPECT_GT(cache->hit_bytes(), 0u) << "seed " << seed;
    }
  }
  EXPECT_THROW(DiskCache::create(dir, 0), Error);
  std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// Shard sets over real store files

TEST(StreamShardSet, StreamsAndDecodesStoreShards) {
  const uint32_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const std::string dir = ::testing::TempDir() + "/stream_shards_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  std::vector<ShardSpec> specs;
  std::vector<std::vector<float>> positions;  // per global record
  const store::Codec codecs[] = {store::Codec::none, store::Codec::zstd, store::Codec::lz4};
  for (int s = 0; s < 3; ++s) {
    const std::string path = dir + "/shard-" + std::to_string(s) + ".tpf";
    store::WriterOptions wo;
    wo.codec = codecs[s];
    wo.overwrite = true;
    store::Writer w(path, wo);
    const int count = 20 + int(rng() % 50);
    for (int r = 0; r < count; ++r) {
      const uint64_t atoms = 1 + rng() % 40;
      std::vector<float> pos(atoms * 3);
      for (auto& x : pos) x = float(int(rng() % 2000) - 1000) / 7.0f;
      std::vector<int32_t> id{int32_t(positions.size())};
      store::ArrayRef fields[2];
      fields[0].key = "positions";
      fields[0].dtype = store::DType::f32;
      fields[0].itemsize = 4;
      fields[0].ndim = 2;
      fields[0].shape[0] = atoms;
      fields[0].shape[1] = 3;
      fields[0].data = pos.data();
      fields[1].key = "id";
      fields[1].dtype = store::DType::i32;
      fields[1].itemsize = 4;
      fields[1].ndim = 1;
      fields[1].shape[0] = 1;
      fields[1].data = id.data();
      w.append(fields);
      positions.push_back(pos);
    }
    w.commit();
    specs.push_back({path, uint64_t(count), 0});
  }
  auto set = ShardSet::open(specs);
  ASSERT_EQ(set->size(), positions.size());
  const auto plan = epoch_order({set->size(), rng(), true, 0}, 0);
  PrefetchOptions o;
  o.memory_budget = 16 * 4096;
  auto p = set->stream(plan, o);
  RecordView v;
  for (uint64_t i = 0; i < plan.size(); ++i) {
    ASSERT_TRUE(p->next(v)) << "seed " << seed;
    const store::Record rec = set->decode(v);
    const int pi = rec.find("positions"), ii = rec.find("id");
    ASSERT_GE(pi, 0);
    ASSERT_GE(ii, 0);
    int32_t id;
    std::memcpy(&id, rec.data(ii), 4);
    ASSERT_EQ(uint64_t(id), plan[i]) << "seed " << seed;
    const auto& want = positions[plan[i]];
    ASSERT_EQ(rec.field(pi).nbytes, want.size() * 4);
    ASSERT_EQ(0, std::memcmp(rec.data(pi), want.data(), want.size() * 4)) << "seed " << seed;
  }
  EXPECT_FALSE(p->next(v));

  auto wrong = specs;
  wrong[1].records += 1;
  try {
    ShardSet::open(wrong);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("shard-1.tpf"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tpf::stream
