// The body of a 206 answer to a multi-range GET: multipart/byteranges parsing and the scatter of
// part data into the ranges asked for (multipart.h).
#include "stream/multipart.h"

#include <strings.h>

#include <algorithm>
#include <cstring>

namespace tpf::stream {

namespace {

// The value of header `name` (lower case, with its colon) among the CRLF-separated lines of
// [text, text + n), or nullptr. Only line starts are compared: a part's header block has a few.
const char* header_value(const char* text, size_t n, const char* name) {
  const size_t k = std::strlen(name);
  const char* end = text + n;
  for (const char* line = text; line < end;) {
    if (size_t(end - line) >= k && ::strncasecmp(line, name, k) == 0) return line + k;
    const void* nl = std::memchr(line, '\n', size_t(end - line));
    if (!nl) break;
    line = static_cast<const char*>(nl) + 1;
  }
  return nullptr;
}

// The decimal digits at `at` (one at least, before `end`) -> value, `at` past them; false on none
// or on overflow.
bool read_number(const char*& at, const char* end, uint64_t& value) {
  const char* first = at;
  value = 0;
  for (; at < end && *at >= '0' && *at <= '9'; ++at) {
    const uint64_t digit = uint64_t(*at - '0');
    if (value > (UINT64_MAX - digit) / 10) return false;
    value = value * 10 + digit;
  }
  return at > first;
}

// Adds [lo, hi) to `spans` (disjoint, sorted, not touching); returns how many of its bytes were
// not in them yet. A part's pieces arrive in order, so the usual case extends the last span.
template <class Span>
uint64_t add_span(std::vector<Span>& spans, uint64_t lo, uint64_t hi) {
  if (spans.empty() || spans.back().hi < lo) {
    spans.push_back({lo, hi});
    return hi - lo;
  }
  // The spans that overlap or touch [lo, hi) become one.
  auto first = std::lower_bound(spans.begin(), spans.end(), lo,
                                [](const Span& s, uint64_t v) { return s.hi < v; });
  auto last = first;
  uint64_t merged_lo = lo, merged_hi = hi, before = 0;
  for (; last != spans.end() && last->lo <= hi; ++last) {
    merged_lo = std::min(merged_lo, last->lo);
    merged_hi = std::max(merged_hi, last->hi);
    before += last->hi - last->lo;
  }
  if (first == last) {
    spans.insert(first, {lo, hi});
    return hi - lo;
  }
  *first = {merged_lo, merged_hi};
  spans.erase(first + 1, last);
  return (merged_hi - merged_lo) - before;
}

}  // namespace

bool parse_content_range(const char* text, size_t n, uint64_t& start, uint64_t& length) {
  const char* end = text + n;
  const char* at = header_value(text, n, "content-range:");
  while (at && at < end && *at == ' ') ++at;
  if (!at || end - at < 5 || ::strncasecmp(at, "bytes", 5) != 0) return false;
  at += 5;
  while (at < end && (*at == ' ' || *at == '\t')) ++at;
  // "A-B": digits only (no sign, space or line break), read inside the text, without overflow,
  // and a length that fits.
  uint64_t first = 0, last = 0;
  if (!read_number(at, end, first) || at == end || *at != '-') return false;
  ++at;
  if (!read_number(at, end, last) || last < first || last - first == UINT64_MAX) return false;
  start = first;
  length = last - first + 1;
  return true;
}

ByteRangesParser ByteRangesParser::multipart() {
  ByteRangesParser p;
  // A part's header block is about 100 bytes (nginx); it grows from here up to kMaxPartHeader.
  p.part_header_.reserve(256);
  return p;
}

ByteRangesParser ByteRangesParser::single_part(uint64_t start) {
  ByteRangesParser p;
  p.single_ = true;
  p.in_part_ = true;
  p.part_pos_ = start;
  p.part_left_ = start ? 0 - start : UINT64_MAX;  // up to offset 2^64 - 1
  return p;
}

size_t ByteRangesParser::step(const char* data, size_t n, Piece& piece) {
  if (in_part_) {
    const size_t take = size_t(std::min<uint64_t>(n, part_left_));
    piece = {part_pos_, data, take};
    part_pos_ += take;
    part_left_ -= take;
    if (part_left_ == 0) in_part_ = false;
    return take;
  }
  if (single_) {
    malformed_ = true;  // bytes past the last offset there is
    return 0;
  }
  // Between parts: gather the boundary line and the part's headers up to the blank line, and no
  // further (the part's data that follows in the chunk is handed out, not copied here).
  static constexpr char kBlank[] = "\r\n\r\n";
  const size_t before = part_header_.size();
  const size_t take = std::min(n, kMaxPartHeader - before);
  // Bytes of this chunk up to and including the blank line, when it ends among them. It may begin
  // in the last bytes gathered before: the earliest start counts.
  size_t used = 0;
  for (size_t k = std::min<size_t>(3, before); k >= 1 && !used; --k)
    if (4 - k <= take && std::memcmp(part_header_.data() + before - k, kBlank, k) == 0 &&
        std::memcmp(data, kBlank + k, 4 - k) == 0)
      used = 4 - k;
  if (!used) {
    // memchr from one CR to the next (a part's header block has a few lines): cheaper than
    // memmem, which sets up a table on each call.
    const char* end = data + take;
    for (const char* at = data; end - at >= 4;) {
      const char* cr = static_cast<const char*>(std::memchr(at, '\r', size_t(end - at) - 3));
      if (!cr) break;
      if (cr[1] == '\n' && cr[2] == '\r' && cr[3] == '\n') {
        used = size_t(cr - data) + 4;
        break;
      }
      at = cr + 1;
    }
  }
  if (!used) {
    part_header_.append(data, take);
    if (part_header_.size() >= kMaxPartHeader) malformed_ = true;
    return take;
  }
  part_header_.append(data, used);
  uint64_t start = 0, length = 0;
  // The block without its last CRLF: header lines, each ending in CRLF.
  if (!parse_content_range(part_header_.data(), part_header_.size() - 2, start, length)) {
    malformed_ = true;
    return 0;
  }
  part_header_.clear();
  in_part_ = true;
  part_pos_ = start;
  part_left_ = length;
  return used;
}

RangeScatter::RangeScatter(const std::vector<ByteRange>& ranges)
    : ranges_(&ranges),
      filled_(ranges.size(), 0),
      in_order_(ranges.size(), 0),
      written_(ranges.size()) {
  for (const ByteRange& r : ranges) missing_ += r.length;
}

void RangeScatter::write(uint64_t pos, const char* data, size_t n) {
  const auto& ranges = *ranges_;
  auto it = std::upper_bound(ranges.begin(), ranges.end(), pos,
                             [](uint64_t p, const ByteRange& r) { return p < r.offset; });
  if (it != ranges.begin()) --it;
  for (; it != ranges.end() && it->offset < pos + n; ++it) {
    const uint64_t lo = std::max(pos, it->offset), hi = std::min(pos + n, it->offset + it->length);
    if (lo >= hi) continue;
    std::memcpy(static_cast<uint8_t*>(it->dst) + (lo - it->offset), data + (lo - pos), hi - lo);
    const size_t i = size_t(it - ranges.begin());
    if (in_order_[i] == lo - it->offset) {
      // Continues the bytes written so far from the range's start: all of them are new.
      in_order_[i] = hi - it->offset;
      filled_[i] += hi - lo;
      missing_ -= hi - lo;
      continue;
    }
    if (in_order_[i] != kOutOfOrder) {
      if (in_order_[i] > 0) written_[i].push_back({0, in_order_[i]});
      in_order_[i] = kOutOfOrder;
    }
    const uint64_t added = add_span(written_[i], lo - it->offset, hi - it->offset);
    filled_[i] += added;
    missing_ -= added;
  }
}

}  // namespace tpf::stream
