// The prefetcher: positions move only forward, fetched >= ready >= handed out, and every byte held
// is reserved against the budget before it is written.
//
// The plan is cut into groups of consecutive entries. A scheduler thread walks the groups in
// order: it waits until the group's bytes fit in the budget, takes a span of the ring (one mapping
// of the whole budget), and queues the group's (coalesced) range requests. Queued requests start
// in order while fewer than max_inflight run: those of asynchronous sources (HTTP, S3) on their
// event loop, the others on a pool of fetch threads. The consumer waits for its group, hands its
// records out one by one and gives the group's span back when it moves past it. Spans are taken and
// given back in plan order, so the ring never fragments and the budget can never deadlock. Every
// wait is on a condition variable.
#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "tpf/error.h"
#include "tpf/stream.h"

namespace tpf::stream {

namespace {

constexpr uint64_t kPage = 4096;
// Threads for synchronous sources: a local disk gains nothing from more reads at once.
constexpr int kMaxFetchThreads = 32;
// Spans start on cache lines, so neighbouring groups' writers never share one.
constexpr uint64_t kSpanAlign = 64;
// How far ahead of the consumer next() asks for a record's location, its metadata (will_need) and
// the first bytes of its data to be loaded into the cache: each needs the one before.
constexpr uint64_t kLocationAhead = 16, kHintAhead = 8, kDataAhead = 4;

uint64_t page_round(uint64_t n) { return (n + kPage - 1) / kPage * kPage; }

SourceStats sum_stats(const std::vector<std::shared_ptr<CancellableSource>>& sources) {
  SourceStats sum;
  for (const auto& src : sources) sum += src->stats();
  return sum;
}

// PrefetchOptions::group_records = 0: about min(64, ranges per request) ranges per source in a
// uniformly shuffled group.
uint32_t automatic_group_records(const std::vector<std::shared_ptr<CancellableSource>>& sources) {
  uint64_t n = 0;
  for (const auto& src : sources)
    n += std::min<uint64_t>(64, std::max<size_t>(1, src->ranges_per_request()));
  return uint32_t(std::clamp<uint64_t>(n, 256, 16384));
}

// The budget as one anonymous mapping used as a ring: groups take contiguous spans in plan order
// and give them back in that order, so allocation moves a head and release moves a tail. Its pages
// are touched once and then reused: no mapping, unmapping or page fault per group, and never more
// resident than the budget (malloc could keep freed buffers and let the resident set grow past it).
// Not thread-safe: the prefetcher's mutex guards it.
class Ring {
 public:
  explicit Ring(uint64_t capacity) : capacity_(capacity) {
    void* p = ::mmap(nullptr, capacity_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw RuntimeError("cannot map " + std::to_string(capacity_) + " bytes for prefetched data");
    base_ = static_cast<uint8_t*>(p);
  }
  ~Ring() { ::munmap(base_, capacity_); }
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // A span of `bytes` (<= capacity) at `start`, costing `charge` (the bytes, plus the ring's end
  // when the span wraps to its start), or false when it does not fit until older spans come back.
  bool take(uint64_t bytes, uint64_t& start, uint64_t& charge) {
    if (used_ == 0) head_ = tail_ = 0;
    if (used_ == 0 || head_ > tail_) {
      // Free: [head, capacity) and [0, tail).
      if (head_ + bytes <= capacity_) {
        start = head_;
        charge = bytes;
      } else if (bytes <= tail_) {
        start = 0;
        charge = capacity_ - head_ + bytes;
      } else {
        return false;
      }
    } else {
      // Wrapped (or full when head == tail): free is [head, tail).
      if (head_ + bytes > tail_) return false;
      start = head_;
      charge = bytes;
    }
    head_ = start + bytes;
    used_ += charge;
    return true;
  }
  // Gives back the oldest span still taken.
  void give_back(uint64_t start, uint64_t bytes, uint64_t charge) {
    tail_ = start + bytes;
    used_ -= charge;
  }
  uint64_t used() const { return used_; }
  uint8_t* at(uint64_t offset) const { return base_ + offset; }

 private:
  uint64_t capacity_;
  uint8_t* base_ = nullptr;
  uint64_t head_ = 0, tail_ = 0, used_ = 0;
};

struct Request {
  uint32_t shard;
  uint64_t offset, length;
  uint64_t buffer_offset;  // where its bytes go in the group's buffer
};

struct Group {
  uint64_t first = 0, count = 0;  // plan entries [first, first + count)
  std::vector<Request> requests;
  std::vector<uint64_t> record_at;  // per entry: its bytes' offset in the buffer
  // The entries (relative to first) by request: request r's are
  // by_request[request_end[r - 1], request_end[r]) (from 0 for r = 0).
  std::vector<uint32_t> by_request, request_end;
  uint64_t bytes = 0;              // buffer bytes, rounded to kSpanAlign
  uint64_t start = 0, charge = 0;  // its span of the ring, and what the span costs the budget
  uint8_t* data = nullptr;
  size_t pending = 0;  // jobs not finished
  // The first error met, raised when the consumer reaches entry error_at (the earliest entry a
  // failed read or check left unusable): the entries before it are handed out.
  std::exception_ptr error;
  uint64_t error_at = UINT64_MAX;
};

using Clock = std::chrono::steady_clock;

// Requests [first, first + count) of a group, all of one shard, fetched in one read_ranges call;
// or, for a refetch, the records of `entries` (group-relative, of one shard) whose bytes failed
// verification, each read again in place.
struct Job {
  Group* group = nullptr;
  uint32_t shard = 0;
  size_t first = 0;
  size_t count = 0;
  std::shared_ptr<const std::vector<uint32_t>> entries;
  int fetch = 1;                  // the how-manyth fetch of these records this is
  Clock::time_point first_bad{};  // when they first failed verification (refetches)
  Clock::time_point started{};
};

}  // namespace

struct Prefetcher::State {
  std::vector<std::shared_ptr<CancellableSource>> sources;
  std::shared_ptr<const std::vector<RecordLocation>> locations;
  std::vector<uint64_t> plan;
  PrefetchOptions options;
  RecordVerifier verify;
  RecordHint will_need;
  uint64_t group_byte_limit = 0;

