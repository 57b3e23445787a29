// GpuTier: blocks in GPU memory (the top tier of "gpu|host|file").
//
// Device memory comes from a DeviceArena: one virtual range of the tier's
// capacity reserved at open, backed by 2 MiB physical pages mapped as the
// allocator's live end rises and unmapped (after a device synchronization,
// off the hot path) when it falls. Ranges come from an ExtentAllocator, ids
// map to ranges in a BlockIndex (leases, eviction order), as in the host
// tier. acquire() hands out a device pointer under a lease (zero copy).
// Copies run on the caller's stream when one is given (PutOptions /
// ReadRequest cuda_stream) and complete before the call returns; see
// DeviceTransfers for the paths.
//
// Streams without a caller stream: when the caller's buffer is device
// memory the legacy default stream is used, so the copy is ordered after
// work the caller queued there; copies from or to host memory use the
// tier's own non-blocking streams.
//
// This header includes no CUDA header: the tier is built only with CUDA
// (gpu_tier_cuda.cc); without it the factories return Unavailable
// (gpu_tier_cuda_stub.cc).
//
// Thread-safety: all methods are thread-safe. Ownership: the pool outlives
// the tier; BlockViews and pointers from acquire() must be released (and
// kernels using them finished) before the tier is destroyed.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "cascade/config.h"
#include "cascade/tier.h"

namespace cascade {

class ThreadPool;

// How copies between host and device memory move (device-to-device copies
// always use the kernel, or one copy each when very large).
enum class SmallCopyMethod : uint8_t {
  kAuto,      // by size, as TransferTuning says (the default)
  kKernel,    // the batched copy kernel: reads/writes registered host memory over PCIe
  kBatchApi,  // cudaMemcpyBatchAsync (CUDA 13); one copy each where unsupported
  kPerCopy,   // one cudaMemcpyAsync each
};

// Measured on the H100 (PCIe Gen5, docs/benchmarks.md): per-copy DMA
// reaches 9% of the link at 16 KiB and 24% at 64 KiB; the kernel 87-88% at
// 16 KiB; cudaMemcpyBatchAsync 8-40% at 16 KiB but 90-98% from 64 KiB on.
struct TransferTuning {
  // Host<->device items (after merging) below this go through the kernel...
  uint64_t kernel_copy_max_bytes = 64ULL << 10;
  // ...items at least this large get one DMA copy each, and those between
  // share one cudaMemcpyBatchAsync.
  uint64_t large_copy_bytes = 16ULL << 20;
  // Device-to-device items this large get a copy each; smaller ones share
  // one kernel launch (a copy call costs microseconds, in which HBM moves
  // megabytes).
  uint64_t large_device_copy_bytes = 64ULL << 20;
  // kAuto, or one method for every host<->device item below large_copy_bytes.
  SmallCopyMethod small_method = SmallCopyMethod::kAuto;
  // Merge items that continue one another on both sides into one copy.
  bool coalesce = true;
};

struct GpuArenaOptions {
  // false: one cudaMalloc of the whole capacity at open (no elastic mapping).
  // Also the fallback where the driver lacks virtual memory management.
  bool elastic = true;
  // Allocation granule: 512 B keeps every block 16-byte aligned for vector
  // copies without wasting much on small blocks.
  uint64_t allocation_unit = 512;
  // Physical page size (a multiple of the driver's 2 MiB granularity). The
  // driver's costs are per allocation, not per byte: on the H100 mapping
  // 2 MiB pages costs ~29 us each (mostly cuMemSetAccess, which walks every
  // allocation in its range), a 128 MiB allocation ~0.14 ms. 32 MiB pages
  // map 1 GiB in about a millisecond and still trim in small steps.
  uint64_t page_bytes = 32ULL << 20;
  // Physical pages created ahead of need by a background thread, so growth
  // costs a map, not a create (cuMemCreate is the slow call).
  int handle_pool_pages = 2;
  // Pages mapped per growth at least; access is set once per growth, over
  // the whole new range.
  int map_batch_pages = 1;
  // Unmap automatically when this many mapped bytes lie above the live end.
  uint64_t trim_threshold_bytes = 256ULL << 20;
  // Bytes kept mapped above the live end after a trim (absorbs regrowth).
  uint64_t trim_keep_bytes = 32ULL << 20;
};

struct GpuTierOptions {
  GpuArenaOptions arena;
  TransferTuning transfers;
};

struct GpuArenaStats {
  bool elastic = false;
  uint64_t page_bytes = 0;         // physical page size (GpuArenaOptions::page_bytes)
  uint64_t reserved_bytes = 0;     // virtual range reserved at open
  uint64_t mapped_bytes = 0;       // backed by physical pages now
  uint64_t peak_mapped_bytes = 0;
  uint64_t live_end = 0;           // end of the highest live allocation
  uint64_t pooled_pages = 0;       // created, not mapped (ready for growth)
  uint64_t growths = 0;            // map calls (each maps one or more pages)
  uint64_t pages_mapped = 0;       // totals since open
  uint64_t pages_unmapped = 0;
  uint64_t trims = 0;
  uint64_t creates_on_demand = 0;  // pages created on the hot path (pool empty)
};

class GpuTier : public Tier {
 public:
  // Unavailable when CUDA is absent (build or run time) or the device
  // cannot be used; NoSpace when the device cannot back even the reservation.
  static Result<std::unique_ptr<GpuTier>> Open(const CascadeConfig& config, ThreadPool* pool,
                                               const GpuTierOptions& options = {});

  TierKind kind() const override { return TierKind::kGpu; }
  bool prefers_batches() const override { return true; }
  virtual int device() const = 0;

  // Stores many blocks with one wait: statuses[i] as put() for item i.
  // Items must share options (source kind, stream).
  // REQUIRES: ids, data, sizes, statuses have equal lengths.
  virtual void put_batch(std::span<const BlockId> ids, std::span<const void* const> data,
                         std::span<const uint64_t> sizes, const PutOptions& options,
                         std::span<Status> statuses) = 0;

  // Unmaps pages above the live end now (after synchronizing the device).
  virtual Status trim() = 0;
  virtual GpuArenaStats arena_stats() const = 0;
};

// The factory the store's tier_factory calls for TierKind::kGpu.
Result<std::unique_ptr<Tier>> open_gpu_tier(const CascadeConfig& config, ThreadPool* pool);

}  // namespace cascade
