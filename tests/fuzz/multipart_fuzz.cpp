// libFuzzer target over the parser of multi-range answers (stream/multipart.h), run under ASan and
// UBSan. The input (multipart_fuzz_input.h) names the kind of body, where curl's chunks cut it, the
// ranges asked for and the body. The body is fed in exact-size heap chunks into ranges that are
// exact-size heap buffers, and the outcome is checked against a plain reference parser written
// here from the format, not from the parser:
//   - every piece of part data lies inside the chunk it came from, at the file offsets its part's
//     Content-Range claims (a reference parse of the whole body gives the pieces, and whether it
//     is malformed);
//   - a malformed body is reported as malformed, at the same point, and nothing follows;
//   - each range holds the last bytes written to it, and its filled count is the bytes covered;
//   - parse_content_range() on a header block that ends where an unreadable page begins agrees
//     with the reference (ASan does not see what libc reads past a buffer; a fault does).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "multipart_fuzz_input.h"
#include "stream/multipart.h"

namespace {

using tpf::stream::ByteRangesParser;
using tpf::stream::RangeScatter;
using tpf::stream::fuzz::FuzzInput;

#define FUZZ_CHECK(cond)                                                                     \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "multipart_fuzz: check failed: %s (line %d)\n", #cond, __LINE__); \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)

constexpr size_t kMax = ByteRangesParser::kMaxPartHeader;

// A copy of some bytes that ends where an unreadable page begins: a read past its end faults, even
// from uninstrumented code.
class GuardedCopy {
 public:
  explicit GuardedCopy(std::string_view s) {
    const size_t page = size_t(::sysconf(_SC_PAGESIZE));
    bytes_ = (s.size() + page - 1) / page * page + page;
    void* base =
        ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    FUZZ_CHECK(base != MAP_FAILED);
    base_ = static_cast<char*>(base);
    char* guard = base_ + bytes_ - page;
    FUZZ_CHECK(::mprotect(guard, page, PROT_NONE) == 0);
    data_ = guard - s.size();
    std::memcpy(data_, s.data(), s.size());
  }
  ~GuardedCopy() { ::munmap(base_, bytes_); }
  GuardedCopy(const GuardedCopy&) = delete;
  GuardedCopy& operator=(const GuardedCopy&) = delete;
  const char* data() const { return data_; }