  mutable std::mutex mutex;
  std::condition_variable budget_cv;  // scheduler: room in the budget, or stop
  std::condition_variable jobs_cv;    // fetch threads: a job for them, or stop
  std::condition_variable ready_cv;   // consumer: a group built or a request finished
  std::condition_variable idle_cv;    // shutdown: no job in flight
  bool stop = false;
  CancelToken cancel;

  std::deque<std::unique_ptr<Group>> groups;  // reserved, not yet released, in plan order
  std::deque<Job> jobs;                       // queued, in plan order, not started
  std::deque<Job> thread_jobs;  // started, for the fetch threads (synchronous sources)
  int inflight = 0;             // started, not finished (at most max_inflight)
  std::unique_ptr<Ring> ring;
  PrefetchStats stats;
  SourceStats sources_at_start;
  // Refetches waiting out their backoff, by when they are due (the scheduler starts them).
  std::multimap<Clock::time_point, Job> delayed;
  std::mt19937_64 rng{std::random_device{}()};

  uint64_t next_entry = 0;  // consumer's position in the plan
  std::thread scheduler;
  std::vector<std::thread> fetchers;

  const RecordLocation& location(uint64_t entry) const { return (*locations)[plan[entry]]; }

  // The group starting at plan entry `first`: up to group_records entries and group_byte_limit
  // bytes of records (at least one entry), with neighbouring ranges of one shard merged.
  std::unique_ptr<Group> build_group(uint64_t first) const {
    auto g = std::make_unique<Group>();
    g->first = first;
    uint64_t record_bytes = 0;
    while (first + g->count < plan.size() && g->count < options.group_records) {
      const uint64_t len = location(first + g->count).length;
      if (g->count > 0 && record_bytes + len > group_byte_limit) break;
      record_bytes += len;
      ++g->count;
    }
    std::vector<uint32_t> by_position(g->count);
    for (uint32_t i = 0; i < g->count; ++i) by_position[i] = i;
    std::sort(by_position.begin(), by_position.end(), [&](uint32_t a, uint32_t b) {
      const auto &la = location(first + a), &lb = location(first + b);
      return la.shard != lb.shard ? la.shard < lb.shard : la.offset < lb.offset;
    });
    g->record_at.resize(g->count);
    uint64_t buffer_end = 0;
    for (size_t k = 0; k < by_position.size(); ++k) {
      const uint32_t i = by_position[k];
      const RecordLocation& loc = location(first + i);
      Request* last = g->requests.empty() ? nullptr : &g->requests.back();
      const uint64_t last_end = last ? last->offset + last->length : 0;
      const bool merge =
          last && last->shard == loc.shard && loc.offset <= last_end + options.coalesce_gap &&
          std::max(last_end, loc.offset + loc.length) - last->offset <= options.max_request_bytes &&
          // merging may add gap bytes, but never so many that the group outgrows the limit
          buffer_end + (loc.offset > last_end ? loc.offset - last_end : 0) <= 2 * group_byte_limit;
      if (merge) {
        const uint64_t new_end = std::max(last_end, loc.offset + loc.length);
        buffer_end += new_end - last_end;
        last->length = new_end - last->offset;
        g->record_at[i] = last->buffer_offset + (loc.offset - last->offset);
      } else {
        if (!g->requests.empty()) g->request_end.push_back(uint32_t(k));
        g->requests.push_back({loc.shard, loc.offset, loc.length, buffer_end});
        g->record_at[i] = buffer_end;
        buffer_end += loc.length;
      }
    }
    g->request_end.push_back(uint32_t(g->count));
    g->by_request = std::move(by_position);
    g->bytes = (std::max<uint64_t>(buffer_end, 1) + kSpanAlign - 1) / kSpanAlign * kSpanAlign;
    return g;
  }

