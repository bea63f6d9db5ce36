// HTTP(S) range reads and S3 objects through libcurl, run by the process's HTTP engine
// (curl_engine.h): a source's reads are requests on the engine's event loop, at most
// max_connections of them at once, sharing its connections. Every request has connect, total and
// stall timeouts and is retried with backoff on connection errors, 5xx, 429 and short reads.
#include <strings.h>

#include <algorithm>
#include <atomic>
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

// State shared with curl's callbacks during one attempt.
struct Transfer {
  CURL* handle = nullptr;
  uint8_t* dst = nullptr;
  uint64_t offset = 0;
  size_t length = 0;
  size_t got = 0;
  bool range_ok = false;  // the status (and Content-Range) say the body is the range asked for
  bool checked = false;
  bool overflow = false;
  std::string error_body;  // the start of a non-range body, for the message
  double retry_after_s = 0;
  std::optional<uint64_t> content_range_start;
  const CancelToken* cancel = nullptr;
  bool multipart_type = false;  // Content-Type: multipart/byteranges
  // Multi-range requests: the ranges asked for, the bytes of each filled so far, and the parser of
  // the body (multipart/byteranges, or one part where the server merged the ranges).
  const std::vector<ByteRange>* ranges = nullptr;
  RangeScatter scatter;
  ByteRangesParser body;
};

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

