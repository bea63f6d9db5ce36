// A ByteSource over an open file descriptor (pread), for the writer reopening a file and for the
// inspector: both read the committed state through the same parser as every other reader.
#pragma once
#include <cstdint>
#include <string>

#include "tpf/source.h"

namespace tpf::store::detail {

class FdSource final : public ByteSource {
 public:
  // Does not own `fd`; `size` is the file size to expose.
  FdSource(int fd, std::string path, uint64_t size)
      : fd_(fd), path_(std::move(path)), size_(size) {}
  uint64_t size() const override { return size_; }
  void read(uint64_t offset, size_t length, void* dst) const override;
  std::string name() const override { return path_; }

 private:
  int fd_;
  std::string path_;
  uint64_t size_;
};

}  // namespace tpf::store::detail