  // Walks the plan group by group as the budget allows, and starts refetches whose backoff is
  // over; runs until stopped (a refetch may come after the last group was scheduled).
  void run_scheduler() {
    uint64_t first = 0;
    std::unique_ptr<Group> next_group;
    std::unique_lock<std::mutex> lock(mutex);
    while (!stop) {
      // Refetches hold back the oldest groups: they go first.
      for (auto now = Clock::now(); !delayed.empty() && delayed.begin()->first <= now;) {
        jobs.push_front(delayed.begin()->second);
        delayed.erase(delayed.begin());
      }
      if (!next_group && first < plan.size()) {
        lock.unlock();
        next_group = build_group(first);
        lock.lock();
        continue;
      }
      bool scheduled = false;
      if (next_group && ring->take(next_group->bytes, next_group->start, next_group->charge)) {
        schedule(*next_group);
        first += next_group->count;
        groups.push_back(std::move(next_group));
        scheduled = true;
      }
      std::vector<Job> startable = take_startable();
      if (scheduled || !startable.empty()) {
        lock.unlock();
        start(startable);
        ready_cv.notify_all();
        lock.lock();
        continue;
      }
      if (delayed.empty())
        budget_cv.wait(lock);
      else
        budget_cv.wait_until(lock, delayed.begin()->first);
    }
  }

  // Under the lock: a group whose span was taken gets its jobs queued.
  void schedule(Group& g) {
    g.data = ring->at(g.start);
    stats.peak_reserved = std::max(stats.peak_reserved, ring->used());
    // Requests are sorted by shard and offset: bundle each shard's run as its source likes, in as
    // few jobs as it allows, of even sizes (70 ranges at 64 a job: 35 and 35, not 64 and 6).
    const auto& reqs = g.requests;
    for (size_t r = 0; r < reqs.size();) {
      const uint32_t shard = reqs[r].shard;
      const size_t per = std::max<size_t>(1, sources[shard]->ranges_per_request());
      size_t end = r + 1;
      while (end < reqs.size() && reqs[end].shard == shard) ++end;
      const size_t run = end - r, parts = (run + per - 1) / per;
      for (size_t k = 0; k < parts; ++k) {
        const size_t count = run / parts + (k < run % parts ? 1 : 0);
        Job job;
        job.group = &g;
        job.shard = shard;
        job.first = r;
        job.count = count;
        jobs.push_back(job);
        ++g.pending;
        r += count;
      }
    }
  }

