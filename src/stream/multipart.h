// Internal: the body of a 206 answer to a multi-range GET, parsed as it streams in. The body is a
// multipart/byteranges body (part headers, each with a Content-Range, then that part's bytes) or,
// where the server merged the ranges, one part at the answer's Content-Range; its bytes are copied
// into the ranges asked for. No libcurl here: the HTTP source (http_source.cpp) feeds it curl's
// chunks, and the unit tests and the fuzzer (tests/fuzz/multipart_fuzz.cpp) feed it directly.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tpf/stream.h"

namespace tpf::stream {

// "... Content-Range: bytes A-B/N ..." among the CRLF-separated header lines [text, text + n) ->
// start A, length B - A + 1. false when no line starts with Content-Range or its value does not
// parse (A and B are plain decimal numbers, B >= A, and the length fits in 64 bits). Reads nothing
// outside [text, text + n).
bool parse_content_range(const char* text, size_t n, uint64_t& start, uint64_t& length);

// The parser of one body. feed() hands each piece of part data to a sink as (file offset, bytes,
// count); the bytes lie inside the chunk being fed. A part header block (the boundary line and the
// part's headers, up to the blank line) longer than kMaxPartHeader, or one without a Content-Range
// that parses, makes the body malformed: feed() returns false from then on and hands out nothing.
class ByteRangesParser {
 public:
  static constexpr size_t kMaxPartHeader = 8192;

  // A multipart/byteranges body.
  static ByteRangesParser multipart();
  // A single-part body: all of it belongs at file offset `start` (the answer's Content-Range). One
  // that runs past offset 2^64 - 1 is malformed.
  static ByteRangesParser single_part(uint64_t start);

  // Feeds the next `n` bytes of the body; sink(uint64_t pos, const char* data, size_t count) is
  // called for each piece of part data among them, in order. Returns !malformed().
  template <class Sink>
  bool feed(const char* data, size_t n, Sink&& sink) {
    while (n > 0 && !malformed_) {
      Piece piece;
      const size_t used = step(data, n, piece);
      if (piece.count) sink(piece.pos, piece.data, piece.count);
      data += used;
      n -= used;
    }
    return !malformed_;
  }

  bool malformed() const { return malformed_; }

 private:
  struct Piece {
    uint64_t pos = 0;
    const char* data = nullptr;
    size_t count = 0;
  };
  // Consumes the start of [data, data + n): part data (into `piece`) or part header bytes; returns
  // how many bytes it used.
  size_t step(const char* data, size_t n, Piece& piece);

  bool single_ = false;
  bool in_part_ = false;
  uint64_t part_pos_ = 0, part_left_ = 0;
  std::string part_header_;  // gathered between parts, bounded by kMaxPartHeader
  bool malformed_ = false;
};

// The ranges one multi-range GET asked for (disjoint, sorted by offset; they must outlive this),
// and the bytes of each that the answer has filled so far. Bytes written twice (a server that sends
// a part twice, or overlapping parts) count once: a range is filled only when all of it was written.
class RangeScatter {
 public:
  RangeScatter() = default;
  explicit RangeScatter(const std::vector<ByteRange>& ranges);

  // Copies body bytes that sit at file offset `pos` into every range they overlap.
  void write(uint64_t pos, const char* data, size_t n);

  // Bytes of range i filled so far (each counted once).
  uint64_t filled(size_t i) const { return filled_[i]; }
  // True once every byte of every range was written.
  bool complete() const { return missing_ == 0; }

 private:
  struct Span {
    uint64_t lo, hi;  // [lo, hi) within the range
  };
  const std::vector<ByteRange>* ranges_ = nullptr;
  std::vector<uint64_t> filled_;
  uint64_t missing_ = 0;  // bytes of all ranges not written yet
  // Per range: while its bytes came in order from its start, how many (the usual case, kept
  // without allocating); kOutOfOrder once a write did not continue them, and from then on
  // written_ holds what was written (disjoint, sorted, not touching spans).
  static constexpr uint64_t kOutOfOrder = UINT64_MAX;
  std::vector<uint64_t> in_order_;
  std::vector<std::vector<Span>> written_;
};

}  // namespace tpf::stream
