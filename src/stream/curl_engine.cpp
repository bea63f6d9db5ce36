// The engine's loop: epoll over the sockets libcurl asks it to watch (curl_multi_socket_action),
// an eventfd to wake it for new requests, cancellations and stopping, libcurl's own timer, and the
// backoff timers of requests waiting to be retried. It waits only in epoll_wait, whose timeout is
// the nearest of those timers (none when idle): no polling.
#include "stream/curl_engine.h"

#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tpf/error.h"

namespace tpf::stream {

namespace {

using Clock = std::chrono::steady_clock;

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
      throw RuntimeError("libcurl could not be initialised (curl_global_init failed)");
  });
}

std::atomic<uint64_t> next_engine_key{1};

struct AtomicCounters {
  std::atomic<uint64_t> attempts{0}, slot_wait_ns{0}, first_byte_ns{0}, attempt_ns{0};
};
AtomicCounters counters;

uint64_t ns_between(Clock::time_point a, Clock::time_point b) {
  return b > a ? uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count()) : 0;
}
thread_local bool t_engine_thread = false;

class Engine final : public CurlEngine, public std::enable_shared_from_this<Engine> {
 public:
  Engine() : pid_(::getpid()), key_(next_engine_key++), rng_(std::random_device{}()) {
    global_init();
    multi_ = curl_multi_init();
    epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (!multi_ || epoll_fd_ < 0 || wake_fd_ < 0) {
      const std::string why = std::strerror(errno);
      close_all();
      throw RuntimeError("cannot set up the HTTP event loop: " + why);
    }
    curl_multi_setopt(multi_, CURLMOPT_SOCKETFUNCTION, on_socket);
    curl_multi_setopt(multi_, CURLMOPT_SOCKETDATA, this);
    curl_multi_setopt(multi_, CURLMOPT_TIMERFUNCTION, on_timer);
    curl_multi_setopt(multi_, CURLMOPT_TIMERDATA, this);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = wake_fd_;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
    thread_ = new std::thread([this] {
      ::pthread_setname_np(::pthread_self(), "tpf-http");  // for per-thread CPU (/proc, perf)
      t_engine_thread = true;
      loop();
    });
    thread_id_ = thread_->get_id();
  }

  ~Engine() override {
    // In a forked child the loop's thread does not exist and the handles' connections belong to
    // the parent too: leave all of it (closing a TLS connection here would end the parent's).
    if (::getpid() != pid_) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake();
    thread_->join();
    delete thread_;
    for (CURL* h : idle_handles_) curl_easy_cleanup(h);
    close_all();
  }

  void submit(std::unique_ptr<Request> request) override {
    if (request->cancel) {
      std::weak_ptr<Engine> weak = weak_from_this();
      request->cancel->on_cancel(key_, [weak] {
        if (auto engine = weak.lock()) {
          engine->cancel_check_.store(true);
          engine->wake();
        }
      });
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      inbox_.push_back(std::move(request));
    }
    // From the loop's own thread (a completion starting the next request) no wake-up is needed:
    // the loop looks at its inbox again before it waits.
    if (on_engine_thread())
      submitted_here_ = true;
    else
      wake();
  }

  bool on_engine_thread() const override { return std::this_thread::get_id() == thread_id_; }

 private:
  void close_all() {
    if (multi_) curl_multi_cleanup(multi_);
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

  void wake() {
    const uint64_t one = 1;
    // Fails only when the counter is saturated, and then the loop is awake anyway.
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof one);
  }

