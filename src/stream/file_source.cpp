// Local files through pread: no shared file position, so one descriptor serves every thread.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "stream/sources.h"
#include "tpf/error.h"
#include "tpf/store.h"

namespace tpf::stream {

namespace {

// Owns the descriptor; the reads are the store's pread loop.
class FileSource final : public CancellableSource {
 public:
  explicit FileSource(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0)
      throw RuntimeError("cannot open '" + path_ + "' for reading: " + std::strerror(errno));
    struct stat st;
    if (::fstat(fd_, &st) != 0) {
      const int err = errno;
      ::close(fd_);
      throw RuntimeError("cannot stat '" + path_ + "': " + std::strerror(err));
    }
    file_ = std::make_unique<store::FdSource>(fd_, path_, uint64_t(st.st_size));
  }
  ~FileSource() override { ::close(fd_); }

  uint64_t size() const override { return file_->size(); }
  std::string name() const override { return path_; }

  void read_cancellable(uint64_t offset, size_t length, void* dst,
                        const CancelToken* cancel) const override {
    check_range(*this, offset, length);
    if (cancel && cancel->cancelled()) throw RuntimeError("read of '" + path_ + "' cancelled");
    file_->read(offset, length, dst);
  }

  // Reads from the page cache cost less than handing each to a fetch thread: bundle them.
  size_t ranges_per_request() const override { return 64; }

 private:
  std::string path_;
  int fd_ = -1;
  std::unique_ptr<store::FdSource> file_;
};

}  // namespace

void CancelToken::cancel() {
  std::vector<std::pair<uint64_t, std::function<void()>>> listeners;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    flag_.store(true, std::memory_order_release);
    listeners.swap(listeners_);
  }
  cv_.notify_all();
  for (auto& [key, wake] : listeners) wake();
}

void CancelToken::on_cancel(uint64_t key, std::function<void()> wake) const {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!cancelled()) {
      for (const auto& l : listeners_)
        if (l.first == key) return;
      listeners_.emplace_back(key, std::move(wake));
      return;
    }
  }
  wake();
}

bool CancelToken::wait_for(double seconds) const {
  std::unique_lock<std::mutex> lock(mutex_);
  return cv_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return cancelled(); });
}

void check_range(const ByteSource& source, uint64_t offset, size_t length) {
  const uint64_t size = source.size();
  if (offset > size || length > size - offset)
    throw Error("read range [" + std::to_string(offset) + ", " + std::to_string(offset + length) +
                ") of '" + source.name() + "' is past its end (size " + std::to_string(size) + ")");
}

std::unique_ptr<CancellableSource> open_file_source(const std::string& path) {
  return std::make_unique<FileSource>(path);
}

namespace {

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

bool is_url(const std::string& location) { return location.find("://") != std::string::npos; }

}  // namespace

bool is_remote(const std::string& location) {
  return starts_with(location, "http://") || starts_with(location, "https://") ||
         starts_with(location, "s3://");
}

std::string resolve_location(const std::string& base, const std::string& name) {
  if (is_url(name) || starts_with(name, "/")) return name;
  std::string folder = starts_with(base, "file://") ? base.substr(7) : base;
  const auto scheme = folder.find("://");
  const size_t path_start = scheme == std::string::npos ? 0 : folder.find('/', scheme + 3);
  const auto slash = folder.rfind('/');
  if (slash == std::string::npos || (path_start != std::string::npos && slash < path_start) ||
      path_start == std::string::npos)
    folder = scheme == std::string::npos ? "" : folder + "/";  // a bare file name, or host only
  else
    folder.resize(slash + 1);
  return folder + name;
}

std::unique_ptr<CancellableSource> open_source(const std::string& location,
                                               const SourceOptions& options) {
  if (location.empty()) throw Error("location: expected a path or URL, got an empty string");
  std::unique_ptr<CancellableSource> source;
  if (starts_with(location, "s3://")) {
    source = open_s3_source(location, options);
  } else if (is_remote(location)) {
    source = open_http_source(location, options);
  } else if (starts_with(location, "file://")) {
    source = open_file_source(location.substr(7));
  } else if (is_url(location)) {
    throw Error("location '" + location +
                "': expected a path, file://, http://, https:// or s3:// URL");
  } else {
    source = open_file_source(location);
  }
  if (options.expected_size != 0 && source->size() != options.expected_size)
    throw RuntimeError("'" + location + "' has " + std::to_string(source->size()) +
                       " bytes, the manifest says " + std::to_string(options.expected_size));
  return source;
}

}  // namespace tpf::stream
