// The parser of multi-range answers (stream/multipart.h) on hand-made bodies: nginx's answers, the
// broken ones the stream tests serve (parts one byte off, parts without Content-Range, huge part
// headers), single-part answers, and every place curl may cut a body into chunks.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "multipart_test_util.h"
#include "stream/multipart.h"

namespace tpf::stream {
namespace {

using testing::content_range;
using testing::file_bytes;
using testing::kEnd;
using testing::part;

// Ranges asked for, with buffers of their own (filled with '?' to show bytes never written).
struct Request {
  std::vector<std::string> buffers;
  std::vector<ByteRange> ranges;
  RangeScatter scatter;

  explicit Request(const std::vector<std::pair<uint64_t, uint64_t>>& spans) {
    for (const auto& [offset, length] : spans) buffers.emplace_back(length, '?');
    for (size_t i = 0; i < spans.size(); ++i)
      ranges.push_back({spans[i].first, spans[i].second, buffers[i].data()});
    scatter = RangeScatter(ranges);
  }

  // Feeds `body` in chunks cut at `cuts` (offsets into body); returns what feed() last said.
  bool feed(ByteRangesParser& parser, const std::string& body, std::vector<size_t> cuts = {}) {
    cuts.push_back(body.size());
    size_t at = 0;
    bool ok = true;
    for (size_t cut : cuts) {
      ok = parser.feed(body.data() + at, cut - at, [&](uint64_t pos, const char* data, size_t n) {
        EXPECT_GE(data, body.data() + at);
        EXPECT_LE(data + n, body.data() + cut);
        scatter.write(pos, data, n);
      });
      at = cut;
    }
    return ok;
  }

