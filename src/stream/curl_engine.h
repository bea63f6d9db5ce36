// Internal: one event loop that runs the HTTP requests of every remote source in the process
// through a libcurl multi handle, so any number of requests are in flight without a thread each and
// connections to a host are shared by all its sources. Each request is retried (exponential
// backoff with jitter, bounded in tries and time) until it succeeds or fails for good; nothing waits
// without a bound, and cancelling a request's token ends it at once.
#pragma once
#include <curl/curl.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tpf/stream.h"

namespace tpf::stream {

// What one attempt came to.
struct Outcome {
  enum Kind { ok, retry, fatal } kind = ok;
  std::string message;
  double retry_after_s = 0;  // the server's Retry-After, when it sent one
};

struct Request;

// Requests one source may run at once; the rest wait in order. Only the engine's thread touches
// it (the source that owns it must outlive its requests).
struct Slots {
  int limit = 1;
  int running = 0;
  std::deque<Request*> waiting;
};

struct RetryPolicy {
  int max_attempts = 8;
  double backoff_base_s = 0.05;
  double backoff_max_s = 2.0;
  double retry_deadline_s = 120.0;
};

// One logical request. The engine calls prepare() on a reset handle before each attempt and
// judge() after it, then `done` once, on its thread, with nullptr or the error (a RuntimeError
// naming `what` and `source_name`).
struct Request {
  virtual ~Request() = default;
  virtual void prepare(CURL* handle) = 0;
  virtual Outcome judge(CURL* handle, CURLcode code) = 0;

  std::string what;         // "GET bytes 0-99", for messages
  std::string source_name;  // the URL, for messages
  const CancelToken* cancel = nullptr;
  RetryPolicy retry;
  Slots* slots = nullptr;
  std::function<void(std::exception_ptr)> done;
  // Counts the attempts that are asked again (the source's SourceStats::retries), when set.
  std::atomic<uint64_t>* retries = nullptr;

  // The engine's bookkeeping.
  CURL* handle = nullptr;
  int attempts = 0;
  std::chrono::steady_clock::time_point queued{}, attempt_started{};
  std::chrono::steady_clock::time_point deadline{};
  std::string last_error;
};

class CurlEngine {
 public:
  // The process's first engine (a forked child gets its own: the parent's threads do not exist
  // there).
  static std::shared_ptr<CurlEngine> shared();
  // The process's first `n` engines (n >= 1), each an event loop on a thread of its own, started
  // as needed and shared by every source that asks. One loop's thread receives, parses and copies
  // every response it runs: spreading a source's requests over several loops spreads that work
  // over as many cores.
  static std::vector<std::shared_ptr<CurlEngine>> pool(size_t n);
  virtual ~CurlEngine() = default;
  // Queues `request`; thread-safe. Its `done` runs later on the engine's thread, never here.
  virtual void submit(std::unique_ptr<Request> request) = 0;
  // Submits and waits; rethrows the request's error.
  void run(std::unique_ptr<Request> request);
  virtual bool on_engine_thread() const = 0;
  // True on the thread of any engine of this process.
  static bool on_any_engine_thread();
};

// Calls start(done) and waits until `done` has run; rethrows its error. For the blocking reads of
// an asynchronous source (never on the engine's thread, which would wait for itself).
void wait_for(const std::function<void(CancellableSource::Done)>& start);

}  // namespace tpf::stream