  // Under the lock: starts queued jobs while fewer than max_inflight run. Jobs of synchronous
  // sources go to the fetch threads; those of asynchronous sources are returned, to be started
  // outside the lock (their completion takes it).
  std::vector<Job> take_startable() {
    std::vector<Job> now;
    while (!stop && inflight < options.max_inflight && !jobs.empty()) {
      Job job = jobs.front();
      jobs.pop_front();
      job.started = std::chrono::steady_clock::now();
      ++inflight;
      stats.peak_inflight = std::max(stats.peak_inflight, uint64_t(inflight));
      if (source_of(job).asynchronous()) {
        now.push_back(job);
      } else {
        thread_jobs.push_back(job);
        jobs_cv.notify_one();
      }
    }
    return now;
  }

  CancellableSource& source_of(const Job& job) const { return *sources[job.shard]; }

  std::vector<ByteRange> ranges_of(const Job& job) const {
    if (job.entries) {
      // One range per record, sorted; entries that share bytes (a record planned twice) once.
      std::vector<ByteRange> ranges;
      for (uint32_t i : *job.entries) {
        const RecordLocation& loc = location(job.group->first + i);
        ranges.push_back({loc.offset, loc.length, job.group->data + job.group->record_at[i]});
      }
      std::sort(ranges.begin(), ranges.end(),
                [](const ByteRange& a, const ByteRange& b) { return a.offset < b.offset; });
      ranges.erase(
          std::unique(ranges.begin(), ranges.end(),
                      [](const ByteRange& a, const ByteRange& b) { return a.offset == b.offset; }),
          ranges.end());
      return ranges;
    }
    const Request* reqs = job.group->requests.data() + job.first;
    std::vector<ByteRange> ranges(job.count);
    for (size_t i = 0; i < job.count; ++i)
      ranges[i] = {reqs[i].offset, reqs[i].length, job.group->data + reqs[i].buffer_offset};
    return ranges;
  }

  void start(const std::vector<Job>& now) {
    for (const Job& job : now)
      source_of(job).start_ranges(ranges_of(job), &cancel,
                                  [this, job](std::exception_ptr error) { finish(job, error); });
  }

  // A job's end, on whichever thread ran it. Nothing here touches the state after the lock is
  // released unless more jobs start, which never happens once stopping (shutdown may then free it).
  void finish(const Job& job, std::exception_ptr error) {
    std::vector<uint32_t> bad;
    if (!error && verify) bad = verify_job(job);
    std::vector<Job> next;
    {
      const auto now = Clock::now();
      std::lock_guard<std::mutex> lock(mutex);
      ++stats.requests;
      stats.ranges += job.entries ? job.entries->size() : job.count;
      stats.request_ns +=
          uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(now - job.started).count());
      if (error) {
        fail(*job.group, job_entries(job), error);
      } else {
        if (job.entries) {
          for (uint32_t i : *job.entries)
            stats.bytes_fetched += location(job.group->first + i).length;
        } else {
          const Request* reqs = job.group->requests.data() + job.first;
          for (size_t i = 0; i < job.count; ++i) stats.bytes_fetched += reqs[i].length;
        }
        if (!bad.empty()) corrupt(job, std::move(bad), now);
      }
      // The consumer waits for whole groups only.
      if (--job.group->pending == 0) ready_cv.notify_all();
      --inflight;
      next = take_startable();
      if (inflight == 0) idle_cv.notify_all();
    }
    if (!next.empty()) start(next);
  }

