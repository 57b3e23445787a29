#include "os/committed_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace cascade {

Status CommittedMemory::commit(uint64_t end) {
  if (end <= committed_.load(std::memory_order_acquire)) return Status::OK();
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t have = committed_.load(std::memory_order_relaxed);
  if (end <= have) return Status::OK();
  const uint64_t want = std::min(capacity_, (end + kStep - 1) / kStep * kStep);
  // A failed step advertises nothing: only what is certainly backed counts.
  CASCADE_RETURN_IF_ERROR(back_(have, want));
  committed_.store(want, std::memory_order_release);
  return Status::OK();
}

void CommittedMemory::release(const std::function<void(uint64_t bytes)>& drop) {
  std::lock_guard<std::mutex> lock(mu_);
  drop(committed_.load(std::memory_order_relaxed));
  committed_.store(0, std::memory_order_release);
}

int populate_pages(uint8_t* p, uint64_t n) {
  return ::madvise(p, n, MADV_POPULATE_WRITE) == 0 ? 0 : errno;
}

}  // namespace cascade
