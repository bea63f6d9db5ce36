// HTTP(S) range reads and S3 objects through libcurl, run by the process's HTTP engine
// (curl_engine.h): a source's reads are requests on the engine's event loop, at most
// max_connections of them at once, sharing its connections. Every request has connect, total and
// stall timeouts and is retried with backoff on connection errors, 5xx, 429 and short reads.
#include <strings.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "stream/curl_engine.h"
#include "stream/multipart.h"
#include "stream/sources.h"
#include "tpf/error.h"

namespace tpf::stream {

namespace {

using Headers = std::vector<std::pair<std::string, std::string>>;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

// Event loops a source spreads its requests over: `asked`, or for 0 one per 4 cores, 1 to 4 (a loop
// handles well over 100,000 records a second; more than the cores leave for it would only
// contend).
size_t http_threads(int asked) {
  if (asked > 0) return size_t(asked);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return std::clamp<size_t>(cores / 4, 1, 4);
}

std::string amz_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[17];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

// Where an S3 object lives and how to sign for it.
struct S3Target {
  AwsCredentials creds;
  std::string host;  // as sent in the Host header
  std::string path;  // percent-encoded
};

// What the answer to a range request turned out to be, decided at its first body byte.
enum class Answer {
  none,         // no body yet
  ranges,       // a 206 with the ranges (multipart, or one part at its Content-Range)
  full_body,    // a 200 with the whole object, the ranges within full_body_max_bytes of its start
  too_far,      // a 200 with the whole object, the ranges further in: stopped, asked again
  not_whole,    // a 200 whose body is not the whole object: stopped, asked again
  wrong_range,  // a 206 whose Content-Range does not start where it should: stopped
  other,        // another status (an error page): its start kept for S3's error code
};

// State shared with curl's callbacks during one attempt.
struct Transfer {
  CURL* handle = nullptr;
  const CancelToken* cancel = nullptr;
  // The ranges asked for (one or more), the bytes of each filled so far, and the parser of the
  // body (multipart/byteranges, or one part at a known offset).
  const std::vector<ByteRange>* ranges = nullptr;
  RangeScatter scatter;
  ByteRangesParser body;
  uint64_t object_size = 0;
  uint64_t full_body_max = 0;
  Answer answer = Answer::none;
  uint64_t body_bytes = 0;
  uint64_t max_body = UINT64_MAX;  // a single-part 206 longer than this sent more than was asked
  int64_t content_length = -1;
  bool overflow = false;
  bool stopped_early = false;  // a full body, stopped once every range was filled
  std::string error_body;      // the start of an error page (never shown: S3's <Code> is)
  double retry_after_s = 0;
  std::optional<uint64_t> content_range_start;
  bool multipart_type = false;  // Content-Type: multipart/byteranges
};

uint64_t end_of(const std::vector<ByteRange>& ranges) {
  uint64_t end = 0;
  for (const ByteRange& r : ranges) end = std::max(end, r.offset + r.length);
  return end;
}

// Header lines arrive whole, ending in CRLF.
size_t on_header(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t len = size * n;
  auto is = [&](const char* name) {
    const size_t k = std::strlen(name);
    return len > k && ::strncasecmp(data, name, k) == 0;
  };
  // A copy of the value, NUL-terminated for the number parsers (values we read are short).
  auto value = [&](size_t skip) {
    return std::string(data + skip, std::min<size_t>(len - skip, 256));
  };
  if (is("retry-after:")) {
    t->retry_after_s = std::strtod(value(12).c_str(), nullptr);
  } else if (is("content-type:")) {
    const std::string v = value(13);
    const char* type = v.c_str();
    while (*type == ' ') ++type;
    t->multipart_type = ::strncasecmp(type, "multipart/byteranges", 20) == 0;
  } else if (is("content-range:")) {
    const std::string v = value(14);
    const auto bytes = v.find("bytes ");
    if (bytes != std::string::npos)
      t->content_range_start = std::strtoull(v.c_str() + bytes + 6, nullptr, 10);
  }
  return len;
}

// At the first byte of the body: what kind of answer this is, and how to read it.
void decide(Transfer* t) {
  long status = 0;
  curl_easy_getinfo(t->handle, CURLINFO_RESPONSE_CODE, &status);
  curl_off_t length = -1;
  curl_easy_getinfo(t->handle, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length);
  t->content_length = length;
  const auto& ranges = *t->ranges;
  const uint64_t first = ranges.front().offset, end = end_of(ranges);
  if (status == 206) {
    if (t->multipart_type) {
      t->answer = Answer::ranges;
      t->body = ByteRangesParser::multipart();
    } else if (ranges.size() == 1 || t->content_range_start) {
      // One part: the range asked for, or (several asked for) the server's merge of them.
      const uint64_t start = t->content_range_start.value_or(first);
      if (ranges.size() == 1 ? start != first : start > first) {
        t->answer = Answer::wrong_range;
        return;
      }
      t->answer = Answer::ranges;
      t->body = ByteRangesParser::single_part(start);
      t->max_body = end - start;
    } else {
      t->answer = Answer::wrong_range;
    }
  } else if (status == 200) {
    if (length < 0 || uint64_t(length) != t->object_size)
      t->answer = Answer::not_whole;
    else if (end > t->full_body_max)
      t->answer = Answer::too_far;
    else {
      t->answer = Answer::full_body;
      t->body = ByteRangesParser::single_part(0);
    }
  } else {
    t->answer = Answer::other;
  }
}

size_t on_body(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t len = size * n;
  if (t->answer == Answer::none) decide(t);
  t->body_bytes += len;
  switch (t->answer) {
    case Answer::ranges:
    case Answer::full_body: {
      if (t->body_bytes > t->max_body) {
        t->overflow = true;
        return 0;  // aborts the transfer: the server sent more than it was asked for
      }
      const bool ok = t->body.feed(data, len, [t](uint64_t pos, const char* part, size_t k) {
        t->scatter.write(pos, part, k);
      });
      if (!ok) return 0;
      // A whole object is read only as far as the ranges asked for.
      if (t->answer == Answer::full_body && t->scatter.complete() &&
          int64_t(t->body_bytes) < t->content_length) {
        t->stopped_early = true;
        return 0;
      }
      return len;
    }
    case Answer::other:
      if (t->error_body.size() < 1024)
        t->error_body.append(data, std::min(len, 1024 - t->error_body.size()));
      return t->body_bytes > (64u << 10) ? 0 : len;  // an error page is short; stop a long one
    default: return 0;                               // stops the transfer: nothing in it is used
  }
}

int on_progress(void* user, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  const auto* t = static_cast<Transfer*>(user);
  return t->cancel && t->cancel->cancelled() ? 1 : 0;
}

bool retryable_curl_error(CURLcode code) {
  switch (code) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_WEIRD_SERVER_REPLY: return true;
    default: return false;
  }
}

Outcome classify(CURLcode code, long status, const Transfer& t, const std::string& detail) {
  if (code != CURLE_OK && code != CURLE_WRITE_ERROR) {
    Outcome o{retryable_curl_error(code) ? Outcome::retry : Outcome::fatal,
              std::string("transfer error: ") + curl_easy_strerror(code) + detail};
    if (code == CURLE_ABORTED_BY_CALLBACK) o.message = "cancelled";
    return o;
  }
  if (status == 429 || status >= 500)
    return {Outcome::retry, "HTTP " + std::to_string(status), t.retry_after_s};
  return {Outcome::ok, ""};
}

// " (S3 error code AccessDenied)" when an error page is S3's XML, else "": the body itself is never
// put in a message (it may be anything, binary included).
std::string s3_error_code(const std::string& body) {
  const auto open = body.find("<Code>");
  if (open == std::string::npos) return "";
  std::string code;
  for (size_t i = open + 6; i < body.size() && code.size() < 64; ++i) {
    const char c = body[i];
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.') break;
    code += c;
  }
  return code.empty() ? "" : " (S3 error code " + code + ")";
}

class HttpSource;

// One request of a source: a HEAD, or a GET of one or several ranges.
struct HttpRequest final : Request {
  enum class Kind { head, ranges };
  HttpRequest(const HttpSource* s, Kind k) : source(s), kind(k) {}
  ~HttpRequest() override { curl_slist_free_all(headers); }
  void prepare(CURL* handle) override;
  Outcome judge(CURL* handle, CURLcode code) override;

