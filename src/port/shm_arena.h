// ShmArena: a shared-memory file mapped into this process (the host tier's
// memory).
//
// The file (shm_path, normally under /dev/shm) is created sparse at the
// arena's capacity and locked with flock, so a second store on the same path
// is refused instead of corrupting the first. Memory is committed in 64 MiB
// steps with fallocate as the allocator's high-water mark rises: a full
// /dev/shm then fails a put with NoSpace instead of killing the process with
// SIGBUS on first touch. Committed steps are pre-mapped (MADV_POPULATE_WRITE)
// so copies do not take a page fault per 4 KiB. Huge pages are requested
// with MADV_HUGEPAGE where the kernel allows them on shared memory.
//
// The file is a cache, not a database: it is removed when the arena closes
// (a file left by a crashed process is taken over and truncated).
//
// Thread-safety: commit() is thread-safe; base() is immutable.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "cascade/status.h"

namespace cascade {

class ShmArena {
 public:
  static constexpr uint64_t kCommitStep = 64ULL << 20;

  static Result<std::unique_ptr<ShmArena>> Create(const std::string& path, uint64_t capacity,
                                                  bool prefault);
  ~ShmArena();
  ShmArena(const ShmArena&) = delete;
  ShmArena& operator=(const ShmArena&) = delete;

  uint8_t* base() const { return base_; }
  uint64_t capacity() const { return capacity_; }
  const std::string& path() const { return path_; }

  // Ensures [0, end) is backed by memory. NoSpace when the file system is full.
  Status commit(uint64_t end);
  uint64_t committed() const { return committed_.load(std::memory_order_acquire); }

 private:
  ShmArena(std::string path, int fd, uint8_t* base, uint64_t capacity)
      : path_(std::move(path)), fd_(fd), base_(base), capacity_(capacity) {}
  std::string path_;
  int fd_;
  uint8_t* base_;
  uint64_t capacity_;
  std::mutex commit_mu_;
  std::atomic<uint64_t> committed_{0};
};

}  // namespace cascade
