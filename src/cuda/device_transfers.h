// DeviceTransfers: moves bytes between device memory and caller buffers,
// one block or a batch at a time, and returns when they have arrived.
//
// Paths, chosen per item:
//   - host side reachable by the GPU (registered arena, cudaHostAlloc'd or
//     registered user memory): DMA straight from/to it, or the batched copy
//     kernel reading/writing it over PCIe. Items that continue one another
//     on both sides, each side within one allocation, are merged first
//     (blocks laid out in order in both arenas become one large copy; the
//     driver refuses a copy that runs from one allocation into the next,
//     even where the two happen to be adjacent). Then, by size (TransferTuning): small
//     items share one launch of the batched copy kernel, medium ones one
//     cudaMemcpyBatchAsync, large ones get a DMA copy each;
//   - pageable host side: through the pinned staging ring, two slots in
//     flight so the CPU copy of one slot overlaps the DMA of the other; many
//     small items share a slot;
//   - device to device: the batched kernel, or one copy each for very large
//     items and for memory of another device.
// No DMA copy crosses from one registered host chunk into the next
// (host_registration.h); such items are split.
// All work goes on the stream given (the caller's, or one the tier picked);
// completion is awaited with an event on that stream, never a device-wide
// synchronization.
//
// Private: included only by files compiled with CUDA.
// Thread-safety: copy() may run concurrently; the object holds no mutable
// state. Ownership: the context and pool outlive it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

#include "cascade/memory_kind.h"
#include "cuda/cuda_options.h"
#include "cuda/device_context.h"
#include "cuda/device_copy.h"

namespace cascade {

class ThreadPool;

class DeviceTransfers {
 public:
  // local: a device range known to be on ctx's device (the tier's arena), so
  // its pointers need no attribute query. pool may be null.
  DeviceTransfers(DeviceContext* ctx, ThreadPool* pool, const TransferTuning& tuning,
                  const void* local_base = nullptr, uint64_t local_bytes = 0)
      : ctx_(ctx),
        pool_(pool),
        tuning_(tuning),
        local_lo_(reinterpret_cast<uintptr_t>(local_base)),
        local_hi_(reinterpret_cast<uintptr_t>(local_base) + local_bytes) {}

  // Copies every item (all with these kinds) on stream s and waits for them.
  // REQUIRES: at least one of dst_kind, src_kind is kDevice; the context's
  // device is current.
  Status copy(std::span<const CopyItem> items, MemoryKind dst_kind, MemoryKind src_kind,
              cudaStream_t s) const;

  // As copy() but returns once the work is queued on s, except items that
  // need the CPU (pageable host memory), which are complete on return. The
  // caller waits on s (an event) before using the bytes.
  Status enqueue(std::span<const CopyItem> items, MemoryKind dst_kind, MemoryKind src_kind,
                 cudaStream_t s) const;

  // Where each side of an item lies, for merging: the start of the device
  // allocation, pinned host allocation or recorded host range holding it,
  // or kUnknownAllocation (never merged).
  static constexpr uintptr_t kUnknownAllocation = 0;
  struct Sides {
    uintptr_t dst = kUnknownAllocation, src = kUnknownAllocation;
  };

  // Queues items whose both sides the GPU reaches directly (device memory of
  // this device, registered or pinned host memory); sides[i] says where
  // item i's sides lie (items merge only where both sides agree).
  Status enqueue_reachable(std::span<const CopyItem> items, std::span<const Sides> sides,
                           bool device_to_device, cudaStream_t s) const;

  // An allocation found, remembered while one call sorts its items
  // (consecutive blocks usually share one).
  struct KnownRange {
    uintptr_t lo = 0, hi = 0;
  };
  // The start of what holds host memory p that the GPU reaches (a recorded
  // range, or an allocation CUDA made or registered), or kUnknownAllocation.
  static uintptr_t host_side_allocation(const void* p, KnownRange* known);

 private:
  static bool find_allocation(uintptr_t a, KnownRange* known);
  // True when p is memory of this device; *allocation: the start of the
  // allocation holding p, or kUnknownAllocation.
  bool device_side_local(const void* p, KnownRange* known, uintptr_t* allocation) const;
  // REQUIRES: method is kKernel or kBatchApi (and allowed on s).
  Status enqueue_small(std::span<const CopyItem> items, SmallCopyMethod method,
                       cudaStream_t s) const;
  Status copy_staged(std::span<const CopyItem> items, bool to_device, cudaStream_t s) const;

  DeviceContext* ctx_;
  ThreadPool* pool_;
  TransferTuning tuning_;
  uintptr_t local_lo_, local_hi_;
};

}  // namespace cascade