  const HttpSource* source;
  Kind kind;
  std::vector<ByteRange> ranges;
  uint64_t* size_out = nullptr;  // head: where the size goes
  // Several ranges answered with 200 and a body not worth reading that far: fetch them one by one.
  bool split = false;
  uint64_t seq = 0;  // the source's count of range requests started before this one
  Transfer t;
  curl_slist* headers = nullptr;
};

class HttpSource final : public CancellableSource {
 public:
  HttpSource(std::string url, std::string display_name, const SourceOptions& options,
             std::optional<S3Target> s3)
      : url_(std::move(url)),
        name_(std::move(display_name)),
        options_(options),
        s3_(std::move(s3)) {
    TPF_CHECK(options.max_connections >= 1,
              "max_connections: expected >= 1, got " + std::to_string(options.max_connections));
    TPF_CHECK(options.max_attempts >= 1,
              "max_attempts: expected >= 1, got " + std::to_string(options.max_attempts));
    TPF_CHECK(options.http_threads >= 0, "http_threads: expected >= 0 (0: automatic), got " +
                                             std::to_string(options.http_threads));
    // One lane per event loop, the connections split between them (none of them without one).
    const size_t loops =
        std::min<size_t>(http_threads(options.http_threads), size_t(options.max_connections));
    const auto engines = CurlEngine::pool(loops);
    lanes_ = std::make_unique<Lane[]>(loops);
    num_lanes_ = loops;
    for (size_t i = 0; i < loops; ++i) {
      lanes_[i].engine = engines[i];
      lanes_[i].slots.limit = int(size_t(options.max_connections) / loops +
                                  (i < size_t(options.max_connections) % loops ? 1 : 0));
    }
    if (options.expected_size) {
      size_ = options.expected_size;
    } else {
      Lane& lane = next_lane();
      auto head = new_request(HttpRequest::Kind::head, "HEAD", nullptr, lane);
      head->size_out = &size_;
      lane.engine->run(std::move(head));
    }
  }

