#include "util/thread_pool.h"

#include "util/copy_bytes.h"
#include "util/errno_status.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <system_error>

namespace cascade {

int ThreadPool::default_threads() {
  unsigned n = std::thread::hardware_concurrency();
  if (n == 0) n = 4;
  return static_cast<int>(std::min(n, 64u));
}

Result<std::unique_ptr<ThreadPool>> ThreadPool::Create(int threads) {
  if (threads < 0 || threads > kMaxThreads) {
    return Status::InvalidArgument("threads must be 0 (one per core) or 1 to " +
                                   std::to_string(kMaxThreads) + "; got " +
                                   std::to_string(threads));
  }
  int n = threads == 0 ? default_threads() : threads;
  try {
    return std::make_unique<ThreadPool>(n);
  } catch (const std::system_error& e) {
    return errno_status(e.code().value(), "cannot start " + std::to_string(n) + " I/O threads");
  }
}

ThreadPool::ThreadPool(int threads) {
  if (threads < 0) threads = default_threads();
  workers_.reserve(threads);
  try {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
  } catch (...) {
    stop_and_join();  // a joinable std::thread must not be destroyed
    throw;
  }
}

ThreadPool::~ThreadPool() { stop_and_join(); }

void ThreadPool::stop_and_join() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void ThreadPool::run() {
  while (true) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_ and drained
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

namespace {

// Shared by the caller and the helpers of one parallel_for. Items are handed
// out by `next`; the caller waits only for items that someone has taken.
struct ForState {
  explicit ForState(size_t n, const std::function<void(size_t)>* f) : n(n), fn(f) {}
  const size_t n;
  const std::function<void(size_t)>* fn;  // valid until done == n
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  void work() {
    size_t finished = 0;
    while (true) {
      size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) break;
      (*fn)(i);
      ++finished;
    }
    if (finished && done.fetch_add(finished, std::memory_order_acq_rel) + finished == n) {
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_all();
    }
  }
};

}  // namespace

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t)>& fn, int max_workers) {
  if (n == 0) return;
  if (n == 1 || workers_.empty()) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto state = std::make_shared<ForState>(n, &fn);
  if (max_workers < 0) max_workers = static_cast<int>(workers_.size()) - 1;
  size_t helpers = std::min<size_t>(n - 1, static_cast<size_t>(max_workers));
  if (helpers == 0) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  for (size_t h = 0; h < helpers; ++h) submit([state] { state->work(); });
  state->work();
  if (state->done.load(std::memory_order_acquire) != n) {
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->done.load(std::memory_order_acquire) == n; });
  }
}

void parallel_memcpy(ThreadPool* pool, void* dst, const void* src, size_t n, size_t threshold) {
  constexpr size_t kMinSlice = 1 << 20;
  if (pool == nullptr || n < threshold || n < 2 * kMinSlice || pool->size() < 2) {
    copy_bytes(dst, src, n);
    return;
  }
  size_t parts = std::min<size_t>(pool->size(), n / kMinSlice);
  size_t slice = (n / parts + 4095) & ~size_t{4095};
  parts = (n + slice - 1) / slice;
  auto* d = static_cast<uint8_t*>(dst);
  auto* s = static_cast<const uint8_t*>(src);
  pool->parallel_for(parts, [&](size_t i) {
    size_t begin = i * slice;
    size_t len = std::min(slice, n - begin);
    copy_bytes(d + begin, s + begin, len);
  });
}

}  // namespace cascade
