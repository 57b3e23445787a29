// DeviceArena: the gpu tier's device memory, elastic.
//
// One virtual range of the tier's capacity is reserved at open
// (cuMemAddressReserve). Physical pages (GpuArenaOptions::page_bytes, a
// multiple of the driver's 2 MiB granularity) are mapped at its start as the live end of the
// allocations rises, several at a time, with access set once over each newly mapped range. A
// background thread keeps a few pages created ahead of need (cuMemCreate is
// the slow call) and performs trims: when enough mapped memory lies above
// the live end, it synchronizes the device (no kernel or copy can still be
// touching those pages — including kernels of callers that used a pointer
// from a lease they have since released), then unmaps the pages, keeping up
// to the pool size of them for regrowth and releasing the rest. An
// allocation that lands above a trim in progress waits for it, then maps
// again. A failed growth unmaps what it mapped (nothing half-done stays).
//
// Without virtual memory management (or with elastic off) the arena is one
// cudaMalloc of the whole capacity.
//
// Lock order: mu_ only; the allocator's own lock is taken under it; no CUDA
// synchronization while holding it.
// Private: included only by files compiled with CUDA.
// Thread-safety: all methods are thread-safe.
#pragma once

#include <cuda.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "cascade/status.h"
#include "cuda/cuda_driver.h"
#include "cuda/cuda_options.h"
#include "util/extent_allocator.h"

namespace cascade {

class DeviceArena {
 public:
  static Result<std::unique_ptr<DeviceArena>> Create(int device, uint64_t capacity,
                                                     const GpuArenaOptions& options);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  uint8_t* base() const { return base_; }
  uint64_t capacity() const { return alloc_.capacity(); }
  uint64_t round_up(uint64_t size) const { return alloc_.round_up(size); }

  // Offset of `size` bytes (> 0), mapped and accessible. NoSpace when the
  // arena is full or the device has no memory left for another page.
  Result<uint64_t> allocate(uint64_t size);
  // Ranges for many blocks with one lock and, when one free extent holds
  // them all, one allocator call (blocks laid out in order, so batch copies
  // merge). Fills offsets[i] for sizes[i] (> 0) and returns how many leading
  // items got space; the first that did not is NoSpace (*failure says why).
  size_t allocate_many(std::span<const uint64_t> sizes, std::span<uint64_t> offsets,
                       Status* failure);
  // REQUIRES: (offset, size) came from allocate(); no queued work uses it.
  void free(uint64_t offset, uint64_t size);
  uint64_t used() const { return alloc_.used(); }
  double fragmentation() const { return alloc_.fragmentation(); }

  Status trim();
  GpuArenaStats stats() const;

 private:
  DeviceArena(int device, uint64_t capacity, const GpuArenaOptions& options);
  // Makes [0, end) mapped for a range just allocated; waits for a trim in
  // progress above it. REQUIRES: mu_ held (through lock).
  Status make_mapped(uint64_t end, std::unique_lock<std::mutex>& lock);
  Status grow_locked(uint64_t end);                              // REQUIRES: mu_ held
  void unmap_from_locked(uint64_t new_end);                      // REQUIRES: mu_ held
  void count_pages(uint64_t offset, uint64_t bytes, int delta);  // REQUIRES: mu_ held
  uint64_t live_end_locked() const;                              // REQUIRES: mu_ held
  uint64_t page_round(uint64_t x) const { return (x + page_ - 1) / page_ * page_; }
  void background();

  const int device_;
  const GpuArenaOptions options_;
  const DriverApi* api_ = nullptr;
  bool elastic_ = false;
  uint64_t page_ = 32ULL << 20;
  uint64_t va_bytes_ = 0;
  CUdeviceptr va_ = 0;
  void* fixed_ = nullptr;  // non-elastic backing
  uint8_t* base_ = nullptr;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  ExtentAllocator alloc_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Live allocations overlapping each page (elastic arenas): the live end
  // is just above the highest page in use. Guarded by mu_.
  std::vector<uint32_t> page_users_;
  uint64_t mapped_end_ = 0;  // guarded by mu_
  std::vector<CUmemGenericAllocationHandle>
      mapped_;  // page i backs [i*page, (i+1)*page); guarded by mu_
  std::vector<CUmemGenericAllocationHandle> ready_;  // created, unmapped; guarded by mu_
  bool trimming_ = false;                            // guarded by mu_
  uint64_t trim_floor_ = 0;                          // guarded by mu_
  bool trim_requested_ = false;                      // guarded by mu_
  bool refill_blocked_ = false;                      // the device refused a page; guarded by mu_
  bool stop_ = false;                                // guarded by mu_
  GpuArenaStats counters_;                           // guarded by mu_
  std::thread background_;
};

}  // namespace cascade
