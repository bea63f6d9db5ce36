// HTTP(S) range reads and S3 objects through libcurl. Each source keeps a small pool of easy
// handles (each keeps its connection alive between requests) and never runs more than
// max_connections requests at once. Every request has connect, total and stall timeouts; every
// retry loop has a count and a deadline; backoff waits on a condition variable so cancelling wakes it.
#include <curl/curl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <optional>
#include <random>
#include <vector>

#include "stream/sources.h"
#include "tpf/error.h"

namespace tpf::stream {

namespace {

using Clock = std::chrono::steady_clock;
using Headers = std::vector<std::pair<std::string, std::string>>;

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
      throw RuntimeError("libcurl could not be initialised (curl_global_init failed)");
  });
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
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

// What one attempt came to.
struct Outcome {
  enum Kind { ok, retry, fatal } kind = ok;
  std::string message;
  double retry_after_s = 0;
};

// State shared with curl's callbacks during one transfer.
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
  std::string content_type;
  // Multi-range requests: the ranges asked for, the bytes of each filled so far, and the parser of
  // a multipart/byteranges body (part headers are gathered in `part_header`, bounded).
  const std::vector<ByteRange>* ranges = nullptr;
  std::vector<uint64_t> filled;
  bool multipart = false;
  bool in_part = false;
  uint64_t part_pos = 0, part_left = 0;
  std::string part_header;
  bool malformed = false;
};

constexpr size_t kMaxPartHeader = 8192;

// Copies body bytes that sit at file offset `pos` into every requested range they overlap.
void scatter(Transfer& t, uint64_t pos, const char* data, size_t n) {
  const auto& ranges = *t.ranges;
  auto it = std::upper_bound(ranges.begin(), ranges.end(), pos,
                             [](uint64_t p, const ByteRange& r) { return p < r.offset; });
  if (it != ranges.begin()) --it;
  for (; it != ranges.end() && it->offset < pos + n; ++it) {
    const uint64_t lo = std::max(pos, it->offset), hi = std::min(pos + n, it->offset + it->length);
    if (lo >= hi) continue;
    std::memcpy(static_cast<uint8_t*>(it->dst) + (lo - it->offset), data + (lo - pos), hi - lo);
    t.filled[size_t(it - ranges.begin())] += hi - lo;
  }
}

// "... Content-Range: bytes A-B/N ..." -> (A, B - A + 1)
bool parse_content_range(const std::string& headers, uint64_t& start, uint64_t& length) {
  std::string lower = headers;
  for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const auto at = lower.find("content-range:");
  if (at == std::string::npos) return false;
  const auto bytes = lower.find("bytes", at);
  if (bytes == std::string::npos) return false;
  char* end = nullptr;
  start = std::strtoull(lower.c_str() + bytes + 5, &end, 10);
  if (!end || *end != '-') return false;
  const uint64_t last = std::strtoull(end + 1, nullptr, 10);
  if (last < start) return false;
  length = last - start + 1;
  return true;
}

// Feeds a multipart/byteranges body: part headers, then part data scattered to the ranges.
void feed_multipart(Transfer& t, const char* data, size_t n) {
  while (n > 0 && !t.malformed) {
    if (t.in_part) {
      const size_t take = size_t(std::min<uint64_t>(n, t.part_left));
      scatter(t, t.part_pos, data, take);
      t.part_pos += take;
      t.part_left -= take;
      data += take;
      n -= take;
      if (t.part_left == 0) t.in_part = false;
      continue;
    }
    // Between parts: gather the boundary line and the part's headers up to the blank line.
    const size_t room = kMaxPartHeader - t.part_header.size();
    const size_t take = std::min(n, room);
    const size_t before = t.part_header.size();
    t.part_header.append(data, take);
    const auto end = t.part_header.find("\r\n\r\n", before >= 3 ? before - 3 : 0);
    if (end == std::string::npos) {
      if (t.part_header.size() >= kMaxPartHeader) t.malformed = true;
      data += take;
      n -= take;
      continue;
    }
    uint64_t start = 0, length = 0;
    if (!parse_content_range(t.part_header.substr(0, end), start, length)) {
      t.malformed = true;
      return;
    }
    const size_t used = end + 4 - before;  // bytes of this chunk that belonged to the headers
    t.part_header.clear();
    t.in_part = true;
    t.part_pos = start;
    t.part_left = length;
    data += used;
    n -= used;
  }
}

