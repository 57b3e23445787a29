// GpuBackend: the gpu tier used on its own, as the seed API's
// `GPUBackend(capacity_bytes, device_id)`.
//
// Blocks live in device memory of one GPU (an elastic arena: virtual space
// reserved for capacity_bytes, physical 2 MiB pages mapped as it fills and
// given back as it empties). put copies from host or device memory, get
// copies into host or device memory; get_gpu_ptr hands out the block's
// device pointer under a lease, with no copy. Unlike a CascadeStore it
// never evicts: put fails with NoSpace when the arena is full.
//
// Streams: pass a cudaStream_t as `cuda_stream` (void* here, so this header
// needs no CUDA header) to order a copy after work queued on it; every call
// returns once its bytes have arrived. Without a stream, copies whose other
// side is device memory use the legacy default stream; copies from or to
// host memory use the backend's own streams.
//
// Without CUDA (build or run time) Open returns Unavailable.
//
// Thread-safety: all methods are thread-safe. Ownership: BlockViews from
// get_gpu_ptr must be released, and kernels using their pointers finished,
// before the backend is destroyed; a released block's memory may be reused
// by a later put.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "cascade/block_id.h"
#include "cascade/stats.h"
#include "cascade/status.h"
#include "cascade/tier.h"

namespace cascade {

class GpuBackend {
 public:
  // threads: CPU threads for copies from pageable host memory (0 = one per core).
  static Result<std::unique_ptr<GpuBackend>> Open(uint64_t capacity_bytes, int device_id = 0,
                                                  int threads = 0);
  ~GpuBackend();

  Status put(const BlockId& id, const void* data, uint64_t size,
             MemoryKind src_kind = MemoryKind::kHost, void* cuda_stream = nullptr);
  // Many blocks, one wait. statuses (resized) as put() per item.
  void put_batch(std::span<const BlockId> ids, std::span<const void* const> data,
                 std::span<const uint64_t> sizes, std::vector<Status>* statuses,
                 MemoryKind src_kind = MemoryKind::kHost, void* cuda_stream = nullptr);

  // A miss is OK with *found false. Out too small: InvalidArgument, *found
  // true, *size the block's size, nothing written.
  Status get(const BlockId& id, void* out, uint64_t capacity, bool* found, uint64_t* size,
             MemoryKind out_kind = MemoryKind::kHost, void* cuda_stream = nullptr);
  // Many blocks, one wait. found[i], sizes[i], statuses[i] as get() per item.
  void get_batch(std::span<const BlockId> ids, std::span<void* const> out,
                 std::span<const uint64_t> capacities, std::vector<bool>* found,
                 std::vector<uint64_t>* sizes, std::vector<Status>* statuses,
                 MemoryKind out_kind = MemoryKind::kHost, void* cuda_stream = nullptr);

  // The block's device pointer (view.data()) under a lease; NotFound on a miss.
  Result<BlockView> get_gpu_ptr(const BlockId& id);

  bool contains(const BlockId& id) const;
  Status remove(const BlockId& id);
  void clear();
  // Gives unused device pages back to the driver now.
  Status trim();
  TierStats stats() const;
  int device() const;

 private:
  struct Parts;
  explicit GpuBackend(std::unique_ptr<Parts> parts);
  std::unique_ptr<Parts> parts_;
};

}  // namespace cascade
