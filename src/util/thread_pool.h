// ThreadPool: the store's I/O threads.
//
// Two ways in: submit() queues a job; parallel_for() runs n items on the
// workers *and* the calling thread. parallel_for never waits for an item
// that no thread has started, so it may be called from inside a pool job (a
// batch whose items split their own copies) without deadlock: the caller
// does whatever the workers have not picked up.
//
// A parallel_for is published in a slot that idle workers scan, and the
// helpers it asks for are woken with one futex call: they start together
// and take items without a lock, where helpers woken one by one through a
// queue's mutex would join a short batch only near its end. A worker takes
// part in one parallel_for and then runs one queued job, in turn, so callers
// of parallel_for one after another never keep a job waiting.
//
// Thread-safety: all methods are thread-safe. The destructor runs the jobs
// still queued, then joins.
//
// Starting threads can fail (process or memory limits): Create() reports it
// as a Status; the constructor throws std::system_error. Either way the
// threads already started are stopped and joined first.
#pragma once

#include <atomic>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cascade/status.h"

namespace cascade {

class ThreadPool {
 public:
  static constexpr int kMaxThreads = 1024;

  // threads: 0 for one per core, else 1..kMaxThreads (InvalidArgument
  // otherwise). A thread that cannot be started is an error status. The
  // workers carry `name` (util/thread_name.h).
  static Result<std::unique_ptr<ThreadPool>> Create(int threads, const char* name = "cascade-io");

  // threads < 0: one per core; 0: none (caller only). Throws
  // std::system_error when a thread cannot be started.
  explicit ThreadPool(int threads, const char* name = "cascade-io");
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()); }
  void submit(std::function<void()> job);

  // Runs fn(i) for every i in [0, n); returns when all have returned.
  // Uses at most max_workers pool threads besides the caller; the default
  // (-1) is size() - 1, so a pool of T threads moves data on T threads
  // (caller included) and keeps one worker free for queued jobs.
  void parallel_for(size_t n, const std::function<void(size_t)>& fn, int max_workers = -1);

  static int default_threads();  // cores, at most 64

 private:
  struct ForState;
  struct ForSlot;
  void run();
  // Takes items of a parallel_for that asks for helpers; false when none does.
  bool help_a_for();
  // Wakes up to n sleeping workers (after the work was published and
  // epoch_ bumped).
  void wake(int n);
  void stop_and_join();
  std::mutex mu_;
  std::deque<std::function<void()>> jobs_;  // guarded by mu_
  bool stop_ = false;                       // guarded by mu_
  // Bumped whenever there is something new to do; idle workers sleep on it
  // (a futex), so one call wakes as many as a parallel_for asks for.
  std::atomic<uint32_t> epoch_{0};
  std::atomic<int> sleepers_{0};
  std::unique_ptr<ForSlot[]> fors_;  // the parallel_fors asking for helpers
  const uint64_t generation_;        // fork_generation() of the process that made it
  std::vector<std::thread> workers_;
};

// Copies n bytes (with copy_bytes), split across the pool's threads when
// n >= threshold. Slices are at least 1 MiB and 4 KiB aligned.
void parallel_memcpy(ThreadPool* pool, void* dst, const void* src, size_t n, size_t threshold);

}  // namespace cascade