size_t on_header(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t len = size * n;
  std::string line(data, len);
  const auto colon = line.find(':');
  if (colon == std::string::npos) return len;
  std::string name = line.substr(0, colon);
  for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const std::string value = line.substr(colon + 1);
  if (name == "retry-after") {
    t->retry_after_s = std::strtod(value.c_str(), nullptr);
  } else if (name == "content-type") {
    t->content_type = value;
  } else if (name == "content-range") {
    const auto bytes = value.find("bytes ");
    if (bytes != std::string::npos)
      t->content_range_start = std::strtoull(value.c_str() + bytes + 6, nullptr, 10);
  }
  return len;
}

size_t on_body(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t len = size * n;
  if (!t->checked) {
    long status = 0;
    curl_easy_getinfo(t->handle, CURLINFO_RESPONSE_CODE, &status);
    t->checked = true;
    if (t->ranges) {
      std::string type = t->content_type;
      for (auto& c : type) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      t->multipart = status == 206 && type.find("multipart/byteranges") != std::string::npos;
      // A single-part 206 (the server merged the ranges) is one part at its Content-Range.
      t->range_ok = status == 206 && (t->multipart || t->content_range_start.has_value());
      if (t->range_ok && !t->multipart) {
        t->in_part = true;
        t->part_pos = *t->content_range_start;
        t->part_left = UINT64_MAX;
      }
    } else {
      t->range_ok = status == 206 && t->content_range_start.value_or(t->offset) == t->offset;
    }
  }
  if (t->ranges) {
    if (t->range_ok) {
      feed_multipart(*t, data, len);
      return t->malformed ? 0 : len;
    }
    // Not ranges (an error page, or a 200 with the whole object): keep the start for the
    // message and stop the transfer rather than download the object.
    t->error_body.append(data, std::min<size_t>(len, 300));
    return 0;
  }
  if (!t->range_ok) {
    // Keep the start of an error page for the message; drop a 200 body that ignored the range.
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
    case CURLE_WEIRD_SERVER_REPLY:
      return true;
    default:
      return false;
  }
}

class HttpSource final : public CancellableSource {
 public:
  HttpSource(std::string url, std::string display_name, const SourceOptions& options,
             std::optional<S3Target> s3)
      : url_(std::move(url)), name_(std::move(display_name)), options_(options),
        s3_(std::move(s3)), rng_(std::random_device{}()) {
    TPF_CHECK(options.max_connections >= 1, "max_connections: expected >= 1, got " +
                                                std::to_string(options.max_connections));
    TPF_CHECK(options.max_attempts >= 1,
              "max_attempts: expected >= 1, got " + std::to_string(options.max_attempts));
    global_init();
    size_ = options.expected_size ? options.expected_size : fetch_size();
  }

  ~HttpSource() override {
    for (CURL* h : idle_) curl_easy_cleanup(h);
  }

  uint64_t size() const override { return size_; }
  std::string name() const override { return name_; }

  // S3 answers one range per request; plain HTTP servers (nginx) answer several at once, until
  // one shows it does not.
  size_t ranges_per_request() const override {
    return s3_ || !multi_range_ok_.load() ? 1 : kMaxRangesPerRequest;
  }

  void read_ranges(const std::vector<ByteRange>& ranges, const CancelToken* cancel) const override {
    for (const ByteRange& r : ranges) check_range(*this, r.offset, r.length);
    if (ranges.size() > 1 && ranges_per_request() > 1) {
      bool unsupported = false;
      with_retries(std::to_string(ranges.size()) + "-range GET", cancel,
                   [&](CURL* h) { return get_ranges(h, ranges, cancel, unsupported); });
      if (!unsupported) return;
      multi_range_ok_.store(false);
    }
    for (const ByteRange& r : ranges) read_cancellable(r.offset, r.length, r.dst, cancel);
  }