  uint64_t size() const override { return size_; }
  std::string name() const override { return name_; }
  bool asynchronous() const override { return true; }

  // S3 answers one range per request; plain HTTP servers (nginx) answer several at once. After
  // several multi-range requests in a row were refused, one range per request for a spell of
  // requests (doubling with each spell that ends in another refusal), then a multi-range request
  // again: one refusal now and then (a proxy, a cache miss) costs nothing, a server that never
  // answers them costs a probe per spell.
  size_t ranges_per_request() const override {
    if (s3_ || started_.load(std::memory_order_relaxed) < single_until_.load()) return 1;
    return kMaxRangesPerRequest;
  }

  SourceStats stats() const override {
    SourceStats s;
    s.retries = retries_.load();
    s.full_body_answers = full_body_answers_.load();
    s.multi_range_refused = multi_range_refused_.load();
    s.single_range_spells = single_range_spells_.load();
    s.multi_range_probes = multi_range_probes_.load();
    return s;
  }

  void read_cancellable(uint64_t offset, size_t length, void* dst,
                        const CancelToken* cancel) const override {
    read_ranges({{offset, length, dst}}, cancel);
  }

  void read_ranges(const std::vector<ByteRange>& ranges, const CancelToken* cancel) const override {
    for (const ByteRange& r : ranges) check_range(*this, r.offset, r.length);
    if (CurlEngine::on_any_engine_thread())
      throw Error("a blocking read of '" + name_ +
                  "' was started on the HTTP engine's own thread, which would wait for itself");
    wait_for([&](Done done) { start_ranges(ranges, cancel, std::move(done)); });
  }

