// GpuTier: blocks in GPU memory (an ArenaTier; the top tier of
// "gpu|host|file").
//
// Device memory comes from a DeviceArena: one virtual range of the tier's
// capacity reserved at open, backed by physical pages
// (GpuArenaOptions::page_bytes) mapped as the allocator's live end rises and
// unmapped (after a device synchronization, off the hot path) when it
// falls. The index, leases, eviction order, acquire() (a device pointer
// under a lease, zero copy) and stats come from ArenaTier; this tier
// supplies the memory and its own put and read paths, which copy whole
// batches in pipelined chunks. Copies run on the caller's stream when one is
// given (PutOptions / ReadRequest cuda_stream) and complete before the call
// returns; see DeviceTransfers for the paths.
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
#include "cuda/cuda_options.h"
#include "tiers/arena_tier.h"

namespace cascade {

class ThreadPool;

struct GpuTierOptions {
  GpuArenaOptions arena;
  TransferTuning transfers;
};

class GpuTier : public ArenaTier {
 public:
  // Unavailable when CUDA is absent (build or run time) or the device
  // cannot be used; NoSpace when the device cannot back even the reservation.
  static Result<std::unique_ptr<GpuTier>> Open(const CascadeConfig& config, ThreadPool* pool,
                                               const GpuTierOptions& options = {});

  TierKind kind() const override { return TierKind::kGpu; }
  bool prefers_batches(MemoryKind) const override { return true; }
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

 protected:
  GpuTier(const CascadeConfig& config, uint8_t* base, uint64_t capacity)
      : ArenaTier(config, base, capacity, MemoryKind::kDevice, "the gpu tier") {}
};

// The factory the store's tier_factory calls for TierKind::kGpu.
Result<std::unique_ptr<Tier>> open_gpu_tier(const CascadeConfig& config, ThreadPool* pool);

}  // namespace cascade
