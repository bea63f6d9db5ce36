// The input of multipart_fuzz, shared with its seed writer: which kind of body, how curl's chunks
// cut it, the ranges the request asked for, and the body itself.
//
//   byte 0      mode: bit 0 set = a single-part body (at `start`), else multipart/byteranges
//   byte 1      chunk seed: 0 feeds the body in one chunk, others cut it at pseudo-random places
//   byte 2      number of ranges (mod 9)
//   4 per range gap after the previous range's end (first: after 0), length - 1 (mod 4096); u16 LE
//   8 bytes     start (u64 LE), single-part bodies only
//   the rest    the body
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tpf::stream::fuzz {

struct FuzzInput {
  bool single_part = false;
  uint8_t chunk_seed = 0;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // (offset, length), disjoint, sorted
  uint64_t start = 0;
  std::string body;
};

inline bool decode(const uint8_t* data, size_t size, FuzzInput& in) {
  size_t at = 0;
  auto u16 = [&](uint16_t& v) {
    if (size - at < 2) return false;
    v = uint16_t(data[at] | data[at + 1] << 8);
    at += 2;
    return true;
  };
  if (size < 3) return false;
  in.single_part = data[0] & 1;
  in.chunk_seed = data[1];
  const size_t k = data[2] % 9;
  at = 3;
  uint64_t pos = 0;
  for (size_t i = 0; i < k; ++i) {
    uint16_t gap = 0, len = 0;
    if (!u16(gap) || !u16(len)) return false;
    const uint64_t length = uint64_t(len % 4096) + 1;
    in.ranges.emplace_back(pos + gap, length);
    pos += gap + length;
  }
  if (in.single_part) {
    if (size - at < 8) return false;
    in.start = 0;
    for (int b = 7; b >= 0; --b) in.start = in.start << 8 | data[at + size_t(b)];
    at += 8;
  }
  in.body.assign(reinterpret_cast<const char*>(data) + at, size - at);
  return true;
}

inline std::string encode(const FuzzInput& in) {
  std::string out;
  out += char(in.single_part ? 1 : 0);
  out += char(in.chunk_seed);
  out += char(in.ranges.size());
  uint64_t pos = 0;
  for (const auto& [offset, length] : in.ranges) {
    const uint64_t gap = offset - pos, len = length - 1;
    out += char(gap & 0xff);
    out += char(gap >> 8 & 0xff);
    out += char(len & 0xff);
    out += char(len >> 8 & 0xff);
    pos = offset + length;
  }
  if (in.single_part)
    for (int b = 0; b < 8; ++b) out += char(in.start >> (8 * b) & 0xff);
  return out + in.body;
}

}  // namespace tpf::stream::fuzz