  bool complete(size_t i) const { return scatter.filled(i) == ranges[i].length; }
  bool correct(size_t i) const {
    return buffers[i] == file_bytes(ranges[i].offset, ranges[i].length);
  }
};

TEST(StreamMultipart, NginxAnswerFillsEveryRangeWhereverTheChunksEnd) {
  const std::vector<std::pair<uint64_t, uint64_t>> spans = {{10, 100}, {200, 50}, {250, 7}};
  std::string body;
  for (const auto& [offset, length] : spans) body += part(offset, offset + length - 1);
  body += kEnd;
  // One chunk, one byte a chunk, and two chunks cut at every place.
  std::vector<std::vector<size_t>> cuttings = {{}, {}};
  for (size_t i = 1; i < body.size(); ++i) cuttings[1].push_back(i);
  for (size_t i = 1; i < body.size(); ++i) cuttings.push_back({i});
  for (const auto& cuts : cuttings) {
    Request req(spans);
    auto parser = ByteRangesParser::multipart();
    ASSERT_TRUE(req.feed(parser, body, cuts)) << cuts.size() << " cuts, first " << cuts[0];
    for (size_t i = 0; i < spans.size(); ++i) {
      ASSERT_TRUE(req.complete(i)) << "range " << i << ", first cut " << cuts[0];
      ASSERT_TRUE(req.correct(i)) << "range " << i << ", first cut " << cuts[0];
    }
  }
}

TEST(StreamMultipart, MergedPartsAndSinglePartAnswersCoverSeveralRanges) {
  const std::vector<std::pair<uint64_t, uint64_t>> spans = {{10, 100}, {130, 20}};
  {
    Request req(spans);
    auto parser = ByteRangesParser::multipart();
    EXPECT_TRUE(req.feed(parser, part(0, 199) + kEnd));
    EXPECT_TRUE(req.complete(0) && req.complete(1) && req.correct(0) && req.correct(1));
  }
  {
    Request req(spans);
    auto parser = ByteRangesParser::single_part(10);
    EXPECT_TRUE(req.feed(parser, file_bytes(10, 140), {1, 77}));
    EXPECT_TRUE(req.complete(0) && req.complete(1) && req.correct(0) && req.correct(1));
  }
}

TEST(StreamMultipart, SinglePartPastTheLastOffsetIsMalformed) {
  // Found by multipart_fuzz: a single-part answer's offsets wrapped around 2^64, so a Content-Range
  // near the end of the offsets put the rest of the body into the ranges at offset 0.
  const std::vector<std::pair<uint64_t, uint64_t>> spans = {{0, 8}};
  for (const std::vector<size_t>& cuts : {std::vector<size_t>{}, {2}, {3}}) {
    Request req(spans);
    auto parser = ByteRangesParser::single_part(UINT64_MAX - 2);  // room for 3 bytes
    EXPECT_TRUE(req.feed(parser, file_bytes(0, 3), cuts));
    EXPECT_FALSE(req.feed(parser, file_bytes(3, 5)));
    EXPECT_TRUE(parser.malformed());
    EXPECT_EQ(req.scatter.filled(0), 0u);
    EXPECT_EQ(req.buffers[0], std::string(8, '?'));
  }
  Request req(spans);
  auto parser = ByteRangesParser::single_part(UINT64_MAX);
  EXPECT_FALSE(req.feed(parser, file_bytes(0, 8)));
  EXPECT_EQ(req.scatter.filled(0), 0u);
}

TEST(StreamMultipart, PartsOneByteOffLeaveARangeShort) {
  const std::vector<std::pair<uint64_t, uint64_t>> spans = {{10, 100}, {200, 50}};
  std::string body;
  for (const auto& [offset, length] : spans) body += part(offset + 1, offset + length);
  Request req(spans);
  auto parser = ByteRangesParser::multipart();
  EXPECT_TRUE(req.feed(parser, body + kEnd));
  EXPECT_EQ(req.scatter.filled(0), 99u);
  EXPECT_EQ(req.scatter.filled(1), 49u);
  // The bytes that did arrive are the file's, at their places; the first byte was never written.
  EXPECT_EQ(req.buffers[0][0], '?');
  EXPECT_EQ(req.buffers[0].substr(1), file_bytes(11, 99));
}

TEST(StreamMultipart, BytesWrittenTwiceCountOnce) {
  // Found by multipart_fuzz: the first half of a range sent twice counted as the whole range, so
  // the request passed with half its bytes never written.
  const std::vector<std::pair<uint64_t, uint64_t>> spans = {{10, 100}, {200, 50}};
  {
    Request req(spans);
    auto parser = ByteRangesParser::multipart();
    EXPECT_TRUE(req.feed(parser, part(10, 59) + part(10, 59) + kEnd, {80}));
    EXPECT_EQ(req.scatter.filled(0), 50u);
    EXPECT_EQ(req.scatter.filled(1), 0u);
  }
  {
    Request req(spans);
    auto parser = ByteRangesParser::multipart();
    EXPECT_TRUE(req.feed(parser, part(10, 109) + part(10, 109) + kEnd));
    EXPECT_EQ(req.scatter.filled(0), 100u);
  }
  // Overlapping parts, out of order, and ones that only touch: each byte once.
  Request req(spans);
  auto parser = ByteRangesParser::multipart();
  EXPECT_TRUE(req.feed(parser, part(60, 89) + part(10, 39) + part(30, 69) + part(95, 109) +
                                   part(205, 209) + part(90, 94) + part(100, 210) + kEnd));
  EXPECT_TRUE(req.complete(0) && req.correct(0));
  EXPECT_EQ(req.scatter.filled(1), 11u);
}

TEST(StreamMultipart, PartWithoutContentRangeIsMalformed) {
  Request req({{10, 100}, {200, 50}});
  auto parser = ByteRangesParser::multipart();
  const std::string body = part(10, 109) + part(200, 249, "") + kEnd;
  EXPECT_FALSE(req.feed(parser, body, {7}));
  EXPECT_TRUE(parser.malformed());
  EXPECT_TRUE(req.complete(0) && req.correct(0));  // the part before it was read
  EXPECT_EQ(req.scatter.filled(1), 0u);
  // Malformed stays malformed, and nothing more is handed out.
  EXPECT_FALSE(req.feed(parser, part(200, 249)));
  EXPECT_EQ(req.scatter.filled(1), 0u);
}

TEST(StreamMultipart, PartHeadersOverTheLimitAreMalformed) {
  const std::string first =
      "\r\n--00000000000000000042\r\nContent-Type: application/octet-stream\r\n";
  // The header block, from the boundary line to the blank line, of exactly `size` bytes.
  auto block = [&](size_t size) {
    const std::string fixed = first + content_range(100, 109) + "X-Filler: \r\n\r\n";
    return first + content_range(100, 109) + "X-Filler: " + std::string(size - fixed.size(), 'y') +
           "\r\n\r\n";
  };
  for (size_t size : {ByteRangesParser::kMaxPartHeader, ByteRangesParser::kMaxPartHeader + 1}) {
    const std::string body = block(size) + file_bytes(100, 10) + kEnd;
    ASSERT_EQ(body.find("\r\n\r\n"), size - 4);
    for (const std::vector<size_t>& cuts : {std::vector<size_t>{}, {size - 2}, {size - 1}}) {
      Request req({{100, 10}});
      auto parser = ByteRangesParser::multipart();
      const bool ok = req.feed(parser, body, cuts);
      EXPECT_EQ(ok, size <= ByteRangesParser::kMaxPartHeader) << size;
      EXPECT_EQ(req.complete(0), ok) << size;
    }
  }
  // The stream tests' flood: 10 KB of header and no blank line.
  Request req({{100, 10}});
  auto parser = ByteRangesParser::multipart();
  EXPECT_FALSE(req.feed(parser, first + "X-Filler: " + std::string(10240, 'x')));
}

TEST(StreamMultipart, BodyMayEndInsideAHeaderBlock) {
  // The closing boundary (and anything short after the last part) is a header block never ended.
  Request req({{100, 10}});
  auto parser = ByteRangesParser::multipart();
  EXPECT_TRUE(req.feed(parser, part(100, 109) + "\r\n--00000000000000000042--\r\n\r"));
  EXPECT_FALSE(parser.malformed());
  EXPECT_TRUE(req.complete(0) && req.correct(0));
}

TEST(StreamMultipart, ContentRangeValues) {
  auto parse = [](const std::string& text) {
    uint64_t start = 7, length = 7;
    const bool ok = parse_content_range(text.data(), text.size(), start, length);
    return ok ? std::to_string(start) + "+" + std::to_string(length) : std::string("no");
  };
  EXPECT_EQ(parse("Content-Range: bytes 100-109/1048576\r\n"), "100+10");
  EXPECT_EQ(parse("--b\r\nX-A: 1\r\ncontent-range:BYTES 0-0/*\r\nX-B: 2\r\n"), "0+1");
  EXPECT_EQ(parse("Content-Range:   bytes 5-5/6\r\n"), "5+1");
  EXPECT_EQ(parse("Content-Range: bytes 18446744073709551614-18446744073709551614/*\r\n"),
            "18446744073709551614+1");
  EXPECT_EQ(parse("Content-Type: text/plain\r\n"), "no");
  EXPECT_EQ(parse("X-Content-Range: bytes 1-2/3\r\n"), "no");  // only at a line's start
  EXPECT_EQ(parse("Content-Range: items 1-2/3\r\n"), "no");
  EXPECT_EQ(parse("Content-Range: bytes */1048576\r\n"), "no");
  EXPECT_EQ(parse("Content-Range: bytes 109-100/1048576\r\n"), "no");
  EXPECT_EQ(parse("Content-Range: bytes -100-109/1048576\r\n"), "no");
  EXPECT_EQ(parse("Content-Range: bytes 100/1048576\r\n"), "no");
  EXPECT_EQ(parse(""), "no");
}

TEST(StreamMultipart, ContentRangeIsPlainDigitsInsideItsText) {
  // Found by multipart_fuzz: strtoull read signs, skipped line breaks and spaces, saturated on
  // overflow, took no digits for 0, and read past the text it was given.
  auto parse = [](const std::string& text, size_t n) {
    uint64_t start = 7, length = 7;
    const bool ok = parse_content_range(text.data(), n, start, length);
    return ok ? std::to_string(start) + "+" + std::to_string(length) : std::string("no");
  };
  auto whole = [&](const std::string& value) {
    const std::string text = "Content-Range: " + value + "\r\n";
    return parse(text, text.size());
  };
  EXPECT_EQ(whole("bytes\t100-109/1048576"), "100+10");
  EXPECT_EQ(whole("bytes100-109/1048576"), "100+10");
  EXPECT_EQ(whole("bytes 18446744073709551615-18446744073709551615/*"), "18446744073709551615+1");
  EXPECT_EQ(whole("bytes +100-109/1048576"), "no");
  EXPECT_EQ(whole("bytes 100--109/1048576"), "no");  // was 100 + 2^64 - 209
  EXPECT_EQ(whole("bytes 100-+109/1048576"), "no");
  EXPECT_EQ(whole("bytes 100- 109/1048576"), "no");
  EXPECT_EQ(whole("bytes 100-99999999999999999999999/1048576"), "no");  // was saturated
  EXPECT_EQ(whole("bytes 18446744073709551616-18446744073709551617/*"), "no");
  EXPECT_EQ(whole("bytes 0-18446744073709551615/*"), "no");  // a length of 2^64 was 0
  EXPECT_EQ(whole("bytes 0-/1048576"), "no");                // was 0-0
  EXPECT_EQ(whole("bytes 100-\r\n109/1048576"), "no");       // was read from the next line
  EXPECT_EQ(whole("bytes\r\n100-109/1048576"), "no");
  // Nothing past n is read: the digits after it are not part of the value.
  const std::string text = "Content-Range: bytes 1-234";
  EXPECT_EQ(parse(text, text.size() - 1), "1+23");
  EXPECT_EQ(parse(text, text.size() - 3), "no");  // "bytes 1-" ends the text
  EXPECT_EQ(parse("Content-Range: bytes 12", 22), "no");
}

TEST(StreamMultipart, BadContentRangeMakesTheBodyMalformed) {
  // A negative last byte once made a part of nearly 2^64 bytes: the next part's header and data
  // were copied into the ranges as file bytes.
  Request req({{100, 10}, {200, 10}});
  auto parser = ByteRangesParser::multipart();
  const std::string body =
      part(100, 109, "Content-Range: bytes 100--109/1048576\r\n") + part(200, 209) + kEnd;
  EXPECT_FALSE(req.feed(parser, body));
  EXPECT_EQ(req.scatter.filled(0), 0u);
  EXPECT_EQ(req.scatter.filled(1), 0u);
}

}  // namespace
}  // namespace tpf::stream