  void read_cancellable(uint64_t offset, size_t length, void* dst,
                        const CancelToken* cancel) const override {
    check_range(*this, offset, length);
    if (length == 0) return;
    with_retries("GET bytes " + std::to_string(offset) + "-" + std::to_string(offset + length - 1),
                 cancel, [&](CURL* h) { return get_range(h, offset, length, dst, cancel); });
  }

 private:
  uint64_t fetch_size() const {
    uint64_t size = 0;
    with_retries("HEAD", nullptr, [&](CURL* h) { return head(h, size); });
    return size;
  }

  CURL* acquire() const {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return !idle_.empty() || created_ < options_.max_connections; });
    if (!idle_.empty()) {
      CURL* h = idle_.back();
      idle_.pop_back();
      return h;
    }
    CURL* h = curl_easy_init();
    if (!h) throw RuntimeError("libcurl could not create a handle for '" + name_ + "'");
    ++created_;
    return h;
  }

  void release(CURL* h) const {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      idle_.push_back(h);
    }
    cv_.notify_one();
  }

  double jittered_backoff(int attempt) const {
    const double cap =
        std::min(options_.backoff_max_s, options_.backoff_base_s * double(1ull << std::min(attempt, 30)));
    std::lock_guard<std::mutex> lock(mutex_);
    return std::uniform_real_distribution<double>(0.5 * cap, cap)(rng_);
  }

  // Runs `attempt` until it succeeds, fails for good, or the tries or the deadline run out.
  template <typename F>
  void with_retries(const std::string& what, const CancelToken* cancel, F&& attempt) const {
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(options_.retry_deadline_s));
    std::string last;
    for (int i = 0; i < options_.max_attempts; ++i) {
      if (cancel && cancel->cancelled()) throw RuntimeError(what + " of '" + name_ + "' cancelled");
      CURL* h = acquire();
      Outcome out;
      try {
        out = attempt(h);
      } catch (...) {
        release(h);
        throw;
      }
      release(h);
      if (out.kind == Outcome::ok) return;
      if (out.kind == Outcome::fatal) throw RuntimeError(what + " of '" + name_ + "': " + out.message);
      last = out.message;
      if (i + 1 == options_.max_attempts) break;
      const double delay = std::max(jittered_backoff(i), std::min(out.retry_after_s, options_.backoff_max_s));
      const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
      if (delay >= left) break;
      if (cancel) {
        if (cancel->wait_for(delay)) throw RuntimeError(what + " of '" + name_ + "' cancelled");
      } else {
        // Nothing can cancel this wait; it still sleeps on a condition variable, not a spin.
        std::unique_lock<std::mutex> lock(backoff_mutex_);
        backoff_cv_.wait_for(lock, std::chrono::duration<double>(delay));
      }
    }
    throw RuntimeError(what + " of '" + name_ + "' failed after retries (at most " +
                       std::to_string(options_.max_attempts) + " tries within " +
                       std::to_string(options_.retry_deadline_s) + " s); last error: " + last);
  }

  // Common options and headers of every request; returns the header list to free.
  curl_slist* prepare(CURL* h, Transfer& t, const char* method, const Headers& extra) const {
    curl_easy_reset(h);
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
    if (std::strcmp(method, "HEAD") == 0) curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    Headers headers = extra;
    if (s3_) {
      const Headers signed_headers =
          sigv4_headers(s3_->creds, method, s3_->host, s3_->path, extra, amz_now());
      headers.insert(headers.end(), signed_headers.begin(), signed_headers.end());
    }
    curl_slist* list = nullptr;
    for (const auto& [k, v] : headers) list = curl_slist_append(list, (k + ": " + v).c_str());
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, list);
    return list;
  }

  static Outcome classify(CURLcode code, long status, const Transfer& t, const std::string& detail) {
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

  Outcome head(CURL* h, uint64_t& size) const {
    Transfer t;
    t.handle = h;
    curl_slist* list = prepare(h, t, "HEAD", {});
    const CURLcode code = curl_easy_perform(h);
    curl_slist_free_all(list);
    long status = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
    Outcome o = classify(code, status, t, "");
    if (o.kind != Outcome::ok) return o;
    if (status != 200) return {Outcome::fatal, "HTTP " + std::to_string(status) + " (expected 200)"};
    curl_off_t length = -1;
    curl_easy_getinfo(h, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length);
    if (length < 0) return {Outcome::fatal, "the response carries no Content-Length"};
    size = static_cast<uint64_t>(length);
    return o;
  }

  Outcome get_range(CURL* h, uint64_t offset, size_t length, void* dst,
                    const CancelToken* cancel) const {
    Transfer t;
    t.handle = h;
    t.dst = static_cast<uint8_t*>(dst);
    t.offset = offset;
    t.length = length;
    t.cancel = cancel;
    const Headers range = {
        {"Range", "bytes=" + std::to_string(offset) + "-" + std::to_string(offset + length - 1)}};
    curl_slist* list = prepare(h, t, "GET", range);
    const CURLcode code = curl_easy_perform(h);
    curl_slist_free_all(list);
    long status = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
    if (t.overflow) return {Outcome::retry, "the server sent more than the range asked for"};
    Outcome o = classify(code, status, t, t.got ? " after " + std::to_string(t.got) + " of " +
                                                      std::to_string(length) + " bytes"
                                                : std::string());
    if (o.kind != Outcome::ok) return o;
    if (status != 206) {
      std::string body = t.error_body;
      for (auto& c : body)
        if (c == '\n' || c == '\r') c = ' ';
      return {Outcome::fatal, "HTTP " + std::to_string(status) +
                                  " (expected 206 Partial Content)" +
                                  (body.empty() ? "" : ": " + body)};
    }
    if (t.checked && !t.range_ok)
      return {Outcome::retry, "the response's Content-Range is not the range asked for"};
    if (t.got != length)
      return {Outcome::retry, "short read: " + std::to_string(t.got) + " of " +
                                  std::to_string(length) + " bytes"};
    return o;
  }

  Outcome get_ranges(CURL* h, const std::vector<ByteRange>& ranges, const CancelToken* cancel,
                     bool& unsupported) const {
    Transfer t;
    t.handle = h;
    t.cancel = cancel;
    t.ranges = &ranges;
    t.filled.assign(ranges.size(), 0);
    std::string spec = "bytes=";
    uint64_t total = 0;
    for (size_t i = 0; i < ranges.size(); ++i) {
      if (ranges[i].length == 0) continue;
      if (total > 0) spec += ',';
      spec += std::to_string(ranges[i].offset);
      spec += '-';
      spec += std::to_string(ranges[i].offset + ranges[i].length - 1);
      total += ranges[i].length;
    }
    if (total == 0) return {Outcome::ok, ""};
    curl_slist* list = prepare(h, t, "GET", {{"Range", spec}});
    const CURLcode code = curl_easy_perform(h);
    curl_slist_free_all(list);
    long status = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
    if (t.malformed) return {Outcome::retry, "a malformed multipart/byteranges response"};
    Outcome o = classify(code, status, t, "");
    if (o.kind != Outcome::ok) return o;
    if (status == 200) {
      // The server ignores multi-range requests: say so, and the caller reads range by range.
      unsupported = true;
      return {Outcome::ok, ""};
    }
    if (status != 206)
      return {Outcome::fatal, "HTTP " + std::to_string(status) + " (expected 206 Partial Content)"};
    for (size_t i = 0; i < ranges.size(); ++i)
      if (t.filled[i] < ranges[i].length)
        return {Outcome::retry, "short read: range " + std::to_string(ranges[i].offset) + "+" +
                                    std::to_string(ranges[i].length) + " got " +
                                    std::to_string(t.filled[i]) + " bytes"};
    return o;
  }

  static constexpr size_t kMaxRangesPerRequest = 64;

  std::string url_, name_;
  SourceOptions options_;
  std::optional<S3Target> s3_;
  uint64_t size_ = 0;

  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  mutable std::vector<CURL*> idle_;
  mutable int created_ = 0;
  mutable std::mt19937_64 rng_;
  mutable std::atomic<bool> multi_range_ok_{true};
  mutable std::mutex backoff_mutex_;
  mutable std::condition_variable backoff_cv_;
};

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