  void start_ranges(std::vector<ByteRange> ranges, const CancelToken* cancel,
                    Done done) const override {
    try {
      for (const ByteRange& r : ranges) check_range(*this, r.offset, r.length);
    } catch (...) {
      return done(std::current_exception());
    }
    ranges.erase(std::remove_if(ranges.begin(), ranges.end(),
                                [](const ByteRange& r) { return r.length == 0; }),
                 ranges.end());
    if (ranges.empty()) return done(nullptr);
    if (ranges.size() == 1 || ranges_per_request() == 1)
      return start_each(std::move(ranges), cancel, std::move(done));
    if (probe_next_.exchange(false)) multi_range_probes_.fetch_add(1);
    const uint64_t seq = started_.fetch_add(1, std::memory_order_relaxed);
    Lane& lane = next_lane();
    auto req = new_request(HttpRequest::Kind::ranges, std::to_string(ranges.size()) + "-range GET",
                           cancel, lane);
    req->ranges = std::move(ranges);
    req->seq = seq;
    HttpRequest* raw = req.get();
    req->done = [this, raw, cancel, done = std::move(done)](std::exception_ptr error) mutable {
      if (error || !raw->split) return done(error);
      start_each(std::move(raw->ranges), cancel, std::move(done));
    };
    lane.engine->submit(std::move(req));
  }

