// Helpers shared by the multipart/byteranges tests and the seed writer of their fuzzer: a file
// whose bytes are a function of their offset, and parts of multi-range answers as nginx sends
// them.
#pragma once
#include <cstdint>
#include <string>

namespace tpf::stream::testing {

constexpr uint64_t kFileSize = 1 << 20;

inline char file_byte(uint64_t pos) { return char((pos * 131 + 7) & 0xff); }

inline std::string file_bytes(uint64_t lo, uint64_t n) {
  std::string s;
  for (uint64_t p = lo; p < lo + n; ++p) s += file_byte(p);
  return s;
}

// The header line "Content-Range: bytes lo-hi/kFileSize".
inline std::string content_range(uint64_t lo, uint64_t hi) {
  return "Content-Range: bytes " + std::to_string(lo) + "-" + std::to_string(hi) + "/" +
         std::to_string(kFileSize) + "\r\n";
}

// One part: boundary line, Content-Type, `headers` (whole lines), blank line, the bytes of
// [lo, hi].
inline std::string part(uint64_t lo, uint64_t hi, const std::string& headers) {
  return "\r\n--00000000000000000042\r\nContent-Type: application/octet-stream\r\n" + headers +
         "\r\n" + file_bytes(lo, hi - lo + 1);
}
inline std::string part(uint64_t lo, uint64_t hi) { return part(lo, hi, content_range(lo, hi)); }

// The closing boundary.
inline const std::string kEnd = "\r\n--00000000000000000042--\r\n";

}  // namespace tpf::stream::testing