 private:
  char* base_ = nullptr;
  char* data_ = nullptr;
  size_t bytes_ = 0;
};

// A piece of part data: `count` bytes at file offset `pos`, from body offset `at`.
struct Piece {
  uint64_t pos;
  size_t at;
  size_t count;
  bool operator==(const Piece&) const = default;
};

// Appends p, merging it into the last piece when it continues it both in the file and the body.
void push(std::vector<Piece>& out, Piece p) {
  if (!out.empty() && out.back().pos + out.back().count == p.pos &&
      out.back().at + out.back().count == p.at) {
    out.back().count += p.count;
    return;
  }
  out.push_back(p);
}

bool lower_equal(std::string_view s, std::string_view lower) {
  if (s.size() < lower.size()) return false;
  for (size_t i = 0; i < lower.size(); ++i)
    if (char(std::tolower(static_cast<unsigned char>(s[i]))) != lower[i]) return false;
  return true;
}

// RFC 9110's "Content-Range: bytes A-B/..." on the first line that starts with Content-Range, as
// a plain reading of the format: spaces before "bytes", spaces or tabs after it, digits only, no
// overflow, B >= A, and B - A + 1 representable.
bool reference_content_range(std::string_view block, uint64_t& start, uint64_t& length) {
  std::string_view v;
  bool found = false;
  while (!block.empty()) {
    if (lower_equal(block, "content-range:")) {
      v = block.substr(14);
      found = true;
      break;
    }
    const size_t nl = block.find('\n');
    if (nl == std::string_view::npos) break;
    block.remove_prefix(nl + 1);
  }
  if (!found) return false;
  while (!v.empty() && v.front() == ' ') v.remove_prefix(1);
  if (!lower_equal(v, "bytes")) return false;
  v.remove_prefix(5);
  while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
  auto number = [&v](uint64_t& out) {
    if (v.empty() || v.front() < '0' || v.front() > '9') return false;
    out = 0;
    for (; !v.empty() && v.front() >= '0' && v.front() <= '9'; v.remove_prefix(1)) {
      const uint64_t d = uint64_t(v.front() - '0');
      if (out > (UINT64_MAX - d) / 10) return false;
      out = out * 10 + d;
    }
    return true;
  };
  uint64_t a = 0, b = 0;
  if (!number(a) || v.empty() || v.front() != '-') return false;
  v.remove_prefix(1);
  if (!number(b) || b < a || b - a == UINT64_MAX) return false;
  start = a;
  length = b - a + 1;
  return true;
}

// The whole body at once: its pieces, and whether (and the pieces before which) it is malformed.
struct Expected {
  std::vector<Piece> pieces;
  bool malformed = false;
};

Expected reference_parse(const FuzzInput& in) {
  Expected e;
  const std::string_view body = in.body;
  if (in.single_part) {
    // Part data at file offsets start.. up to 2^64 - 1; a body that runs past them is malformed.
    const uint64_t room = UINT64_MAX - in.start;  // bytes after the first
    const size_t n = body.empty() ? 0 : size_t(std::min<uint64_t>(body.size() - 1, room)) + 1;
    if (n) push(e.pieces, {in.start, 0, n});
    e.malformed = n < body.size();
    return e;
  }
  size_t at = 0;
  while (at < body.size()) {
    const std::string_view window = body.substr(at, kMax);
    const size_t blank = window.find("\r\n\r\n");
    if (blank == std::string_view::npos) {
      e.malformed = window.size() >= kMax;  // else the body ends inside a header block
      break;
    }
    uint64_t start = 0, length = 0;
    if (!reference_content_range(window.substr(0, blank + 2), start, length)) {
      e.malformed = true;
      break;
    }
    at += blank + 4;
    const size_t n = size_t(std::min<uint64_t>(length, body.size() - at));
    if (n) push(e.pieces, {start, at, n});
    at += n;
  }
  return e;
}

// Chunk lengths that add up to n: one chunk for seed 0, else short and long ones.
std::vector<size_t> chunking(size_t n, uint8_t seed) {
  std::vector<size_t> out;
  uint32_t x = seed * 2654435761u + 1;
  while (n > 0) {
    size_t len = n;
    if (seed) {
      x ^= x << 13;
      x ^= x >> 17;
      x ^= x << 5;
      len = std::min<size_t>(n, (x & 7) == 0 ? 1 + (x >> 8) % 20000 : 1 + (x >> 8) % 16);
    }
    out.push_back(len);
    n -= len;
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzInput in;
  if (!tpf::stream::fuzz::decode(data, size, in)) return 0;
  const Expected expected = reference_parse(in);

  // The ranges asked for, each an exact-size buffer, and a model of what they should hold.
  std::vector<std::unique_ptr<char[]>> buffers;
  std::vector<tpf::stream::ByteRange> ranges;
  std::vector<std::string> model;
  std::vector<std::vector<bool>> covered;
  for (const auto& [offset, length] : in.ranges) {
    buffers.emplace_back(new char[length]);
    ranges.push_back({offset, length, buffers.back().get()});
    model.emplace_back(length, '\0');
    covered.emplace_back(length, false);
  }
  RangeScatter scatter(ranges);

  ByteRangesParser parser =
      in.single_part ? ByteRangesParser::single_part(in.start) : ByteRangesParser::multipart();
  std::vector<Piece> got;
  size_t chunk_at = 0;
  bool ok = true;
  for (const size_t len : chunking(in.body.size(), in.chunk_seed)) {
    // An exact-size copy: the parser may keep no pointer into it and read nothing outside it.
    std::unique_ptr<char[]> chunk(new char[len]);
    std::memcpy(chunk.get(), in.body.data() + chunk_at, len);
    const char* lo = chunk.get();
    const bool fed = parser.feed(lo, len, [&](uint64_t pos, const char* d, size_t count) {
      FUZZ_CHECK(ok);  // nothing after the body turned out malformed
      FUZZ_CHECK(count > 0);
      FUZZ_CHECK(d >= lo && count <= len && d - lo <= std::ptrdiff_t(len - count));
      FUZZ_CHECK(count - 1 <= UINT64_MAX - pos);  // the piece does not wrap around 2^64
      push(got, {pos, chunk_at + size_t(d - lo), count});
      scatter.write(pos, d, count);
      for (size_t i = 0; i < ranges.size(); ++i) {
        const uint64_t a = std::max(pos, ranges[i].offset);
        const uint64_t b = std::min(pos + (count - 1), ranges[i].offset + ranges[i].length - 1);
        for (uint64_t p = a; p <= b && a <= b; ++p) {
          model[i][p - ranges[i].offset] = d[p - pos];
          covered[i][p - ranges[i].offset] = true;
        }
      }
    });
    FUZZ_CHECK(fed == !parser.malformed());
    if (!ok) FUZZ_CHECK(!fed);  // malformed stays malformed
    ok = fed;
    chunk_at += len;
  }
  FUZZ_CHECK(ok == !parser.malformed());
  // The pieces and the verdict match the reference's.
  FUZZ_CHECK(got == expected.pieces);
  FUZZ_CHECK(parser.malformed() == expected.malformed);
  // A malformed parser takes no more.
  const char tail[] = "\r\n--b\r\nContent-Range: bytes 0-0/1\r\n\r\nx";
  if (parser.malformed())
    FUZZ_CHECK(!parser.feed(tail, sizeof tail - 1,
                            [](uint64_t, const char*, size_t) { FUZZ_CHECK(false); }));

  for (size_t i = 0; i < ranges.size(); ++i) {
    uint64_t n = 0;
    for (size_t p = 0; p < covered[i].size(); ++p) {
      if (!covered[i][p]) continue;
      ++n;
      FUZZ_CHECK(buffers[i][p] == model[i][p]);
    }
    FUZZ_CHECK(scatter.filled(i) == n);  // complete only when every byte was written
  }

  // The Content-Range parser alone, on a header block (the body up to its first blank line, or its
  // first bytes) with nothing readable after it.
  const size_t blank = in.body.find("\r\n\r\n");
  const size_t n = blank == std::string::npos ? std::min(in.body.size(), kMax) : blank + 2;
  const GuardedCopy block(std::string_view(in.body).substr(0, n));
  uint64_t s1 = 0, l1 = 0, s2 = 0, l2 = 0;
  const bool r1 = tpf::stream::parse_content_range(block.data(), n, s1, l1);
  const bool r2 = reference_content_range(std::string_view(block.data(), n), s2, l2);
  FUZZ_CHECK(r1 == r2);
  if (r1) FUZZ_CHECK(s1 == s2 && l1 == l2);
  return 0;
}