  void prepare(HttpRequest& req, CURL* h) const {
    curl_slist_free_all(req.headers);
    req.headers = nullptr;
    req.t = Transfer();
    Transfer& t = req.t;
    t.handle = h;
    t.cancel = req.cancel;
    Headers extra;
    if (req.kind == HttpRequest::Kind::ranges) {
      t.ranges = &req.ranges;
      t.scatter = RangeScatter(req.ranges);
      t.object_size = size_;
      t.full_body_max = options_.full_body_max_bytes;
      std::string spec = "bytes=";
      for (size_t i = 0; i < req.ranges.size(); ++i) {
        if (i) spec += ',';
        spec += std::to_string(req.ranges[i].offset);
        spec += '-';
        spec += std::to_string(req.ranges[i].offset + req.ranges[i].length - 1);
      }
      extra.emplace_back("Range", std::move(spec));
    }
    const bool head = req.kind == HttpRequest::Kind::head;
    curl_easy_setopt(h, CURLOPT_URL, url_.c_str());
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, long(options_.connect_timeout_s * 1000));
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, long(options_.request_timeout_s * 1000));
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1024L);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, std::max(1L, long(options_.stall_timeout_s)));
    curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &t);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &t);
    curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(h, CURLOPT_XFERINFODATA, &t);
    if (head) curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    Headers headers = extra;
    if (s3_) {
      const Headers signed_headers =
          sigv4_headers(s3_->creds, head ? "HEAD" : "GET", s3_->host, s3_->path, extra, amz_now());
      headers.insert(headers.end(), signed_headers.begin(), signed_headers.end());
    }
    for (const auto& [k, v] : headers)
      req.headers = curl_slist_append(req.headers, (k + ": " + v).c_str());
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, req.headers);
  }

  Outcome judge(HttpRequest& req, CURL* h, CURLcode code) const {
    long status = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
    const Transfer& t = req.t;
    if (req.kind == HttpRequest::Kind::head) {
      Outcome o = classify(code, status, t, "");
      if (o.kind != Outcome::ok) return o;
      if (status != 200)
        return {Outcome::fatal, "HTTP " + std::to_string(status) + " (expected 200)"};
      curl_off_t length = -1;
      curl_easy_getinfo(h, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length);
      if (length < 0) return {Outcome::fatal, "the response carries no Content-Length"};
      *req.size_out = static_cast<uint64_t>(length);
      return o;
    }
    const bool several = req.ranges.size() > 1;
    switch (t.answer) {
      case Answer::too_far:
      case Answer::not_whole: {
        const std::string what =
            t.answer == Answer::too_far
                ? "HTTP 200 with the whole object (" + std::to_string(size_) +
                      " bytes) instead of the range; the bytes asked for end at byte " +
                      std::to_string(end_of(req.ranges)) + ", past full_body_max_bytes (" +
                      std::to_string(options_.full_body_max_bytes) + ")"
                : "HTTP 200 with a body of " + std::to_string(t.content_length) +
                      " bytes, neither the range asked for nor the whole object (" +
                      std::to_string(size_) + " bytes)";
        if (several) {
          note_multi_refused(req.seq);
          req.split = true;  // asked again one range at a time
          return {Outcome::ok, ""};
        }
        return {Outcome::retry, what};
      }
      case Answer::wrong_range:
        return {Outcome::retry, "a 206 answer whose Content-Range is not the range asked for"};
      default: break;
    }
    if (t.overflow) return {Outcome::retry, "the server sent more than the range asked for"};
    if (t.body.malformed()) return {Outcome::retry, "a malformed multipart/byteranges answer"};
    Outcome o = classify(
        code, status, t,
        t.body_bytes ? " after " + std::to_string(t.body_bytes) + " bytes of body" : std::string());
    if (o.kind != Outcome::ok) return o;
    if (status != 206 && status != 200)
      return {Outcome::fatal, "HTTP " + std::to_string(status) + " (expected 206 Partial Content)" +
                                  s3_error_code(t.error_body)};
    if (status == 200 && t.answer != Answer::full_body)
      return {Outcome::retry, "HTTP 200 without a body"};
    for (size_t i = 0; i < req.ranges.size(); ++i)
      if (t.scatter.filled(i) < req.ranges[i].length)
        return {Outcome::retry,
                "short read: bytes " + std::to_string(req.ranges[i].offset) + "-" +
                    std::to_string(req.ranges[i].offset + req.ranges[i].length - 1) + " got " +
                    std::to_string(t.scatter.filled(i)) + " of " +
                    std::to_string(req.ranges[i].length)};
    if (t.answer == Answer::full_body) {
      full_body_answers_.fetch_add(1, std::memory_order_relaxed);
      if (several) note_multi_refused(req.seq);
    } else if (several) {
      refused_in_row_.store(0, std::memory_order_relaxed);
      spells_since_ok_.store(0, std::memory_order_relaxed);
      spell_.store(kFirstSpell, std::memory_order_relaxed);
    }
    return o;
  }

 private:
  // A connection limit and the event loop that runs its requests.
  struct Lane {
    std::shared_ptr<CurlEngine> engine;
    Slots slots;  // touched only by that engine's thread
  };

  // Requests go to the lanes in turn.
  Lane& next_lane() const {
    return lanes_[next_lane_.fetch_add(1, std::memory_order_relaxed) % num_lanes_];
  }

  std::unique_ptr<HttpRequest> new_request(HttpRequest::Kind kind, std::string what,
                                           const CancelToken* cancel, Lane& lane) const {
    auto req = std::make_unique<HttpRequest>(this, kind);
    req->what = std::move(what);
    req->source_name = name_;
    req->cancel = cancel;
    req->retry = {options_.max_attempts, options_.backoff_base_s, options_.backoff_max_s,
                  options_.retry_deadline_s};
    req->slots = &lane.slots;
    req->retries = &retries_;
    return req;
  }

  // A multi-range request answered with 200: after kRefusalsInRow of them in a row, a spell of
  // single-range requests; once a spell was needed, the probe after it alone decides.
  void note_multi_refused(uint64_t seq) const {
    multi_range_refused_.fetch_add(1, std::memory_order_relaxed);
    // A request started before the spell ended was not its probe.
    if (seq < single_until_.load()) return;
    const int needed = spells_since_ok_.load() > 0 ? 1 : kRefusalsInRow;
    if (refused_in_row_.fetch_add(1) + 1 < needed) return;
    refused_in_row_.store(0);
    spells_since_ok_.fetch_add(1);
    const uint64_t spell = spell_.load();
    spell_.store(std::min(spell * 2, kMaxSpell));
    single_until_.store(started_.load() + spell);
    single_range_spells_.fetch_add(1, std::memory_order_relaxed);
    probe_next_.store(true);
  }

  // One request per range, all in flight together; `done` once all have ended (with the first
  // error, if any).
  void start_each(std::vector<ByteRange> ranges, const CancelToken* cancel, Done done) const {
    struct Join {
      std::mutex mutex;
      size_t left;
      std::exception_ptr error;
      Done done;
    };
    auto join = std::make_shared<Join>();
    join->left = ranges.size();
    join->done = std::move(done);
    started_.fetch_add(ranges.size(), std::memory_order_relaxed);
    for (const ByteRange& r : ranges) {
      Lane& lane = next_lane();
      auto req = new_request(
          HttpRequest::Kind::ranges,
          "GET bytes " + std::to_string(r.offset) + "-" + std::to_string(r.offset + r.length - 1),
          cancel, lane);
      req->ranges = {r};
      req->done = [join](std::exception_ptr error) {
        bool last;
        {
          std::lock_guard<std::mutex> lock(join->mutex);
          if (error && !join->error) join->error = error;
          last = --join->left == 0;
        }
        if (last) join->done(join->error);
      };
      lane.engine->submit(std::move(req));
    }
  }

  // A Range header of this many ranges stays under 4 KiB, inside servers' limits on a header line
  // (nginx: 8 KiB, Apache: 8190 bytes) and on ranges per request (Apache's MaxRanges is 200).
  static constexpr size_t kMaxRangesPerRequest = 128;
  // Refused multi-range requests in a row that start a spell of single ranges, and the spell's
  // length in requests: the first, and the longest it doubles to.
  static constexpr int kRefusalsInRow = 3;
  static constexpr uint64_t kFirstSpell = 64, kMaxSpell = 4096;

  std::string url_, name_;
  SourceOptions options_;
  std::optional<S3Target> s3_;
  uint64_t size_ = 0;
  std::unique_ptr<Lane[]> lanes_;  // never moved: requests point at their lane's slots
  size_t num_lanes_ = 0;
  mutable std::atomic<uint64_t> next_lane_{0};
  // Range requests started, and the count below which requests carry one range each.
  mutable std::atomic<uint64_t> started_{0}, single_until_{0};
  mutable std::atomic<int> refused_in_row_{0}, spells_since_ok_{0};
  mutable std::atomic<uint64_t> spell_{kFirstSpell};
  mutable std::atomic<bool> probe_next_{false};
  mutable std::atomic<uint64_t> retries_{0}, full_body_answers_{0}, multi_range_refused_{0},
      single_range_spells_{0}, multi_range_probes_{0};
};