size_t on_body(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t len = size * n;
  long status = 0;
  if (!t->checked) {
    curl_easy_getinfo(t->handle, CURLINFO_RESPONSE_CODE, &status);
    t->checked = true;
    if (t->ranges) {
      const bool multipart = status == 206 && t->multipart_type;
      // A single-part 206 (the server merged the ranges) is one part at its Content-Range.
      t->range_ok = status == 206 && (multipart || t->content_range_start.has_value());
      if (t->range_ok && !multipart)
        t->body = ByteRangesParser::single_part(*t->content_range_start);
    } else {
      t->range_ok = status == 206 && t->content_range_start.value_or(t->offset) == t->offset;
    }
    if (!t->range_ok && status == 200) {
      // The whole object, not a range: never download it, stop here.
      t->error_body.assign(data, std::min<size_t>(len, 300));
      return 0;
    }
  }
  if (t->ranges) {
    if (t->range_ok) {
      const bool ok = t->body.feed(data, len, [t](uint64_t pos, const char* part, size_t k) {
        t->scatter.write(pos, part, k);
      });
      return ok ? len : 0;
    }
    // Not ranges (an error page): keep its start for the message and stop the transfer.
    t->error_body.append(data, std::min<size_t>(len, 300));
    return 0;
  }
  if (!t->range_ok) {
    // Keep the start of an error page for the message.
    if (t->error_body.size() < 300)
      t->error_body.append(data, std::min(len, 300 - t->error_body.size()));
    return len;
  }
  if (len > t->length - t->got) {
    t->overflow = true;
    return 0;  // aborts the transfer: the server sent more than the range
  }
  std::memcpy(t->dst + t->got, data, len);
  t->got += len;
  return len;
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

std::string one_line(std::string body) {
  for (auto& c : body)
    if (c == '\n' || c == '\r') c = ' ';
  return body;
}

class HttpSource;

// One request of a source: a HEAD, a GET of one range, or a GET of several (multipart answer).
struct HttpRequest final : Request {
  enum class Kind { head, range, ranges };
  HttpRequest(const HttpSource* s, Kind k) : source(s), kind(k) {}
  ~HttpRequest() override { curl_slist_free_all(headers); }
  void prepare(CURL* handle) override;
  Outcome judge(CURL* handle, CURLcode code) override;

  const HttpSource* source;
  Kind kind;
  uint64_t offset = 0;  // range
  size_t length = 0;
  uint8_t* dst = nullptr;
  std::vector<ByteRange> ranges;  // ranges
  uint64_t* size_out = nullptr;   // head: where the size goes
  bool unsupported = false;       // ranges: the server answered 200 (it ignores several ranges)
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

  // S3 answers one range per request; plain HTTP servers (nginx) answer several at once, until
  // one shows it does not.
  size_t ranges_per_request() const override {
    return s3_ || !multi_range_ok_.load() ? 1 : kMaxRangesPerRequest;
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
    Lane& lane = next_lane();
    auto req = new_request(HttpRequest::Kind::ranges, std::to_string(ranges.size()) + "-range GET",
                           cancel, lane);
    req->ranges = std::move(ranges);
    HttpRequest* raw = req.get();
    req->done = [this, raw, cancel, done = std::move(done)](std::exception_ptr error) mutable {
      if (error || !raw->unsupported) return done(error);
      // The server ignores multi-range requests: say so, and fetch these one range at a time.
      multi_range_ok_.store(false);
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
    if (req.kind == HttpRequest::Kind::range) {
      t.dst = req.dst;
      t.offset = req.offset;
      t.length = req.length;
      extra.emplace_back("Range", "bytes=" + std::to_string(req.offset) + "-" +
                                      std::to_string(req.offset + req.length - 1));
    } else if (req.kind == HttpRequest::Kind::ranges) {
      t.ranges = &req.ranges;
      t.scatter = RangeScatter(req.ranges);
      t.body = ByteRangesParser::multipart();
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
    switch (req.kind) {
      case HttpRequest::Kind::head: {
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
      case HttpRequest::Kind::range: {
        if (t.overflow) return {Outcome::retry, "the server sent more than the range asked for"};
        Outcome o = classify(
            code, status, t,
            t.got ? " after " + std::to_string(t.got) + " of " + std::to_string(t.length) + " bytes"
                  : std::string());
        if (o.kind != Outcome::ok) return o;
        if (status != 206)
          return {Outcome::fatal, "HTTP " + std::to_string(status) +
                                      " (expected 206 Partial Content)" +
                                      (t.error_body.empty() ? "" : ": " + one_line(t.error_body))};
        if (t.checked && !t.range_ok)
          return {Outcome::retry, "the response's Content-Range is not the range asked for"};
        if (t.got != t.length)
          return {Outcome::retry, "short read: " + std::to_string(t.got) + " of " +
                                      std::to_string(t.length) + " bytes"};
        return o;
      }
      case HttpRequest::Kind::ranges: {
        if (t.body.malformed())
          return {Outcome::retry, "a malformed multipart/byteranges response"};
        Outcome o = classify(code, status, t, "");
        if (o.kind != Outcome::ok) return o;
        if (status == 200) {
          req.unsupported = true;
          return {Outcome::ok, ""};
        }
        if (status != 206)
          return {Outcome::fatal,
                  "HTTP " + std::to_string(status) + " (expected 206 Partial Content)"};
        for (size_t i = 0; i < req.ranges.size(); ++i)
          if (t.scatter.filled(i) < req.ranges[i].length)
            return {Outcome::retry, "short read: range " + std::to_string(req.ranges[i].offset) +
                                        "+" + std::to_string(req.ranges[i].length) + " got " +
                                        std::to_string(t.scatter.filled(i)) + " bytes"};
        return o;
      }
    }
    return {Outcome::fatal, "unknown request kind"};
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
    return req;
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
    for (const ByteRange& r : ranges) {
      Lane& lane = next_lane();
      auto req = new_request(
          HttpRequest::Kind::range,
          "GET bytes " + std::to_string(r.offset) + "-" + std::to_string(r.offset + r.length - 1),
          cancel, lane);
      req->offset = r.offset;
      req->length = r.length;
      req->dst = static_cast<uint8_t*>(r.dst);
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

  std::string url_, name_;
  SourceOptions options_;
  std::optional<S3Target> s3_;
  uint64_t size_ = 0;
  std::unique_ptr<Lane[]> lanes_;  // never moved: requests point at their lane's slots
  size_t num_lanes_ = 0;
  mutable std::atomic<uint64_t> next_lane_{0};
  mutable std::atomic<bool> multi_range_ok_{true};
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
