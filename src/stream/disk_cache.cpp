// The disk cache: one sparse file per cached source, the byte ranges it holds in an interval map,
// a shared budget over all of them. Reads hold the cache's lock shared, fills and evictions hold it
// exclusively, so a read never sees a file being dropped under it.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <list>
#include <map>
#include <memory>
#include <shared_mutex>
#include <vector>

#include "stream/sources.h"
#include "tpf/error.h"

namespace tpf::stream {

namespace {

class Cache;

// Byte ranges held, as start -> end, merged and disjoint.
class Intervals {
 public:
  bool covers(uint64_t lo, uint64_t hi) const {
    auto it = map_.upper_bound(lo);
    if (it == map_.begin()) return false;
    --it;
    return it->second >= hi;
  }
  // Adds [lo, hi); returns the bytes newly covered.
  uint64_t add(uint64_t lo, uint64_t hi) {
    uint64_t before = 0;
    auto it = map_.upper_bound(lo);
    if (it != map_.begin() && std::prev(it)->second >= lo) --it;
    uint64_t new_lo = lo, new_hi = hi;
    while (it != map_.end() && it->first <= hi) {
      new_lo = std::min(new_lo, it->first);
      new_hi = std::max(new_hi, it->second);
      before += it->second - it->first;
      it = map_.erase(it);
    }
    map_[new_lo] = new_hi;
    return (new_hi - new_lo) - before;
  }
  void clear() { map_.clear(); }
  // Calls held(lo, hi) for each held piece of [lo, hi) and gap(lo, hi) for each piece not held, in
  // order.
  template <typename Held, typename Gap>
  void split(uint64_t lo, uint64_t hi, Held&& held, Gap&& gap) const {
    auto it = map_.upper_bound(lo);
    if (it != map_.begin() && std::prev(it)->second > lo) --it;
    uint64_t pos = lo;
    for (; it != map_.end() && it->first < hi && pos < hi; ++it) {
      if (it->first > pos) gap(pos, it->first);
      const uint64_t a = std::max(pos, it->first), b = std::min(hi, it->second);
      if (a < b) held(a, b);
      pos = std::max(pos, b);
    }
    if (pos < hi) gap(pos, hi);
  }

 private:
  std::map<uint64_t, uint64_t> map_;
};

struct Entry {
  std::string path;
  int fd = -1;
  Intervals held;
  uint64_t bytes = 0;
  std::list<Entry*>::iterator lru;
};

class CachedSource final : public CancellableSource {
 public:
  CachedSource(std::shared_ptr<Cache> cache, std::shared_ptr<CancellableSource> inner, Entry* entry)
      : cache_(std::move(cache)), inner_(std::move(inner)), entry_(entry) {}
  ~CachedSource() override;

  uint64_t size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }
  size_t ranges_per_request() const override { return inner_->ranges_per_request(); }
  SourceStats stats() const override { return inner_->stats(); }

  void read_cancellable(uint64_t offset, size_t length, void* dst,
                        const CancelToken* cancel) const override {
    read_ranges({{offset, length, dst}}, cancel);
  }
  void read_ranges(const std::vector<ByteRange>& ranges, const CancelToken* cancel) const override;

 private:
  std::shared_ptr<Cache> cache_;
  std::shared_ptr<CancellableSource> inner_;
  Entry* entry_;
};

class Cache final : public DiskCache, public std::enable_shared_from_this<Cache> {
 public:
  Cache(std::string dir, uint64_t budget) : dir_(std::move(dir)), budget_(budget) {}
  ~Cache() override = default;