  // Under the lock: records of `job` that failed verification are fetched again after a backoff,
  // or, when they have been fetched verify_attempts times, their group fails.
  void corrupt(const Job& job, std::vector<uint32_t> bad, Clock::time_point now) {
    if (stop) return;
    const Clock::time_point first_bad = job.entries ? job.first_bad : now;
    if (job.fetch >= options.verify_attempts) {
      const uint32_t i = *std::min_element(bad.begin(), bad.end());
      const uint64_t record = plan[job.group->first + i];
      const RecordLocation& loc = (*locations)[record];
      const double spent = std::chrono::duration<double>(now - first_bad).count();
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%.2f", spent);
      fail(*job.group, bad,
           std::make_exception_ptr(RuntimeError(
               "record " + std::to_string(record) + " of '" + sources[loc.shard]->name() +
               "' (bytes " + std::to_string(loc.offset) + "-" +
               std::to_string(loc.offset + loc.length - 1) + ") did not match " + verify.what +
               " on each of " + std::to_string(job.fetch) + " fetches over " + seconds +
               " s (verify_attempts = " + std::to_string(options.verify_attempts) + ")" +
               (bad.size() > 1
                    ? ", as did " + std::to_string(bad.size() - 1) + " more of its request"
                    : std::string()) +
               ": bytes damaged in transit would have come right on a later fetch, so the data at "
               "the "
               "source is likely corrupt")));
      return;
    }
    const double cap =
        std::min(options.verify_backoff_max_s,
                 options.verify_backoff_base_s * double(1ull << std::min(job.fetch - 1, 30)));
    const double delay = std::uniform_real_distribution<double>(0.5 * cap, cap)(rng);
    stats.refetches += bad.size();
    ++stats.refetch_requests;
    Job again;
    again.group = job.group;
    again.shard = job.shard;
    again.entries = std::make_shared<const std::vector<uint32_t>>(std::move(bad));
    again.fetch = job.fetch + 1;
    again.first_bad = first_bad;
    ++job.group->pending;
    delayed.emplace(
        now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(delay)),
        again);
    budget_cv.notify_all();  // the scheduler starts it when it is due
  }

  // Under the lock: `entries` (group-relative) of g are unusable for `error`.
  static void fail(Group& g, const std::vector<uint32_t>& entries, std::exception_ptr error) {
    const uint64_t at = entries.empty() ? 0 : *std::min_element(entries.begin(), entries.end());
    if (at < g.error_at) {
      g.error_at = at;
      g.error = error;
    }
  }

  // The entries (group-relative) whose bytes a job reads.
  std::vector<uint32_t> job_entries(const Job& job) const {
    if (job.entries) return *job.entries;
    const Group& g = *job.group;
    const uint32_t begin = job.first == 0 ? 0 : g.request_end[job.first - 1];
    const uint32_t end = g.request_end[job.first + job.count - 1];
    return {g.by_request.begin() + begin, g.by_request.begin() + end};
  }

  // Checks the records of a job on the thread that fetched them, while their bytes are still in
  // its cache and off the consumer's thread; returns those that failed (group-relative). Their
  // index entries are asked for first (will_need), so their cache misses overlap.
  std::vector<uint32_t> verify_job(const Job& job) const {
    Group& g = *job.group;
    const std::vector<uint32_t> mine = job_entries(job);
    if (will_need)
      for (uint32_t i : mine) will_need(plan[g.first + i]);
    std::vector<uint32_t> bad;
    for (uint32_t i : mine) {
      const uint64_t record = plan[g.first + i];
      if (!verify.check(record, g.data + g.record_at[i], (*locations)[record].length))
        bad.push_back(i);
    }
    return bad;
  }

