// Writes a seed corpus for multipart_fuzz: multipart/byteranges answers as nginx sends them, and
// the broken ones the stream tests serve (parts one byte off, parts without Content-Range, huge
// part headers), duplicated parts, single-part answers, odd Content-Range values and truncated
// bodies, each in one chunk and cut into many.
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "multipart_fuzz_input.h"
#include "multipart_test_util.h"

namespace {

using tpf::stream::fuzz::FuzzInput;
using tpf::stream::testing::content_range;
using tpf::stream::testing::file_bytes;
using tpf::stream::testing::kEnd;
using tpf::stream::testing::part;
using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;

// A part whose Content-Range has the value `value`.
std::string part_with(uint64_t lo, uint64_t hi, const std::string& value) {
  return part(lo, hi, "Content-Range: " + value + "\r\n");
}

struct Writer {
  std::string dir;
  int n = 0;
  // Each seed in one chunk and cut into pieces by two chunk seeds.
  void add(FuzzInput in) {
    for (uint8_t seed : {0, 1, 77}) {
      in.chunk_seed = seed;
      const std::string bytes = encode(in);
      const std::string path = dir + "/seed-" + std::to_string(n++);
      FILE* f = std::fopen(path.c_str(), "wb");
      if (!f || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) {
        std::perror(path.c_str());
        std::exit(1);
      }
      std::fclose(f);
    }
  }
  void multipart(const Ranges& ranges, std::string body) {
    FuzzInput in;
    in.ranges = ranges;
    in.body = std::move(body);
    add(in);
  }
  void single(const Ranges& ranges, uint64_t start, std::string body) {
    FuzzInput in;
    in.single_part = true;
    in.ranges = ranges;
    in.start = start;
    in.body = std::move(body);
    add(in);
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: multipart_fuzz_seeds DIR\n");
    return 2;
  }
  Writer w{argv[1]};
  const std::vector<Ranges> sets = {
      {{0, 1}}, {{10, 100}, {200, 50}}, {{0, 16}, {16, 16}, {40, 3}}, {{5, 4096}, {5000, 700}}};
  for (const Ranges& ranges : sets) {
    std::string valid, off_by_one, no_range, flood, duplicated;
    for (const auto& [offset, length] : ranges) {
      const uint64_t lo = offset, hi = offset + length - 1;
      valid += part(lo, hi);
      off_by_one += part(lo + 1, hi + 1);
      no_range += part(lo, hi, "");
      const std::string filler = "X-Filler: " + std::string(10240, 'x') + "\r\n";
      flood += part(lo, hi, filler + content_range(lo, hi));
    }
    // The first part twice and nothing else: its range complete, the others empty.
    duplicated = part(ranges[0].first, ranges[0].first + ranges[0].second - 1);
    duplicated += duplicated;
    w.multipart(ranges, valid + kEnd);
    w.multipart(ranges, valid);                              // no closing boundary
    w.multipart(ranges, valid.substr(0, valid.size() / 2));  // cut in a part
    w.multipart(ranges, off_by_one + kEnd);
    w.multipart(ranges, no_range + kEnd);
    w.multipart(ranges, flood + kEnd);
    w.multipart(ranges, duplicated + kEnd);
    // The server merged the ranges: one part (or a single-part answer) over all of them.
    const uint64_t lo = ranges.front().first, hi = ranges.back().first + ranges.back().second - 1;
    w.multipart(ranges, part(lo, hi) + kEnd);
    w.single(ranges, lo, file_bytes(lo, hi - lo + 1));
    w.single(ranges, lo + 1, file_bytes(lo + 1, hi - lo + 1));
  }
  // Single-part answers near the end of the offsets.
  w.single({{0, 8}}, UINT64_MAX - 3, file_bytes(0, 8));
  w.single({{0, 8}}, UINT64_MAX, file_bytes(0, 2));

  // A part header block just inside and just past the limit (8192 bytes up to the blank line).
  const Ranges one = {{100, 10}};
  const size_t header_bytes = part(100, 109).size() - 10;  // up to and with the blank line
  for (size_t filler : {8192 - header_bytes - 12, 8192 - header_bytes - 11}) {
    const std::string header = "X-Filler: " + std::string(filler, 'y') + "\r\n";
    w.multipart(one, part(100, 109, header + content_range(100, 109)) + kEnd);
  }

  // Content-Range values, good and bad.
  for (const std::string value :
       {"bytes 100-109/*", "BYTES 100-109/1048576", "bytes\t100-109/1048576", "bytes  100-109",
        "bytes 100-109", "bytes100-109/1048576", "bytes +100-109/1048576", "bytes 100--109/1048576",
        "bytes -100-109/1048576", "bytes 109-100/1048576",
        "bytes 100-99999999999999999999999/1048576", "bytes 0-18446744073709551615/*",
        "bytes 18446744073709551615-18446744073709551615/*", "bytes */1048576",
        "bytes 100-\r\n109/1048576", "bytes\r\n100-109/1048576", "items 100-109/1048576"})
    w.multipart(one, part_with(100, 109, value) + kEnd);
  // A Content-Range line that is not at a line's start, and one in lower case.
  w.multipart(one, "\r\n--b\r\nX-Content-Range: bytes 100-109/1048576\r\n\r\n" +
                       file_bytes(100, 10) + kEnd);
  w.multipart(
      one, "\r\n--b\r\ncontent-range:bytes 100-109/1048576\r\n\r\n" + file_bytes(100, 10) + kEnd);
  // A header block that ends the body, with or without its blank line.
  w.multipart(one, "\r\n--b\r\nContent-Range: bytes 100-109/1048576\r\n\r\n");
  w.multipart(one, "\r\n--b\r\nContent-Range: bytes 100-109/1048576");
  return 0;
}
