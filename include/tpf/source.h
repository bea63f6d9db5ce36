// A thread-safe random-access byte source: a local file, an HTTP(S) object, an S3 object.
// The record store reads shards only through this interface (and through mmap when the source is a
// local file), so a remote loader can hand it any source.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace tpf {

class ByteSource {
 public:
  virtual ~ByteSource() = default;
  // Total size in bytes. Throws tpf::RuntimeError if it cannot be determined.
  virtual uint64_t size() const = 0;
  // Reads exactly `length` bytes at `offset` into dst; safe to call from many threads at once.
  // Throws tpf::Error for a range past the end and tpf::RuntimeError for an I/O failure (the message
  // names the source).
  virtual void read(uint64_t offset, size_t length, void* dst) const = 0;
  // What to call this source in messages (a path or a URL).
  virtual std::string name() const = 0;
};

}  // namespace tpf