void HttpRequest::prepare(CURL* handle) { source->prepare(*this, handle); }

Outcome HttpRequest::judge(CURL* handle, CURLcode code) {
  return source->judge(*this, handle, code);
}

// "http://host:port/path" -> "host:port"
std::string authority_of(const std::string& url) {
  const auto scheme = url.find("://");
  const auto start = scheme == std::string::npos ? 0 : scheme + 3;
  const auto end = url.find('/', start);
  return url.substr(start, end == std::string::npos ? std::string::npos : end - start);
}

}  // namespace

std::unique_ptr<CancellableSource> open_http_source(const std::string& url,
                                                    const SourceOptions& options) {
  return std::make_unique<HttpSource>(url, url, options, std::nullopt);
}

std::unique_ptr<CancellableSource> open_s3_source(const std::string& url,
                                                  const SourceOptions& options) {
  const std::string rest = url.substr(5);
  const auto slash = rest.find('/');
  if (slash == std::string::npos || slash == 0 || slash + 1 == rest.size())
    throw Error("location '" + url + "': expected s3://bucket/key");
  const std::string bucket = rest.substr(0, slash), key = rest.substr(slash + 1);

  S3Target s3;
  s3.creds.access_key = env("AWS_ACCESS_KEY_ID");
  s3.creds.secret_key = env("AWS_SECRET_ACCESS_KEY");
  s3.creds.session_token = env("AWS_SESSION_TOKEN");
  s3.creds.region = env("AWS_REGION");
  if (s3.creds.region.empty()) s3.creds.region = env("AWS_DEFAULT_REGION");
  if (s3.creds.region.empty()) s3.creds.region = "us-east-1";
  if (s3.creds.access_key.empty() || s3.creds.secret_key.empty())
    throw Error("location '" + url +
                "': S3 needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment");

  std::string endpoint = env("AWS_ENDPOINT_URL_S3");
  if (endpoint.empty()) endpoint = env("AWS_ENDPOINT_URL");
  std::string request_url;
  if (!endpoint.empty()) {
    while (!endpoint.empty() && endpoint.back() == '/') endpoint.pop_back();
    s3.host = authority_of(endpoint);
    s3.path = "/" + bucket + "/" + uri_encode_path(key);
    request_url = endpoint + s3.path;
  } else {
    s3.host = bucket + ".s3." + s3.creds.region + ".amazonaws.com";
    s3.path = "/" + uri_encode_path(key);
    request_url = "https://" + s3.host + s3.path;
  }
  return std::make_unique<HttpSource>(request_url, url + " (" + request_url + ")", options,
                                      std::move(s3));
}

}  // namespace tpf::stream
