// store::FdSource: the pread loop of the writer, the inspector and FoldPipe's file source.
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "tpf/error.h"
#include "tpf/store.h"

namespace tpf::store {

void FdSource::read(uint64_t offset, size_t length, void* dst) const {
  if (offset > size_ || length > size_ - offset)
    throw Error("read of " + std::to_string(length) + " bytes at " + std::to_string(offset) +
                " is past the end of " + path_ + " (" + std::to_string(size_) + " bytes)");
  auto* p = static_cast<char*>(dst);
  while (length > 0) {
    const ssize_t r = ::pread(fd_, p, length, off_t(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw RuntimeError("cannot read " + path_ + ": " + std::strerror(errno));
    if (r == 0) throw Error(path_ + " ended while reading (it shrank after it was opened)");
    p += r;
    length -= size_t(r);
    offset += uint64_t(r);
  }
}

}  // namespace tpf::store
