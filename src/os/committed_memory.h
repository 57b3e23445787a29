// CommittedMemory: how much of a mapped range is backed by memory, and the
// threads that back it ahead of use.
//
// Shared-memory arenas (the host tier's file, the remote tier's window
// segment) are mapped whole but backed as needed: commit(end) makes sure
// [0, end) is backed by calling the owner's back(from, to) for the parts
// not backed yet. Backing before the first touch turns a full /dev/shm into
// a NoSpace status at the put that needs the memory, instead of a SIGBUS.
//
// The range is kept as chunks of kChunk bytes, each unbacked, being backed
// (by exactly one thread) or backed. A commit that finds [0, end) not all
// backed backs the unbacked chunks itself, on its own thread: without
// warming, all of them up to end rounded up to kStep in one call per run (a
// sequential filler makes one call per 64 MiB); with warming, only those
// below end, claimed one at a time, so the warmers (which follow the raised
// demand) back the others in parallel. A chunk below end that another
// thread is backing is waited for, not backed twice: the other thread is
// already doing exactly that work, at most one chunk of it remains, and
// backing the same pages concurrently would only contend on them.
//
// Warming (start_warming): background threads claim the lowest unbacked
// chunk below a target, one chunk at a time, in parallel: the target is
// `ahead` bytes beyond the highest end passed to commit (the allocator's
// high-water mark), capped at the capacity, so ahead >= capacity backs the
// whole range. A chunk the warmers fail to back (a full file system) is left
// unbacked and warming stops: the memory is not there, and the put that
// needs it backs it itself and gets the NoSpace. stop_warming (and the
// destructor) lets each warmer finish its current chunk and joins it.
//
// Thread-safety: every method is thread-safe. back() runs without the mutex,
// on one chunk range (or run of chunks) at a time, from several threads at
// once when warming; the owner must stop warming before back() stops
// working (before unmapping).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "cascade/status.h"

namespace cascade {

class CommittedMemory {
 public:
  static constexpr uint64_t kStep = 64ULL << 20;         // what a put backs without warming
  static constexpr uint64_t kChunk = 4ULL << 20;         // the unit of work of a warmer
  static constexpr uint64_t kAheadBytes = 512ULL << 20;  // the "ahead" window (docs/design.md)
  // Backs [from, to) of the range; OK when every byte of it is backed.
  using Back = std::function<Status(uint64_t from, uint64_t to)>;

  CommittedMemory(uint64_t capacity, Back back);
  ~CommittedMemory();
  CommittedMemory(const CommittedMemory&) = delete;
  CommittedMemory& operator=(const CommittedMemory&) = delete;

  // Ensures [0, end) is backed.
  Status commit(uint64_t end);
  // Bytes backed from 0 on, without a gap (lock-free).
  uint64_t committed() const { return committed_.load(std::memory_order_acquire); }
  uint64_t capacity() const { return capacity_; }
  // Calls drop(end of the backed chunks) and counts nothing as backed any
  // more. Stops warming first.
  void release(const std::function<void(uint64_t bytes)>& drop);

  // Starts `threads` (>= 1) warmers keeping `ahead` bytes beyond the
  // highest commit end backed. Once per object; a no-op afterwards.
  void start_warming(uint64_t ahead, int threads);
  // Stops and joins the warmers; each finishes the chunk it is backing.
  void stop_warming();
  // Bytes the warmers backed.
  uint64_t warmed_bytes() const { return warmed_.load(std::memory_order_relaxed); }
  // True while the warmers have work: the target they were last given is
  // not all backed and they run.
  bool warming() const { return live_.load() > 0 && committed() < frontier_.load(); }

 private:
  enum : uint8_t { kUnbacked = 0, kBusy = 1, kBacked = 2 };

  uint64_t chunk_begin(uint64_t i) const { return i * kChunk; }
  uint64_t chunk_end(uint64_t i) const { return std::min(capacity_, (i + 1) * kChunk); }
  // Chunks of [0, bytes).
  uint64_t chunks_below(uint64_t bytes) const {
    return std::min(nchunks_, (bytes + kChunk - 1) / kChunk);
  }
  // Marks chunk i backed or unbacked again; advances the prefix. Under mu_.
  void finish(uint64_t i, bool ok);
  // Raises the demand to end; wakes the warmers when it moved their target
  // a step further.
  void note_demand(uint64_t end);
  void warmer();

  const uint64_t capacity_;
  const uint64_t nchunks_;
  const Back back_;

  std::mutex mu_;
  std::condition_variable done_cv_;  // a chunk stopped being busy
  std::condition_variable work_cv_;  // the warmers' target moved, or stop
  std::vector<uint8_t> state_;       // per chunk (mu_)
  uint64_t prefix_ = 0;              // chunks [0, prefix_) are backed (mu_)
  uint64_t scan_ = 0;                // chunks below scan_ are busy or backed (mu_)
  uint64_t busy_ = 0;                // chunks being backed (mu_)
  std::atomic<uint64_t> committed_{0};

  // Warming. warm_mu_ serializes start_warming and stop_warming.
  std::mutex warm_mu_;
  uint64_t ahead_ = 0;        // set once, before the warmers start (mu_)
  bool stop_ = false;         // the warmers exit (mu_)
  std::atomic<int> live_{0};  // warmers not yet exited
  std::vector<std::thread> warmers_;
  std::atomic<bool> warm_started_{false};
  std::atomic<uint64_t> demand_{0};    // highest end passed to commit
  std::atomic<uint64_t> frontier_{0};  // the highest target given to the warmers
  std::atomic<uint64_t> warmed_{0};
};

// Maps [p, p + n) of a shared mapping in now (MADV_POPULATE_WRITE), so
// later copies take no page fault per page. An errno value, 0 on success.
int populate_pages(uint8_t* p, uint64_t n);

// Threads for warming: one per core, at most 16 (populating is bound by
// memory bandwidth long before that).
int default_warm_threads();

}  // namespace cascade
