// Little-endian encoding on byte spans and the one checksum of the format (XXH3-64, seed 0).
// Every on-disk integer goes through these helpers, never through a packed struct.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace tpf::store::detail {

static_assert(std::endian::native == std::endian::little,
              "the store hands out zero-copy views of little-endian arrays; a big-endian host "
              "would need a byte-swapping decode path");

template <typename T>
inline T load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
inline void store(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

// Appends v to an encoding buffer.
template <typename T>
inline void put(std::vector<std::byte>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  store<T>(out.data() + at, v);
}

inline void put_bytes(std::vector<std::byte>& out, const void* p, size_t n) {
  const auto* b = static_cast<const std::byte*>(p);
  out.insert(out.end(), b, b + n);
}

inline void pad_to(std::vector<std::byte>& out, size_t alignment) {
  out.resize((out.size() + alignment - 1) / alignment * alignment, std::byte{0});
}

constexpr uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

uint64_t checksum(const void* data, size_t n);

// Bounds-checked cursor over an index block: every read names what it was reading when it runs
// past the end, so a truncated or corrupt block is a clear tpf::Error, never an overread.
class Cursor {
 public:
  Cursor(std::span<const std::byte> bytes, const std::string& what) : b_(bytes), what_(what) {}
  template <typename T>
  T take(const char* field) {
    need(sizeof(T), field);
    T v = load<T>(b_.data() + pos_);
    pos_ += sizeof(T);
    return v;
  }
  std::span<const std::byte> take_bytes(size_t n, const char* field) {
    need(n, field);
    auto s = b_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  size_t pos() const { return pos_; }
  size_t remaining() const { return b_.size() - pos_; }

 private:
  void need(size_t n, const char* field) const;
  std::span<const std::byte> b_;
  size_t pos_ = 0;
  const std::string& what_;
};

}  // namespace tpf::store::detail