  void loop() {
    std::vector<std::unique_ptr<Request>> incoming;
    epoll_event events[64];
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stop_) break;
        incoming.swap(inbox_);
        submitted_here_ = false;
      }
      for (auto& r : incoming) {
        Request* raw = r.get();
        live_.emplace(raw, std::move(r));
        start(raw);
      }
      incoming.clear();
      if (cancel_check_.exchange(false)) end_cancelled();
      fire_backoffs();
      // Requests this thread submitted since the inbox was taken are taken at once.
      const int n = ::epoll_wait(epoll_fd_, events, 64, submitted_here_ ? 0 : wait_ms());
      int running = 0;
      for (int i = 0; i < n; ++i) {
        const int fd = events[i].data.fd;
        if (fd == wake_fd_) {
          uint64_t count;
          [[maybe_unused]] ssize_t got = ::read(wake_fd_, &count, sizeof count);
          continue;
        }
        const uint32_t ev = events[i].events;
        const int action = ((ev & (EPOLLIN | EPOLLHUP)) ? CURL_CSELECT_IN : 0) |
                           ((ev & EPOLLOUT) ? CURL_CSELECT_OUT : 0) |
                           ((ev & EPOLLERR) ? CURL_CSELECT_ERR : 0);
        curl_multi_socket_action(multi_, fd, action, &running);
      }
      if (curl_timer_set_ && Clock::now() >= curl_timer_) {
        curl_timer_set_ = false;
        curl_multi_socket_action(multi_, CURL_SOCKET_TIMEOUT, 0, &running);
      }
      read_messages();
    }
    // Sources outlive their requests, so nothing is live here unless a source was destroyed with
    // reads in flight; end those rather than leave their handles in the multi.
    std::vector<Request*> left;
    for (auto& [raw, owned] : live_) left.push_back(raw);
    for (Request* r : left) {
      if (r->handle) {
        curl_multi_remove_handle(multi_, r->handle);
        idle_handles_.push_back(r->handle);
        r->handle = nullptr;
      }
      complete(r, std::make_exception_ptr(RuntimeError(r->what + " of '" + r->source_name +
                                                       "' cancelled: the HTTP "
                                                       "engine stopped")));
    }
  }

  int wait_ms() const {
    bool any = false;
    Clock::time_point t{};
    if (curl_timer_set_) {
      t = curl_timer_;
      any = true;
    }
    if (!backoff_.empty() && (!any || backoff_.begin()->first < t)) {
      t = backoff_.begin()->first;
      any = true;
    }
    if (!any) return -1;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(t - Clock::now()).count();
    return int(std::clamp<int64_t>(left, 0, INT_MAX));
  }

  void start(Request* r) {
    if (r->attempts == 0)
      r->deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(r->retry.retry_deadline_s));
    if (r->cancel && r->cancel->cancelled()) return fail_cancelled(r);
    r->queued = Clock::now();
    Slots& s = *r->slots;
    if (s.running < s.limit) {
      ++s.running;
      begin_attempt(r);
    } else {
      s.waiting.push_back(r);
    }
  }

  void begin_attempt(Request* r) {
    CURL* h = nullptr;
    if (!idle_handles_.empty()) {
      h = idle_handles_.back();
      idle_handles_.pop_back();
      curl_easy_reset(h);
    } else {
      h = curl_easy_init();
    }
    if (!h) {
      release_slot(r);
      return complete(r, std::make_exception_ptr(RuntimeError(
                             "libcurl could not create a handle for '" + r->source_name + "'")));
    }
    ++r->attempts;
    try {
      r->prepare(h);
    } catch (...) {
      idle_handles_.push_back(h);
      release_slot(r);
      return complete(r, std::current_exception());
    }
    curl_easy_setopt(h, CURLOPT_PRIVATE, r);
    r->attempt_started = Clock::now();
    counters.slot_wait_ns.fetch_add(ns_between(r->queued, r->attempt_started),
                                    std::memory_order_relaxed);
    const CURLMcode mc = curl_multi_add_handle(multi_, h);
    if (mc != CURLM_OK) {
      idle_handles_.push_back(h);
      release_slot(r);
      return complete(r, std::make_exception_ptr(RuntimeError(
                             r->what + " of '" + r->source_name +
                             "': libcurl could not start it: " + curl_multi_strerror(mc))));
    }
    r->handle = h;
  }

  void read_messages() {
    int left = 0;
    while (CURLMsg* m = curl_multi_info_read(multi_, &left)) {
      if (m->msg != CURLMSG_DONE) continue;
      CURL* h = m->easy_handle;
      const CURLcode code = m->data.result;
      Request* r = nullptr;
      curl_easy_getinfo(h, CURLINFO_PRIVATE, &r);
      curl_multi_remove_handle(multi_, h);
      end_attempt(r, code);
    }
  }

  void end_attempt(Request* r, CURLcode code) {
    CURL* h = r->handle;
    r->handle = nullptr;
    curl_off_t first_byte_us = 0;
    curl_easy_getinfo(h, CURLINFO_STARTTRANSFER_TIME_T, &first_byte_us);
    counters.attempts.fetch_add(1, std::memory_order_relaxed);
    counters.first_byte_ns.fetch_add(uint64_t(std::max<curl_off_t>(first_byte_us, 0)) * 1000,
                                     std::memory_order_relaxed);
    counters.attempt_ns.fetch_add(ns_between(r->attempt_started, Clock::now()),
                                  std::memory_order_relaxed);
    Outcome o;
    try {
      o = r->judge(h, code);
    } catch (const std::exception& e) {
      o = {Outcome::fatal, e.what()};
    }
    idle_handles_.push_back(h);
    release_slot(r);
    if (o.kind == Outcome::ok) return complete(r, nullptr);
    if (o.kind == Outcome::fatal)
      return complete(r, std::make_exception_ptr(
                             RuntimeError(r->what + " of '" + r->source_name + "': " + o.message)));
    r->last_error = o.message;
    if (r->attempts >= r->retry.max_attempts) return fail_retries(r);
    const double delay = std::max(jittered_backoff(*r, r->attempts - 1),
                                  std::min(o.retry_after_s, r->retry.backoff_max_s));
    const double left = std::chrono::duration<double>(r->deadline - Clock::now()).count();
    if (delay >= left) return fail_retries(r);
    if (r->cancel && r->cancel->cancelled()) return fail_cancelled(r);
    const auto due = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(delay));
    if (r->retries) r->retries->fetch_add(1, std::memory_order_relaxed);
    backoff_.emplace(due, r);
  }

  void fire_backoffs() {
    const auto now = Clock::now();
    while (!backoff_.empty() && backoff_.begin()->first <= now) {
      Request* r = backoff_.begin()->second;
      backoff_.erase(backoff_.begin());
      start(r);
    }
  }

  // Frees r's slot and starts the source's next waiting requests.
  void release_slot(Request* r) {
    Slots& s = *r->slots;
    --s.running;
    while (s.running < s.limit && !s.waiting.empty()) {
      Request* next = s.waiting.front();
      s.waiting.pop_front();
      if (next->cancel && next->cancel->cancelled()) {
        fail_cancelled(next);
        continue;
      }
      ++s.running;
      begin_attempt(next);
    }
  }

  void end_cancelled() {
    std::vector<Request*> cancelled;
    for (auto& [raw, owned] : live_)
      if (raw->cancel && raw->cancel->cancelled()) cancelled.push_back(raw);
    for (Request* r : cancelled) {
      // Ending one can end others (release_slot ends cancelled requests it takes off the queue).
      if (!live_.count(r)) continue;
      if (r->handle) {
        curl_multi_remove_handle(multi_, r->handle);
        idle_handles_.push_back(r->handle);
        r->handle = nullptr;
        release_slot(r);
      } else {
        for (auto it = backoff_.begin(); it != backoff_.end(); ++it)
          if (it->second == r) {
            backoff_.erase(it);
            break;
          }
        auto& waiting = r->slots->waiting;
        waiting.erase(std::remove(waiting.begin(), waiting.end(), r), waiting.end());
      }
      fail_cancelled(r);
    }
  }

  double jittered_backoff(const Request& r, int attempt) {
    const double cap = std::min(r.retry.backoff_max_s,
                                r.retry.backoff_base_s * double(1ull << std::min(attempt, 30)));
    return std::uniform_real_distribution<double>(0.5 * cap, cap)(rng_);
  }

  void fail_cancelled(Request* r) {
    complete(r, std::make_exception_ptr(
                    RuntimeError(r->what + " of '" + r->source_name + "' cancelled")));
  }

  void fail_retries(Request* r) {
    complete(r,
             std::make_exception_ptr(RuntimeError(
                 r->what + " of '" + r->source_name + "' failed after retries (at most " +
                 std::to_string(r->retry.max_attempts) + " tries within " +
                 std::to_string(r->retry.retry_deadline_s) + " s); last error: " + r->last_error)));
  }

  // Calls done (while the request is still alive: done may read its results), then frees it.
  void complete(Request* r, std::exception_ptr error) {
    auto it = live_.find(r);
    std::unique_ptr<Request> owned = std::move(it->second);
    live_.erase(it);
    try {
      owned->done(error);
    } catch (...) {
      // A completion that throws has nowhere to report to; the loop must go on for the others.
    }
  }

  static int on_socket(CURL*, curl_socket_t s, int what, void* userp, void* socketp) {
    auto* e = static_cast<Engine*>(userp);
    if (what == CURL_POLL_REMOVE) {
      ::epoll_ctl(e->epoll_fd_, EPOLL_CTL_DEL, s, nullptr);
      curl_multi_assign(e->multi_, s, nullptr);
      return 0;
    }
    epoll_event ev{};
    ev.events = ((what & CURL_POLL_IN) ? EPOLLIN : 0u) | ((what & CURL_POLL_OUT) ? EPOLLOUT : 0u);
    ev.data.fd = s;
    if (socketp) {
      if (::epoll_ctl(e->epoll_fd_, EPOLL_CTL_MOD, s, &ev) != 0 && errno == ENOENT)
        ::epoll_ctl(e->epoll_fd_, EPOLL_CTL_ADD, s, &ev);
    } else {
      if (::epoll_ctl(e->epoll_fd_, EPOLL_CTL_ADD, s, &ev) != 0 && errno == EEXIST)
        ::epoll_ctl(e->epoll_fd_, EPOLL_CTL_MOD, s, &ev);
      curl_multi_assign(e->multi_, s, e);
    }
    return 0;
  }

  static int on_timer(CURLM*, long timeout_ms, void* userp) {
    auto* e = static_cast<Engine*>(userp);
    if (timeout_ms < 0) {
      e->curl_timer_set_ = false;
    } else {
      e->curl_timer_set_ = true;
      e->curl_timer_ = Clock::now() + std::chrono::milliseconds(timeout_ms);
    }
    return 0;
  }

  const pid_t pid_;
  const uint64_t key_;
  CURLM* multi_ = nullptr;
  int epoll_fd_ = -1, wake_fd_ = -1;
  std::thread* thread_ = nullptr;  // leaked in a forked child, where it does not run
  std::thread::id thread_id_;

  std::mutex mutex_;
  std::vector<std::unique_ptr<Request>> inbox_;
  bool stop_ = false;
  std::atomic<bool> cancel_check_{false};

  // The loop's thread only.
  bool submitted_here_ = false;
  std::unordered_map<Request*, std::unique_ptr<Request>> live_;
  std::set<std::pair<Clock::time_point, Request*>> backoff_;
  std::vector<CURL*> idle_handles_;
  bool curl_timer_set_ = false;
  Clock::time_point curl_timer_{};
  std::mt19937_64 rng_;
};

}  // namespace