  std::shared_ptr<CancellableSource> wrap(std::shared_ptr<CancellableSource> inner) override {
    auto entry = std::make_unique<Entry>();
    std::unique_lock lock(mutex_);
    entry->path = dir_ + "/source-" + std::to_string(next_id_++) + ".cache";
    entry->fd = ::open(entry->path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (entry->fd < 0)
      throw RuntimeError("cannot create disk cache file '" + entry->path +
                         "': " + std::strerror(errno));
    lru_.push_front(entry.get());
    entry->lru = lru_.begin();
    Entry* raw = entry.get();
    entries_.push_back(std::move(entry));
    return std::make_shared<CachedSource>(shared_from_this(), std::move(inner), raw);
  }

  uint64_t used_bytes() const override {
    std::shared_lock lock(mutex_);
    return used_;
  }
  uint64_t budget() const override { return budget_; }
  uint64_t hit_bytes() const override { return hits_.load(); }
  uint64_t miss_bytes() const override { return misses_.load(); }

  // Reads the pieces of `ranges` it holds into their destinations; returns the pieces it does not
  // hold (or could not read), to be fetched.
  std::vector<ByteRange> read_held(Entry* e, const std::vector<ByteRange>& ranges) {
    std::vector<ByteRange> missing;
    bool hit = false;
    std::shared_lock lock(mutex_);
    for (const ByteRange& r : ranges) {
      auto* dst = static_cast<uint8_t*>(r.dst);
      auto gap = [&](uint64_t a, uint64_t b) {
        missing.push_back({a, b - a, dst + (a - r.offset)});
      };
      auto held = [&](uint64_t a, uint64_t b) {
        if (pread_all(e->fd, dst + (a - r.offset), b - a, a)) {
          hits_ += b - a;
          hit = true;
        } else {
          gap(a, b);
        }
      };
      e->held.split(r.offset, r.offset + r.length, held, gap);
    }
    if (hit) touch(e);
    return missing;
  }

  // Stores fetched ranges, dropping least recently used sources to make room. A range larger than
  // the whole budget is not stored.
  void store(Entry* e, const std::vector<ByteRange>& ranges) {
    std::unique_lock lock(mutex_);
    for (const ByteRange& r : ranges) {
      misses_ += r.length;
      if (r.length == 0 || r.length > budget_ || e->held.covers(r.offset, r.offset + r.length))
        continue;
      for (auto it = lru_.rbegin(); used_ + r.length > budget_ && it != lru_.rend(); ++it)
        drop(*it);
      if (used_ + r.length > budget_) continue;
      const ssize_t n = ::pwrite(e->fd, r.dst, r.length, off_t(r.offset));
      if (n != ssize_t(r.length)) continue;  // a full disk only means this range is not cached
      const uint64_t added = e->held.add(r.offset, r.offset + r.length);
      e->bytes += added;
      used_ += added;
      touch(e);
    }
  }

  void release(Entry* e) {
    std::unique_lock lock(mutex_);
    drop(e);
    lru_.erase(e->lru);
    ::close(e->fd);
    ::unlink(e->path.c_str());
    for (auto it = entries_.begin(); it != entries_.end(); ++it)
      if (it->get() == e) {
        entries_.erase(it);
        break;
      }
  }

 private:
  static bool pread_all(int fd, void* dst, uint64_t length, uint64_t offset) {
    auto* out = static_cast<uint8_t*>(dst);
    uint64_t done = 0;
    while (done < length) {
      const ssize_t n = ::pread(fd, out + done, length - done, off_t(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      done += uint64_t(n);
    }
    return true;
  }

  void touch(Entry* e) {
    std::lock_guard<std::mutex> guard(lru_mutex_);
    lru_.splice(lru_.begin(), lru_, e->lru);
  }

  // Forgets everything `e` holds and gives its blocks back to the file system.
  void drop(Entry* e) {
    if (e->bytes == 0) return;
    if (::ftruncate(e->fd, 0) != 0) {
      // The bytes stay on disk but are no longer served; the budget still counts them free.
    }
    e->held.clear();
    used_ -= e->bytes;
    e->bytes = 0;
  }

  std::string dir_;
  uint64_t budget_;
  mutable std::shared_mutex mutex_;
  std::mutex lru_mutex_;  // the LRU order also moves under the shared lock (reads touch it)
  std::list<Entry*> lru_;
  std::vector<std::unique_ptr<Entry>> entries_;
  uint64_t used_ = 0;
  uint64_t next_id_ = 0;
  std::atomic<uint64_t> hits_{0}, misses_{0};
};

CachedSource::~CachedSource() { cache_->release(entry_); }

void CachedSource::read_ranges(const std::vector<ByteRange>& ranges,
                               const CancelToken* cancel) const {
  for (const ByteRange& r : ranges) check_range(*this, r.offset, r.length);
  const std::vector<ByteRange> missing = cache_->read_held(entry_, ranges);
  if (missing.empty()) return;
  if (missing.size() == 1)
    inner_->read_cancellable(missing[0].offset, missing[0].length, missing[0].dst, cancel);
  else
    inner_->read_ranges(missing, cancel);
  cache_->store(entry_, missing);
}

}  // namespace

std::shared_ptr<DiskCache> DiskCache::create(const std::string& directory, uint64_t budget) {
  TPF_CHECK(budget > 0, "disk_cache_bytes: expected > 0, got 0");
  TPF_CHECK(!directory.empty(), "disk_cache_dir: expected a directory, got an empty string");
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec)
    throw RuntimeError("cannot create disk cache directory '" + directory + "': " + ec.message());
  return std::make_shared<Cache>(directory, budget);
}

}  // namespace tpf::stream
