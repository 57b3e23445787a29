#include "util/thread_pool.h"

#include "util/copy_bytes.h"
#include "util/errno_status.h"
#include "util/fork_generation.h"
#include "util/futex.h"
#include "util/thread_name.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
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

Result<std::unique_ptr<ThreadPool>> ThreadPool::Create(int threads, const char* name) {
  if (threads < 0 || threads > kMaxThreads) {
    return Status::InvalidArgument("threads must be 0 (one per core) or 1 to " +
                                   std::to_string(kMaxThreads) + "; got " +
                                   std::to_string(threads));
  }
  int n = threads == 0 ? default_threads() : threads;
  try {
    return std::make_unique<ThreadPool>(n, name);
  } catch (const std::system_error& e) {
    return errno_status(e.code().value(), "cannot start " + std::to_string(n) + " threads (" +
                                              (name ? name : "cascade-io") + ")");
  }
}

namespace {

constexpr int kForSlots = 64;

}  // namespace

// One parallel_for: items are handed out by `next`; the caller waits only
// for items that some thread has taken.
struct ThreadPool::ForState {
  ForState(size_t n, const std::function<void(size_t)>* f) : n(n), fn(f) {}
  const size_t n;
  const std::function<void(size_t)>* fn;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::atomic<uint32_t> all_done{0};  // set (and woken) by whoever ends the last item

  void work() {
    size_t finished = 0;
    while (true) {
      const size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) break;
      (*fn)(i);
      ++finished;
    }
    if (finished && done.fetch_add(finished, std::memory_order_acq_rel) + finished == n) {
      all_done.store(1, std::memory_order_seq_cst);
      futex_wake_one(&all_done);
    }
  }

  // A short spin (the last items usually end within microseconds of the
  // caller's), then sleep: a longer spin takes a core from the processes
  // and threads that share the machine.
  void wait_all_done() {
    const auto spin_end = std::chrono::steady_clock::now() + std::chrono::microseconds(5);
    for (int i = 0; !all_done.load(std::memory_order_acquire); ++i) {
      cpu_pause();
      if ((i & 15) == 15 && std::chrono::steady_clock::now() > spin_end) break;
    }
    while (!all_done.load(std::memory_order_acquire)) futex_wait(&all_done, 0, -1);
  }

  static void cpu_pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
};

// Where a parallel_for asks for helpers. A worker counts itself in `users`
// before it looks at `wanted`, and the caller takes `wanted` back to 0 and
// waits for `users` to reach 0 before its ForState goes: so a worker either
// finds `wanted` at 0, or is waited for (every step sequentially
// consistent).
struct alignas(64) ThreadPool::ForSlot {
  std::atomic<bool> taken{false};  // by a parallel_for
  std::atomic<int> wanted{0};      // helpers it still asks for
  std::atomic<int> users{0};       // workers looking at it
  std::atomic<ForState*> state{nullptr};
};

ThreadPool::ThreadPool(int threads, const char* name)
    : fors_(new ForSlot[kForSlots]), generation_(fork_generation()) {
  if (threads < 0) threads = default_threads();
  workers_.reserve(threads);
  try {
    for (int i = 0; i < threads; ++i)
      workers_.emplace_back([this, n = std::string(name ? name : "cascade-io")] {
        name_this_thread(n.c_str());
        run();
      });
  } catch (...) {
    stop_and_join();  // a joinable std::thread must not be destroyed
    throw;
  }
}

ThreadPool::~ThreadPool() {
  if (fork_generation() != generation_) {
    // A forked child: the workers are the parent's threads, not here to
    // join (their handles may even name threads of this process now). They
    // are left as they are.
    new std::vector<std::thread>(std::move(workers_));
    return;
  }
  stop_and_join();
}

void ThreadPool::stop_and_join() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  epoch_.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&epoch_);
  for (auto& t : workers_) t.join();
}

void ThreadPool::wake(int n) {
  epoch_.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake(&epoch_, n);
}

void ThreadPool::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  wake(1);
}

bool ThreadPool::help_a_for() {
  for (int k = 0; k < kForSlots; ++k) {
    ForSlot& slot = fors_[k];
    if (slot.wanted.load(std::memory_order_relaxed) <= 0) continue;
    slot.users.fetch_add(1, std::memory_order_seq_cst);
    int w = slot.wanted.load(std::memory_order_seq_cst);
    while (w > 0 && !slot.wanted.compare_exchange_weak(w, w - 1, std::memory_order_seq_cst)) {
    }
    if (w > 0) slot.state.load(std::memory_order_acquire)->work();
    slot.users.fetch_sub(1, std::memory_order_seq_cst);
    if (w > 0) return true;
  }
  return false;
}

// A worker: takes part in a parallel_for, then runs a queued job, in turn;
// when there is neither it sleeps until epoch_ moves. It reads epoch_ before it
// looks, and a producer bumps epoch_ after it publishes and reads sleepers_
// after the bump, so a worker that missed new work finds epoch_ changed
// when it goes to sleep, or is woken.
void ThreadPool::run() {
  while (true) {
    const uint32_t seen = epoch_.load(std::memory_order_seq_cst);
    // One parallel_for, then one queued job: a stream of parallel_fors
    // from other threads must not keep a job waiting.
    const bool helped = help_a_for();
    std::function<void()> job;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!jobs_.empty()) {
        job = std::move(jobs_.front());
        jobs_.pop_front();
      } else if (stop_ && !helped) {
        return;
      }
    }
    if (job) job();
    if (job || helped) continue;
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    if (epoch_.load(std::memory_order_seq_cst) == seen) futex_wait(&epoch_, seen, -1);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t)>& fn, int max_workers) {
  if (n == 0) return;
  const int size = static_cast<int>(workers_.size());
  if (max_workers < 0 || max_workers > size) max_workers = max_workers < 0 ? size - 1 : size;
  const int helpers =
      static_cast<int>(std::min<size_t>(n - 1, static_cast<size_t>(std::max(max_workers, 0))));
  ForSlot* slot = nullptr;
  if (helpers > 0) {
    for (int k = 0; k < kForSlots && !slot; ++k) {
      bool free = false;
      if (fors_[k].taken.compare_exchange_strong(free, true, std::memory_order_acquire))
        slot = &fors_[k];
    }
  }
  if (!slot) {  // nothing to share, or every slot in use: the caller does it all
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  ForState state(n, &fn);
  slot->state.store(&state, std::memory_order_release);
  slot->wanted.store(helpers, std::memory_order_seq_cst);
  wake(helpers);
  state.work();
  // Every item is taken: no more helpers; wait for the items others took,
  // then for the workers still looking at the slot.
  slot->wanted.store(0, std::memory_order_seq_cst);
  if (state.done.load(std::memory_order_acquire) != n) state.wait_all_done();
  while (slot->users.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
  slot->state.store(nullptr, std::memory_order_relaxed);
  slot->taken.store(false, std::memory_order_release);
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
