// The memory-mapped reader: the header region and index are parsed in place from the mapping, and
// records are decoded by decode_record straight from mapped bytes.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "store/bytes.h"
#include "tpf/error.h"
#include "tpf/store.h"

namespace tpf::store {

namespace {
std::string os_error(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}
}  // namespace

std::shared_ptr<const Reader> Reader::open(const std::string& path, ReaderOptions options) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) throw FileNotFoundError("store file", path);
    throw RuntimeError(os_error("cannot open", path));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw RuntimeError(os_error("cannot stat", path));
  }
  std::shared_ptr<Reader> r(new Reader());
  r->path_ = path;
  r->options_ = options;
  r->map_size_ = size_t(st.st_size);
  if (r->map_size_ > 0) {
    void* p = ::mmap(nullptr, r->map_size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      throw RuntimeError(os_error("cannot mmap", path));
    }
    r->map_ = static_cast<const std::byte*>(p);
  }
  // The mapping outlives the descriptor; nothing else needs it (and fork()ed children inherit the
  // mapping, not a shared file offset).
  ::close(fd);
  const std::span<const std::byte> all(r->map_, r->map_size_);
  Headers h = parse_headers(all, r->map_size_, path);
  check_fallback(h, path, options.recover, [&](uint64_t offset, uint64_t length) {
    return detail::checksum(all.data() + offset, length);
  });
  const HeaderSlot& c = h.slot[h.current];
  r->headers_ = h;
  r->index_ = Index::from_block(c, all.subspan(c.index_offset, c.index_length), nullptr,
                                r->map_size_, path);
  return r;
}

Reader::~Reader() {
  if (map_) ::munmap(const_cast<std::byte*>(map_), map_size_);
}

Record Reader::read(uint64_t i) const {
  const RecordEntry e = index_.entry(i);
  return decode_record(index_, i, bytes().subspan(e.offset, e.stored_length),
                       options_.verify_checksums);
}

}  // namespace tpf::store