  void run_fetcher() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex);
        jobs_cv.wait(lock, [&] { return stop || !thread_jobs.empty(); });
        if (stop) return;
        job = thread_jobs.front();
        thread_jobs.pop_front();
      }
      std::exception_ptr error;
      try {
        source_of(job).read_ranges(ranges_of(job), &cancel);
      } catch (...) {
        error = std::current_exception();
      }
      finish(job, error);
    }
  }

  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
      inflight -= int(thread_jobs.size());
      thread_jobs.clear();
      jobs.clear();
      delayed.clear();
    }
    // Wakes reads waiting out a backoff, and the event loops of asynchronous sources.
    cancel.cancel();
    budget_cv.notify_all();
    jobs_cv.notify_all();
    ready_cv.notify_all();
    if (scheduler.joinable()) scheduler.join();
    for (auto& t : fetchers)
      if (t.joinable()) t.join();
    // Asynchronous reads write into the ring until they end: wait for the last.
    std::unique_lock<std::mutex> lock(mutex);
    idle_cv.wait(lock, [&] { return inflight == 0; });
  }
};

Prefetcher::Prefetcher(std::vector<std::shared_ptr<CancellableSource>> sources,
                       std::shared_ptr<const std::vector<RecordLocation>> locations,
                       std::vector<uint64_t> plan, PrefetchOptions options, RecordVerifier verify,
                       RecordHint will_need)
    : state_(std::make_unique<State>()) {
  TPF_CHECK(locations != nullptr, "locations: expected a list of record locations, got null");
  TPF_CHECK(options.max_inflight >= 1,
            "max_inflight: expected >= 1, got " + std::to_string(options.max_inflight));
  TPF_CHECK(options.memory_budget >= kPage, "memory_budget: expected at least " +
                                                std::to_string(kPage) + " bytes, got " +
                                                std::to_string(options.memory_budget));
  TPF_CHECK(options.verify_attempts >= 1,
            "verify_attempts: expected >= 1, got " + std::to_string(options.verify_attempts));
  TPF_CHECK(options.verify_backoff_base_s >= 0 && options.verify_backoff_max_s >= 0,
            "verify_backoff_base_s, verify_backoff_max_s: expected >= 0, got " +
                std::to_string(options.verify_backoff_base_s) + ", " +
                std::to_string(options.verify_backoff_max_s));
  for (size_t s = 0; s < sources.size(); ++s)
    TPF_CHECK(sources[s] != nullptr,
              "sources[" + std::to_string(s) + "]: expected a source, got null");
  for (uint64_t entry = 0; entry < plan.size(); ++entry) {
    const uint64_t r = plan[entry];
    TPF_CHECK(r < locations->size(), "plan[" + std::to_string(entry) + "]: record " +
                                         std::to_string(r) + " is out of range (there are " +
                                         std::to_string(locations->size()) + " records)");
    const RecordLocation& loc = (*locations)[r];
    TPF_CHECK(loc.shard < sources.size(), "record " + std::to_string(r) + ": shard " +
                                              std::to_string(loc.shard) + " has no source (" +
                                              std::to_string(sources.size()) + " sources)");
    TPF_CHECK(page_round(std::max<uint64_t>(loc.length, 1)) <= options.memory_budget,
              "memory_budget: record " + std::to_string(r) + " of '" + sources[loc.shard]->name() +
                  "' has " + std::to_string(loc.length) + " bytes, more than the whole budget of " +
                  std::to_string(options.memory_budget) + " bytes");
  }
  State& s = *state_;
  s.sources = std::move(sources);
  s.locations = std::move(locations);
  s.plan = std::move(plan);
  s.options = options;
  if (s.options.group_records == 0) s.options.group_records = automatic_group_records(s.sources);
  s.verify = std::move(verify);
  s.will_need = std::move(will_need);
  s.sources_at_start = sum_stats(s.sources);
  // A few groups fit in the budget at once, so fetching runs ahead while the consumer reads.
  s.group_byte_limit = std::max<uint64_t>(options.memory_budget / 8, 1);
  // Whole pages, so what the ring can make resident stays within the budget. Every group fits: a
  // lone record passed the check above, and several records stay under budget / 2.
  s.ring = std::make_unique<Ring>(options.memory_budget / kPage * kPage);
  // Named for per-thread CPU (/proc/self/task, perf).
  s.scheduler = std::thread([&s] {
    ::pthread_setname_np(::pthread_self(), "tpf-schedule");
    s.run_scheduler();
  });
  // Threads only for sources that read synchronously: asynchronous ones need none per read.
  const bool any_synchronous = std::any_of(s.sources.begin(), s.sources.end(),
                                           [](const auto& src) { return !src->asynchronous(); });
  if (any_synchronous)
    for (int i = 0; i < std::min(options.max_inflight, kMaxFetchThreads); ++i)
      s.fetchers.emplace_back([&s] {
        ::pthread_setname_np(::pthread_self(), "tpf-fetch");
        s.run_fetcher();
      });
}