std::vector<std::shared_ptr<CurlEngine>> CurlEngine::pool(size_t n) {
  TPF_CHECK(n >= 1, "HTTP engines: expected at least 1, got 0");
  // Leaked on purpose: sources destroyed during static destruction may still ask for them.
  static auto* mutex = new std::mutex;
  static auto* current = new std::vector<std::weak_ptr<Engine>>;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(*mutex);
  if (owner != ::getpid()) {
    // A forked child: the parent's loops have no thread here; start its own.
    current->clear();
    owner = ::getpid();
  }
  if (current->size() < n) current->resize(n);
  std::vector<std::shared_ptr<CurlEngine>> engines;
  for (size_t i = 0; i < n; ++i) {
    std::shared_ptr<Engine> engine = (*current)[i].lock();
    if (!engine) {
      engine = std::make_shared<Engine>();
      (*current)[i] = engine;
    }
    engines.push_back(std::move(engine));
  }
  return engines;
}

std::shared_ptr<CurlEngine> CurlEngine::shared() { return pool(1)[0]; }

bool CurlEngine::on_any_engine_thread() { return t_engine_thread; }

HttpStats http_stats() {
  return {counters.attempts.load(), counters.slot_wait_ns.load(), counters.first_byte_ns.load(),
          counters.attempt_ns.load()};
}

void wait_for(const std::function<void(CancellableSource::Done)>& start) {
  // Shared with `done`, which may still be returning on the engine's thread after the wait ends.
  struct Wait {
    std::mutex mutex;
    std::condition_variable cv;
    bool finished = false;
    std::exception_ptr error;
  };
  auto wait = std::make_shared<Wait>();
  start([wait](std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(wait->mutex);
    wait->error = error;
    wait->finished = true;
    wait->cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(wait->mutex);
  wait->cv.wait(lock, [&] { return wait->finished; });
  if (wait->error) std::rethrow_exception(wait->error);
}

void CurlEngine::run(std::unique_ptr<Request> request) {
  if (on_engine_thread())
    throw Error("a blocking read of '" + request->source_name +
                "' was started on the HTTP engine's own thread, which would wait for itself");
  wait_for([&](CancellableSource::Done done) {
    request->done = std::move(done);
    submit(std::move(request));
  });
}

}  // namespace tpf::stream
