// Plain option and statistics structs of the CUDA layer: how host<->device
// copies are made (TransferTuning) and how the device arena maps memory
// (GpuArenaOptions, GpuArenaStats). No CUDA header is included, so the gpu
// tier's public surface and the store's configuration can name them in
// builds without CUDA.
#pragma once

#include <cstdint>

namespace cascade {

// How copies between host and device memory move (device-to-device copies
// always use the kernel, or one copy each when very large).
enum class SmallCopyMethod : uint8_t {
  kAuto,      // by size, as TransferTuning says (the default)
  kKernel,    // the batched copy kernel: reads/writes registered host memory over PCIe
  kBatchApi,  // cudaMemcpyBatchAsync (CUDA 13); one copy each where unsupported
  kPerCopy,   // one cudaMemcpyAsync each
};

// The defaults follow how much of the link each method reaches by item size
// (docs/benchmarks.md, GPU tier): below 64 KiB the kernel moves far more than
// either DMA method; from 64 KiB one cudaMemcpyBatchAsync per batch runs near
// the link's speed; one DMA copy per item pays a per-call cost that only
// large items hide.
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
  // driver's costs are per allocation, not per byte (cuMemSetAccess walks
  // every allocation in its range; docs/benchmarks.md has the figures), so
  // fewer, larger pages map faster; 32 MiB pages still trim in small steps.
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

struct GpuArenaStats {
  bool elastic = false;
  uint64_t page_bytes = 0;      // physical page size (GpuArenaOptions::page_bytes)
  uint64_t reserved_bytes = 0;  // virtual range reserved at open
  uint64_t mapped_bytes = 0;    // backed by physical pages now
  uint64_t peak_mapped_bytes = 0;
  uint64_t live_end = 0;      // end of the highest live allocation
  uint64_t pooled_pages = 0;  // created, not mapped (ready for growth)
  uint64_t growths = 0;       // map calls (each maps one or more pages)
  uint64_t pages_mapped = 0;  // totals since open
  uint64_t pages_unmapped = 0;
  uint64_t trims = 0;
  uint64_t creates_on_demand = 0;  // pages created on the hot path (pool empty)
};

}  // namespace cascade