Prefetcher::~Prefetcher() { state_->shutdown(); }

bool Prefetcher::next(RecordView& out) {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  if (s.next_entry >= s.plan.size()) return false;
  // Release the groups the consumer has moved past: nothing handed out from them is still valid.
  bool released = false;
  while (!s.groups.empty() && s.groups.front()->first + s.groups.front()->count <= s.next_entry &&
         s.groups.front()->pending == 0) {
    const Group& done = *s.groups.front();
    s.ring->give_back(done.start, done.bytes, done.charge);
    s.groups.pop_front();
    released = true;
  }
  if (released) s.budget_cv.notify_all();

  const uint64_t entry = s.next_entry;
  Group* g = nullptr;
  auto find = [&] {
    for (auto& candidate : s.groups)
      if (entry < candidate->first + candidate->count) return candidate.get();
    return static_cast<Group*>(nullptr);
  };
  auto ready = [&] {
    g = find();
    return s.stop || (g && g->pending == 0);
  };
  if (!ready()) {
    ++s.stats.consumer_waits;
    const auto t0 = std::chrono::steady_clock::now();
    s.ready_cv.wait(lock, ready);
    s.stats.consumer_wait_ns += uint64_t(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
            .count());
  }
  if (s.stop) throw RuntimeError("the prefetcher was stopped");
  const uint64_t i = entry - g->first;
  if (g->error && i >= g->error_at) std::rethrow_exception(g->error);
  const uint64_t record = s.plan[entry];
  const RecordLocation& loc = (*s.locations)[record];
  uint8_t* data = g->data + g->record_at[i];
  // A shuffled plan reads every table far apart: start loading what the next records need while
  // this one is checked and decoded (their location, their metadata through will_need, the start
  // of their bytes when fetched).
  if (entry + kLocationAhead < s.plan.size())
    __builtin_prefetch(&(*s.locations)[s.plan[entry + kLocationAhead]]);
  if (s.will_need && entry + kHintAhead < s.plan.size()) s.will_need(s.plan[entry + kHintAhead]);
  if (i + kDataAhead < g->count) {
    const uint8_t* ahead = g->data + g->record_at[i + kDataAhead];
    __builtin_prefetch(ahead);
    __builtin_prefetch(ahead + 64);
  }
  ++s.next_entry;
  out.data = data;
  out.length = loc.length;
  out.plan_index = entry;
  out.record = record;
  return true;
}

SourceStats& SourceStats::operator+=(const SourceStats& o) {
  retries += o.retries;
  full_body_answers += o.full_body_answers;
  multi_range_refused += o.multi_range_refused;
  single_range_spells += o.single_range_spells;
  multi_range_probes += o.multi_range_probes;
  return *this;
}

SourceStats SourceStats::operator-(const SourceStats& o) const {
  SourceStats d = *this;
  d.retries -= o.retries;
  d.full_body_answers -= o.full_body_answers;
  d.multi_range_refused -= o.multi_range_refused;
  d.single_range_spells -= o.single_range_spells;
  d.multi_range_probes -= o.multi_range_probes;
  return d;
}

uint64_t Prefetcher::size() const { return state_->plan.size(); }

uint64_t Prefetcher::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->ring->used();
}

PrefetchStats Prefetcher::stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  PrefetchStats s = state_->stats;
  s.inflight = uint64_t(std::max(state_->inflight, 0));
  s.sources = sum_stats(state_->sources) - state_->sources_at_start;
  return s;
}

}  // namespace tpf::stream
