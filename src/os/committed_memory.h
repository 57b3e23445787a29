// CommittedMemory: how much of a mapped range is backed by memory, grown in
// fixed steps and never shrunk except by release().
//
// Shared-memory arenas (the host tier's file, the remote tier's window
// segment) are mapped whole but backed lazily: commit(end) backs [0, end)
// rounded up to the next step (capped at the capacity) by calling the
// owner's back(from, to) for the part not backed yet. Backing up front turns
// a full /dev/shm into a NoSpace status at the put that needs the memory,
// instead of a SIGBUS at the first touch of a page.
//
// Thread-safety: commit() and release() are serialized by one mutex;
// committed() is a lock-free read. back() runs under the mutex.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>

#include "cascade/status.h"

namespace cascade {

class CommittedMemory {
 public:
  static constexpr uint64_t kStep = 64ULL << 20;
  // Backs [from, to) of the range; OK when every byte of it is backed.
  using Back = std::function<Status(uint64_t from, uint64_t to)>;

  CommittedMemory(uint64_t capacity, Back back) : capacity_(capacity), back_(std::move(back)) {}

  // Ensures [0, end) is backed.
  Status commit(uint64_t end);
  uint64_t committed() const { return committed_.load(std::memory_order_acquire); }
  uint64_t capacity() const { return capacity_; }
  // Calls drop(committed bytes) and counts nothing as backed any more.
  void release(const std::function<void(uint64_t bytes)>& drop);

 private:
  const uint64_t capacity_;
  const Back back_;
  std::mutex mu_;
  std::atomic<uint64_t> committed_{0};
};

// Maps [p, p + n) of a shared mapping in now (MADV_POPULATE_WRITE), so
// later copies take no page fault per page. An errno value, 0 on success.
int populate_pages(uint8_t* p, uint64_t n);

}  // namespace cascade
